"""The registry egress proxy (proxy.py): the connections skopeo opens after the
store's check — redirects, token realms, its own name resolution — are checked where
they are made. A registry that redirects to a non-public address gets nothing out of
it; a pull from a listed non-loopback registry goes through the proxy, blobs included."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from apps.sandboxes.backends.local.images import ImageError, ImageStore, RegistryPolicy
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
