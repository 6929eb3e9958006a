"""The registry egress proxy (proxy.py): the connections skopeo opens after the
store's check — redirects, token realms, its own name resolution — are checked where
they are made. A registry that redirects to a non-public address gets nothing out of
it; a pull from a listed non-loopback registry goes through the proxy, blobs included."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from apps.sandboxes.backends.local.images import ImageError, ImageStore, RegistryPolicy
from apps.sandboxes.backends.local.images.errors import PUBLIC_MESSAGES
from apps.sandboxes.backends.local.images.jail import Jail
from apps.sandboxes.backends.local.images.reference import parse
from apps.sandboxes.backends.local.images.skopeo import Skopeo
from apps.sandboxes.backends.local.images.tests.ocibuild import Layout, busybox_layer
from apps.sandboxes.backends.local.images.tests.registry import start

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="unpacking and a dummy link need root")


class _Recorder(BaseHTTPRequestHandler):
    hits: list[str]

    def do_GET(self) -> None:
        self.hits.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


def _serve(handler: type[BaseHTTPRequestHandler], host: str) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def redirecting() -> Iterator[tuple[str, list[str], int]]:
    """A loopback "registry" whose manifests redirect to http://0.0.0.0:<port>/ — on
    Linux that reaches this machine's own listeners — and the listener there."""
    target_hits: list[str] = []
    target = _serve(type("Target", (_Recorder,), {"hits": target_hits}), "127.0.0.1")
    port = target.server_address[1]

    class Registry(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/v2/":
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
                return
            self.send_response(307)
            self.send_header("Location", f"http://0.0.0.0:{port}/stolen{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    registry = _serve(Registry, "127.0.0.1")
    host = f"127.0.0.1:{registry.server_address[1]}"
    try:
        yield host, target_hits, int(port)
    finally:
        registry.shutdown()
        target.shutdown()


def test_a_redirect_to_a_non_public_address_is_refused_by_the_proxy(
    redirecting: tuple[str, list[str], int], tmp_path: Path
) -> None:
    host, hits, port = redirecting
    ref = f"{host}/a/b:c"
    # without the proxy, skopeo follows the redirect to this machine's listener: the
    # hole the proxy closes (and proof that this test can see it)
    plain = subprocess.run(
        ["skopeo", "inspect", "--raw", "--retry-times", "0", "--tls-verify=false",
         f"docker://{ref}"],
        capture_output=True,
        env={k: v for k, v in os.environ.items() if "proxy" not in k.lower()},
        check=False,
    )  # fmt: skip
    assert hits, plain.stderr
    hits.clear()
    store = ImageStore(
        tmp_path / "store",
        policy=RegistryPolicy.of(insecure=[host]),  # the registry itself is listed
        skopeo=Skopeo(retry_times=0),
    )
    with pytest.raises(ImageError) as e:
        store.resolve(ref)
    assert hits == []  # the redirect never reached the listener
    assert ("0.0.0.0", port) in [(h, p) for h, p, _why in store.proxy.refused]
    assert "0.0.0.0" not in e.value.message  # the tenant's message stays fixed


@pytest.fixture
def local_address() -> Iterator[str]:
    """A non-loopback address of this machine (on a veth pair of the test's own): Go
    sends connections to it through the proxy, unlike loopback ones."""
    name = f"hrpx{os.getpid() % 100000}"
    third = os.getpid() % 200 + 20
    address = f"10.217.{third}.1"
    subprocess.run(
        ["ip", "link", "add", name, "type", "veth", "peer", "name", f"{name}p"], check=True
    )
    try:
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", name], check=True)
        subprocess.run(["ip", "link", "set", name, "up"], check=True)
        subprocess.run(["ip", "link", "set", f"{name}p", "up"], check=True)
        yield address
    finally:
        subprocess.run(["ip", "link", "del", name], check=False)


def test_a_pull_from_a_listed_registry_goes_through_the_proxy_blobs_included(
    local_address: str, tmp_path: Path
) -> None:
    proc, reg = start(tmp_path / "registry", auth=False, host=local_address)
    try:
        lay = Layout(tmp_path / "layout")
        lay.tag("v1", lay.image([busybox_layer()], {"Cmd": ["/bin/sh"]}))
        ref = f"{reg.host}/proxied/bb:v1"
        lay.push("v1", ref, None)
        unlisted = ImageStore(tmp_path / "store0", skopeo=Skopeo(retry_times=0))
        with pytest.raises(ImageError) as e:
            unlisted.pull(ref)
        assert e.value.code == "registry_forbidden"  # 10.217.x: private, not listed
        store = ImageStore(tmp_path / "store", policy=RegistryPolicy.of(insecure=[reg.host]))
        rec = store.pull(ref)
        assert store.lower_dirs(rec)[0].joinpath("bin/busybox").is_file()
        # every connection went through the proxy, to the listed registry
        host, port = reg.host.rsplit(":", 1)
        assert (host, int(port)) in store.proxy.allowed
        assert store.proxy.refused == []
        assert reg.blob_gets("proxied/bb") >= 1
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_proxy_refuses_names_that_resolve_to_non_public_addresses() -> None:
    """The proxy resolves a CONNECT target with the policy's resolver and refuses it
    before connecting anywhere (a name skopeo was redirected to, say)."""
    hits: list[str] = []
    target = _serve(type("Pinned", (_Recorder,), {"hits": hits}), "127.0.0.1")
    port = target.server_address[1]
    from apps.sandboxes.backends.local.images.proxy import EgressProxy

    answers = {"pinned.example": ["127.0.0.1"], "meta.example": ["169.254.169.254"]}
    proxy = EgressProxy(lambda: RegistryPolicy.of(resolver=lambda h: answers[h]))
    try:
        # refused: a name resolving to link-local, and one to loopback
        for name in ("meta.example", "pinned.example"):
            with socket.create_connection(("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]))) as s:
                s.sendall(f"CONNECT {name}:{port} HTTP/1.1\r\nHost: {name}\r\n\r\n".encode())
                assert s.recv(100).startswith(b"HTTP/1.1 403")
        assert [h for h, _p, _why in proxy.refused] == ["meta.example", "pinned.example"]
        assert hits == []
    finally:
        proxy.close()
        target.shutdown()


def test_a_redirect_to_loopback_reaches_nothing_of_this_machine(tmp_path: Path) -> None:
    """Go never proxies loopback literals: a listed registry redirecting to
    127.0.0.1:<port> would reach this machine's service directly. skopeo runs in its own
    network namespace (jail.py), where that port is nobody's; the registry itself,
    loopback too, still answers there."""
    hits: list[str] = []
    target = _serve(type("Local", (_Recorder,), {"hits": hits}), "127.0.0.1")
    port = target.server_address[1]
    served: list[str] = []

    class Registry(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            served.append(self.path)
            if self.path == "/v2/":
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
                return
            self.send_response(307)
            self.send_header("Location", f"http://127.0.0.1:{port}/stolen{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    registry = _serve(Registry, "127.0.0.1")
    host = f"127.0.0.1:{registry.server_address[1]}"
    try:
        store = ImageStore(
            tmp_path / "store",
            policy=RegistryPolicy.of(insecure=[host]),
            skopeo=Skopeo(retry_times=0),
        )
        with pytest.raises(ImageError):
            store.resolve(f"{host}/a/b:c")
        assert any(p.startswith("/v2/a/b/manifests/") for p in served), served  # reached
        assert hits == []  # the redirect found nothing on loopback
    finally:
        registry.shutdown()
        target.shutdown()


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _get_in(jail: Jail, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["nsenter", f"--net=/proc/self/fd/{jail.fd}", "curl", "-sS", "-g", "--max-time", "10", url],
        pass_fds=(jail.fd,),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_the_namespace_forwards_an_ipv6_loopback_port_and_no_other() -> None:
    """A forward keyed ``("::1", port)`` listens on ``[::1]`` in the namespace and
    reaches the host's ``[::1]:port``; another ``[::1]`` port of the host is refused
    there (it used to forward IPv4 only)."""
    served: list[str] = []
    other: list[str] = []
    wanted = _V6Server(("::1", 0), type("V6", (_Recorder,), {"hits": served}))
    unlisted = _V6Server(("::1", 0), type("V6b", (_Recorder,), {"hits": other}))
    for server in (wanted, unlisted):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    port, other_port = wanted.server_address[1], unlisted.server_address[1]
    jail = Jail.open({("::1", port): ("::1", port)})
    assert jail is not None
    try:
        got = _get_in(jail, f"http://[::1]:{port}/through")
        assert got.returncode == 0 and got.stdout == "{}", got
        refused = _get_in(jail, f"http://[::1]:{other_port}/not")
        assert refused.returncode == 7, refused  # curl: could not connect
        assert served == ["/through"] and other == []
    finally:
        jail.close()
        wanted.shutdown()
        unlisted.shutdown()


def test_a_redirect_to_ipv6_loopback_reaches_nothing_of_this_machine(tmp_path: Path) -> None:
    """As for 127.0.0.1: a listed registry redirecting to ``http://[::1]:<port>/``
    (Go does not proxy it) finds no listener in skopeo's namespace."""
    hits: list[str] = []
    target = _V6Server(("::1", 0), type("Local6", (_Recorder,), {"hits": hits}))
    threading.Thread(target=target.serve_forever, daemon=True).start()
    port = target.server_address[1]
    served: list[str] = []

    class Registry(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            served.append(self.path)
            if self.path == "/v2/":
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
                return
            self.send_response(307)
            self.send_header("Location", f"http://[::1]:{port}/stolen{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    registry = _serve(Registry, "127.0.0.1")
    host = f"127.0.0.1:{registry.server_address[1]}"
    try:
        store = ImageStore(
            tmp_path / "store",
            policy=RegistryPolicy.of(insecure=[host]),
            skopeo=Skopeo(retry_times=0),
        )
        with pytest.raises(ImageError):
            store.resolve(f"{host}/a/b:c")
        assert any(p.startswith("/v2/a/b/manifests/") for p in served), served  # reached
        assert hits == []  # the redirect found nothing on [::1]
    finally:
        registry.shutdown()
        target.shutdown()


def _as_nobody(
    ref: str, authfile: Path, accept: bool, op: str = "manifest"
) -> tuple[str, str, str]:
    """Skopeo.manifest in a child process that gave up root (uid/gid 65534): the code
    and messages of its ImageError, or ("fetched", "", "")."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            # a home of its own: root's ~/.config is not readable now
            os.environ.update(HOME=str(authfile.parent), XDG_CONFIG_HOME=str(authfile.parent))
            os.environ.pop("XDG_RUNTIME_DIR", None)
            skopeo = Skopeo(retry_times=0, allow_unprotected_loopback=accept)
            skopeo.proxy = lambda: "http://127.0.0.1:9"
            parsed = parse(ref)
            try:
                if op == "manifest":
                    skopeo.manifest(parsed, parsed.transport, authfile, insecure=True)
                else:  # an uploaded archive's import: skopeo gets the same environment
                    skopeo.copy_from(ref, f"oci:{authfile.parent}/none", authfile.parent / "out")
                result = ["fetched", "", ""]
            except ImageError as e:
                result = [e.code, e.message, e.detail]
            os.write(write, json.dumps(result).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, data
    code, message, detail = json.loads(data)
    return code, message, detail


def test_without_root_a_pull_is_refused_unless_the_operator_accepts_open_loopback(
    tmp_path: Path,
) -> None:
    """Not root there is no namespace for skopeo: the call is refused before skopeo
    runs (nothing reaches even a listed loopback registry), a typed error whose detail
    names the setting; with ``allow_unprotected_loopback`` skopeo runs and reaches
    loopback directly — the gap the refusal keeps closed."""
    served: list[str] = []
    registry = _serve(type("Reg", (_Recorder,), {"hits": served}), "127.0.0.1")
    ref = f"127.0.0.1:{registry.server_address[1]}/a/b:c"
    tmp_path.chmod(0o755)
    for parent in tmp_path.parents:  # pytest's base dirs are 0700: let uid 65534 through
        if parent == Path(tempfile.gettempdir()):
            break
        parent.chmod(parent.stat().st_mode | 0o011)
    auth = tmp_path / "auth.json"
    auth.write_text('{"auths": {}}')
    auth.chmod(0o644)
    try:
        code, message, detail = _as_nobody(ref, auth, accept=False)
        assert (code, message) == ("image_store_error", PUBLIC_MESSAGES["image_store_error"])
        assert "HEDGEROW_REGISTRY_ALLOW_UNPROTECTED_LOOPBACK" in detail
        assert served == []  # nothing was sent
        # an archive import is refused the same way, not blamed on the archive
        code, _, detail = _as_nobody(ref, auth, accept=False, op="copy_from")
        assert code == "image_store_error" and "UNPROTECTED_LOOPBACK" in detail, detail
        code, _, detail = _as_nobody(ref, auth, accept=True)
        assert "HEDGEROW_REGISTRY_ALLOW_UNPROTECTED_LOOPBACK" not in detail
        assert any(p.startswith("/v2/a/b/manifests/") for p in served), (served, code, detail)
    finally:
        registry.shutdown()
