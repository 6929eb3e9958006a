"""OCI images as sandbox roots on the local backend (issue 15): pulled through the
store, mounted as an idmapped overlay with a writable upper dir in the sandbox's
volume, run by bwrap in both launch modes, torn down without a trace.

Every image is built here (images/tests/ocibuild.py) and pushed to the real registry
fixture; the SWE flow runs on the cached Debian userland (python3, pytest, git).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from apps.sandboxes.backends.base import ImageUnavailable, RegistryCredentials
from apps.sandboxes.backends.local import LocalBackend, wait_healthy
from apps.sandboxes.backends.local._sys import is_alive, proc_start_time
from apps.sandboxes.backends.local.backend import lease_holder
from apps.sandboxes.backends.local.images.tests.fixtures import SweImage
from apps.sandboxes.backends.local.images.tests.ocibuild import (
    E,
    Layout,
    busybox_layer,
    layer,
)
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, Registry
from apps.sandboxes.backends.local.images.tests.swe import PATCH, TESTBED_FILES

from .conftest import Sandbox, needs_root, new_spec

pytestmark = needs_root
CREDS = RegistryCredentials(USER, PASSWORD)
APPLETS = ("dd", "mkdir", "pwd", "grep", "wc", "head", "sed", "cut", "sync", "chmod", "chown", "ln")
# Docker's default capability set (CapEff of a container's root: 00000000a80425fb)
DOCKER_CAPS = "00000000a80425fb"


def _tools_layer() -> tuple[bytes, str]:
    """More busybox applets, and content the next layer deletes or hides."""
    return layer(
        [
            *(E(f"bin/{a}", "symlink", link="busybox") for a in APPLETS),
            E("etc/gone", data=b"deleted by the next layer\n"),
            E("opt", "dir", mode=0o755),
            E("opt/app", "dir", mode=0o755),
            E("opt/app/old", data=b"hidden by the opaque dir\n"),
            E("etc/owned-by-root", data=b"layer\n", mode=0o644),
        ]
    )


def _whiteout_layer() -> tuple[bytes, str]:
    return layer(
        [
            E("etc/.wh.gone"),
            E("opt/app", "dir", mode=0o755),
            E("opt/app/.wh..wh..opq"),
            E("opt/app/new", data=b"new\n"),
        ]
    )


BUSYBOX_CONFIG = {
    "Env": ["PATH=/bin:/custom/bin", "FOO=from the image", "HOME=/root"],
    "WorkingDir": "/srv/app",
    "Cmd": ["/bin/sh"],
}


@pytest.fixture(scope="module")
def busybox_image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    lay = Layout(tmp_path_factory.mktemp("launch-bb") / "layout")
    desc = lay.image([busybox_layer(), _tools_layer(), _whiteout_layer()], BUSYBOX_CONFIG)
    lay.tag("v1", desc)
    ref = f"{registry.host}/launch/busybox:v1"
    lay.push("v1", ref, registry.creds)
    return ref


def _digest_of(ref: str, backend: LocalBackend) -> str:
    return backend.resolve_image(ref, CREDS).digest


@pytest.fixture
def image_sandbox(backend: LocalBackend) -> Iterator[Callable[..., Sandbox]]:
    made: list[tuple[LocalBackend, str]] = []

    def make(image: str, on: LocalBackend | None = None, **overrides: Any) -> Sandbox:
        b = on or backend
        spec = new_spec(image=image, registry_credentials=CREDS, **overrides)
        made.append((b, spec.sandbox_id))
        endpoint = b.provision(spec)
        wait_healthy(endpoint, spec.agent_token, timeout=20)
        return Sandbox(b, spec, endpoint)

    yield make
    for b, sid in made:
        b.destroy(sid)


def _mounted(path: Path, mountinfo: str | None = None) -> bool:
    text = mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_text()
    return any(line.split(" ")[4] == str(path) for line in text.splitlines())


def _zygote_launcher_mountinfo(backend: LocalBackend) -> str:
    """The mount table bwrap starts from with the zygote: its launcher namespace,
    read through the zygote's fd of it (zygote/daemon.py make_launcher_ns)."""
    answer = backend.zygote.ping()
    assert answer is not None
    pid = int(answer["pid"])
    own = os.readlink(f"/proc/{pid}/ns/mnt")
    for fd in os.listdir(f"/proc/{pid}/fd"):
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
        if link.startswith("mnt:[") and link != own:
            out = subprocess.run(
                ["nsenter", f"--mount=/proc/{pid}/fd/{fd}", "cat", "/proc/self/mountinfo"],
                capture_output=True,
                text=True,
                check=True,
            )
            return out.stdout
    raise AssertionError("the zygote holds no launcher mount namespace")


def _leftovers(backend: LocalBackend, sid: str) -> list[str]:
    found = []
    target = backend.roots_dir / sid
    if _mounted(target):
        found.append(f"mount {target}")
    if os.path.lexists(target):
        found.append(f"dir {target}")
    if (
        backend.config.image_store / "leases" / lease_holder(backend.config.instance, sid)
    ).exists():
        found.append(f"lease {sid}")
    assert backend.storage is not None
    if os.path.lexists(backend.storage.mount / sid):
        found.append(f"volume {sid}")
    if backend._dir(sid).exists():
        found.append(f"state dir {sid}")
    return found


# ---- run an image -----------------------------------------------------------------


def test_image_runs_with_a_writable_root_and_its_config(
    backend: LocalBackend, image_sandbox: Callable[..., Sandbox], busybox_image: str
) -> None:
    events: list[dict[str, Any]] = []
    spec = new_spec(image=busybox_image, registry_credentials=CREDS)
    endpoint = backend.provision(spec, progress=events.append)
    try:
        wait_healthy(endpoint, spec.agent_token, timeout=20)
        sb = Sandbox(backend, spec, endpoint)
        digest = _digest_of(busybox_image, backend)
        assert endpoint.image_digest == digest
        assert backend.endpoint(sb.id) == endpoint  # adopted: the digest again
        assert {"phase": "done", "digest": digest} in events
        meta = json.loads((backend._dir(sb.id) / "meta.json").read_text())
        assert meta["image_digest"] == digest
        # leased under this instance's name for it: collection and the reconciler see it
        lease = backend.config.image_store / "leases" / lease_holder(backend.config.instance, sb.id)
        assert json.loads(lease.read_text()) == {"digest": digest}

        # root of its own root: writes anywhere, copied up into its volume
        code, out, err = sb.sh(
            "id -u && echo hi > /etc/new && mkdir -p /usr/lib/x && echo y > /usr/lib/x/f "
            "&& echo more >> /etc/owned-by-root && cat /etc/new /usr/lib/x/f /etc/owned-by-root"
        )
        assert (code, out) == (0, "0\nhi\ny\nlayer\nmore\n"), err
        upper = backend.storage.mount / sb.id / "root" / "upper"  # type: ignore[union-attr]
        assert (upper / "etc" / "new").read_text() == "hi\n"
        # the layers are untouched
        rec = backend._image_store().get(digest)
        assert rec is not None
        lower = backend._image_store().lower_dirs(rec)
        assert not any((d / "etc" / "new").exists() for d in lower)
        assert b"more" not in next(
            (d / "etc" / "owned-by-root").read_bytes()
            for d in lower
            if (d / "etc" / "owned-by-root").exists()
        )

        # whiteouts and opaque dirs are deletions
        code, out, _ = sb.sh("ls /opt/app; test -e /etc/gone || echo gone")
        assert (code, out) == (0, "new\ngone\n")

        # Env (image over the defaults, PATH from the image) and WorkingDir
        code, out, _ = sb.sh('echo "$FOO|$PATH|$HOME|$LANG"; pwd')
        assert out == "from the image|/bin:/custom/bin|/root|C.UTF-8\n/srv/app\n"
        # /workspace and /tmp are the volume's, as for any sandbox
        assert sb.sh("echo w > /workspace/w && echo t > /tmp/t && cat /workspace/w /tmp/t")[1] == (
            "w\nt\n"
        )
        # nosuid and the /proc masking stay
        code, out, _ = sb.sh("grep ' / / ' /proc/self/mountinfo | grep -c nosuid; cat /proc/kcore")
        assert out.startswith("1\n") and code != 0
    finally:
        backend.destroy(spec.sandbox_id)
    assert _leftovers(backend, spec.sandbox_id) == []


def test_two_sandboxes_of_one_image_are_isolated(
    backend: LocalBackend, image_sandbox: Callable[..., Sandbox], busybox_image: str
) -> None:
    a = image_sandbox(busybox_image)
    b = image_sandbox(busybox_image)
    assert a.sh("echo a > /etc/mine && rm /etc/owned-by-root")[0] == 0
    code, out, _ = b.sh("test -e /etc/mine || echo not here; cat /etc/owned-by-root")
    assert (code, out) == (0, "not here\nlayer\n")
    assert a.sh("cat /etc/mine; test -e /etc/owned-by-root || echo deleted")[1] == "a\ndeleted\n"


def test_roots_mounted_after_the_zygote_started_reach_it(
    backend: LocalBackend, image_sandbox: Callable[..., Sandbox], busybox_image: str
) -> None:
    """<state>/roots is a shared mount made before the zygote starts: a root mounted
    later propagates into the zygote's launcher namespace (an rslave copy of the
    host's, whose / is private), and its unmount does too."""
    image_sandbox(busybox_image)  # the zygote runs now
    pid = backend.zygote.ping()["pid"]  # type: ignore[index]
    later = image_sandbox(busybox_image)
    assert backend.zygote.ping()["pid"] == pid  # type: ignore[index] # not restarted
    target = backend.roots_dir / later.id
    assert _mounted(target, _zygote_launcher_mountinfo(backend))
    assert later.sh("echo ok")[1] == "ok\n"
    backend.destroy(later.id)
    assert not _mounted(target, _zygote_launcher_mountinfo(backend))
    assert _leftovers(backend, later.id) == []


def test_exec_launch_runs_an_image(
    backend: LocalBackend, image_sandbox: Callable[..., Sandbox], debian_image: str
) -> None:
    exec_backend = LocalBackend(
        replace(backend.config, agent_launch="exec", allow_unprotected_exec_launch=True)
    )
    sb = image_sandbox(debian_image, on=exec_backend)
    assert exec_backend.endpoint(sb.id) is not None
    assert json.loads((backend._dir(sb.id) / "meta.json").read_text())["launch"] == "exec"
    code, out, err = sb.sh(
        "echo hi > /usr/local/hi && cat /usr/local/hi && pwd && id -u && "
        "chown 1000:1000 /usr/local/hi && stat -c %u /usr/local/hi && "
        "grep ^CapEff /proc/self/status | cut -f2"
    )
    assert (code, out) == (0, f"hi\n/testbed\n0\n1000\n{DOCKER_CAPS}\n"), err
    exec_backend.destroy(sb.id)
    assert _leftovers(backend, sb.id) == []


@pytest.fixture(scope="module")
def user_image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    lay = Layout(tmp_path_factory.mktemp("launch-user") / "layout")
    group = layer([E("etc/group", data=b"root:x:0:\nstaff:x:50:user\n")])
    config = {"User": "user:staff", "WorkingDir": "/home/user"}
    lay.tag("v1", lay.image([busybox_layer(), _tools_layer(), group], config))
    ref = f"{registry.host}/launch/user:v1"
    lay.push("v1", ref, registry.creds)
    return ref


def test_root_of_an_image_has_the_container_default_capabilities(
    image_sandbox: Callable[..., Sandbox],
    sandbox_factory: Callable[..., Sandbox],
    busybox_image: str,
) -> None:
    sb = image_sandbox(busybox_image)
    code, out, err = sb.sh(
        "grep -E '^Cap(Eff|Bnd)' /proc/self/status | cut -f2; "
        "touch /owned && chown 1000:50 /owned && stat -c %u:%g /owned"
    )
    assert (code, out) == (0, f"{DOCKER_CAPS}\n{DOCKER_CAPS}\n1000:50\n"), err
    # nothing beyond: no mounts (no CAP_SYS_ADMIN, and seccomp), no raw sockets on the
    # host-owned network namespace
    assert sb.sh("mkdir /m && mount -t tmpfs none /m")[0] != 0
    # a host sandbox's commands keep none
    host = sandbox_factory()
    assert host.sh("grep ^CapEff /proc/self/status | cut -f2")[1] == "0000000000000000\n"


def test_image_user_runs_commands_with_its_ids(
    image_sandbox: Callable[..., Sandbox], user_image: str
) -> None:
    sb = image_sandbox(user_image)
    code, out, err = sb.sh("id -u; id -g; id -G; pwd; grep ^CapEff /proc/self/status | cut -f2")
    assert (code, out) == (0, "1000\n50\n50\n/home/user\n0000000000000000\n"), err
    # an unprivileged user: root's files are not its own
    assert sb.sh("touch /etc/x")[0] != 0
    # /workspace is the user's (the WorkingDir the agent made is root's, as with
    # Docker's run -w)
    code, out, _ = sb.sh("touch /tmp/x /workspace/x && stat -c %u:%g /workspace/x")
    assert (code, out) == (0, "1000:50\n")


# ---- limits and failures ----------------------------------------------------------


def test_writes_to_the_root_count_against_the_disk_quota(
    backend: LocalBackend, image_sandbox: Callable[..., Sandbox], busybox_image: str
) -> None:
    sb = image_sandbox(busybox_image, disk_mib=64)
    code, _, err = sb.sh("dd if=/dev/zero of=/var-big bs=1M count=200 && sync", timeout=60)
    assert code != 0
    assert "quota" in err.lower() or "no space" in err.lower(), err
    usage = backend.disk_usage(sb.id)
    assert usage is not None and usage <= 64 << 20
    # the sandbox goes on: deleting frees it
    assert sb.sh("rm /var-big && echo ok")[1] == "ok\n"


def test_an_unpullable_image_is_typed_and_leaves_nothing(
    backend: LocalBackend, registry: Registry, busybox_image: str
) -> None:
    cases = [
        (f"{registry.host}/launch/nothing:v1", CREDS, "image_not_found"),
        (busybox_image, RegistryCredentials(USER, "wrong"), "registry_unauthorized"),
        (busybox_image, None, "registry_unauthorized"),
        ("Not A Reference!", CREDS, "image_reference_invalid"),
    ]
    for ref, creds, code in cases:
        spec = new_spec(image=ref, registry_credentials=creds)
        with pytest.raises(ImageUnavailable) as err:
            backend.provision(spec)
        assert (err.value.code, err.value.reference) == (code, ref)
        assert _leftovers(backend, spec.sandbox_id) == []


def test_a_warm_create_within_the_proof_window_asks_no_registry(
    backend: LocalBackend, registry: Registry, image_sandbox: Callable[..., Sandbox], tmp_path: Path
) -> None:
    """The control plane's create resolves the image with the tenant's login (cached
    RESOLVE_CACHE_S per credentials); provision then leases the stored image without
    a second registry round trip. Other credentials still prove access themselves."""
    lay = Layout(tmp_path / "layout")
    desc = lay.image([busybox_layer()], {"Cmd": ["/bin/sh"]})
    lay.tag("v1", desc)
    ref = f"{registry.host}/launch/warm:v1"
    lay.push("v1", ref, registry.creds)
    image_sandbox(ref)  # pulled and stored; the pull's proof is cached
    assert backend.resolve_image(ref, CREDS).digest == desc["digest"]
    gets = registry.manifest_gets("launch/warm")
    events: list[dict[str, Any]] = []
    spec = new_spec(image=ref, registry_credentials=CREDS)
    endpoint = backend.provision(spec, progress=events.append)
    try:
        wait_healthy(endpoint, spec.agent_token, timeout=20)
        assert endpoint.image_digest == desc["digest"]
        assert registry.manifest_gets("launch/warm") == gets  # the store alone
        assert events[-1] == {"phase": "done", "digest": desc["digest"]}
        holder = lease_holder(backend.config.instance, spec.sandbox_id)
        lease = backend.config.image_store / "leases" / holder
        assert json.loads(lease.read_text()) == {"digest": desc["digest"]}
        assert Sandbox(backend, spec, endpoint).sh("echo ok")[1] == "ok\n"
    finally:
        backend.destroy(spec.sandbox_id)
    assert _leftovers(backend, spec.sandbox_id) == []
    # within the same window, a wrong login or none is asked of the registry: refused
    for creds in (RegistryCredentials(USER, "wrong"), None):
        other = new_spec(image=ref, registry_credentials=creds)
        with pytest.raises(ImageUnavailable) as err:
            backend.provision(other)
        assert err.value.code == "registry_unauthorized"
        assert _leftovers(backend, other.sandbox_id) == []


@pytest.mark.parametrize("user", ["nobody-here", "user:nogroup", "70000"])
def test_an_unknown_image_user_is_typed(
    backend: LocalBackend, registry: Registry, tmp_path: Path, user: str
) -> None:
    lay = Layout(tmp_path / "layout")
    lay.tag("v1", lay.image([busybox_layer()], {"User": user}))
    ref = f"{registry.host}/launch/baduser-{user.replace(':', '-')}:v1"
    lay.push("v1", ref, registry.creds)
    spec = new_spec(image=ref, registry_credentials=CREDS)
    with pytest.raises(ImageUnavailable) as err:
        backend.provision(spec)
    assert err.value.code == "image_user_unknown"
    assert _leftovers(backend, spec.sandbox_id) == []


@pytest.mark.parametrize("point", ["image_pulled", "cgroups_created", "root_mounted", "started"])
def test_a_provision_that_dies_anywhere_leaks_no_mount_or_lease(
    backend: LocalBackend, busybox_image: str, point: str
) -> None:
    def die(at: str) -> None:
        if at == point:
            raise RuntimeError(f"injected at {at}")

    spec = new_spec(image=busybox_image, registry_credentials=CREDS)
    backend.fault_hook = die
    try:
        with pytest.raises(Exception, match="injected"):
            backend.provision(spec)
    finally:
        backend.fault_hook = None
    assert _leftovers(backend, spec.sandbox_id) == []
    assert not _mounted(backend.roots_dir / spec.sandbox_id, _zygote_launcher_mountinfo(backend))


def test_destroy_of_a_busy_root_unmounts_it_lazily(
    backend: LocalBackend, image_sandbox: Callable[..., Sandbox], busybox_image: str
) -> None:
    sb = image_sandbox(busybox_image)
    target = backend.roots_dir / sb.id
    holder = subprocess.Popen(["sleep", "60"], cwd=target)  # a host process inside it
    try:
        backend.destroy(sb.id)
        assert not _mounted(target)
        assert (
            backend.config.image_store / "leases" / lease_holder(backend.config.instance, sb.id)
        ).exists() is False
    finally:
        holder.kill()
        holder.wait()


# ---- the SWE flow on a real distribution -------------------------------------------


@pytest.fixture
def debian_image(swe_image: SweImage) -> str:
    return swe_image.reference


def test_swe_flow_on_a_debian_image(
    backend: LocalBackend, image_sandbox: Callable[..., Sandbox], debian_image: str
) -> None:
    sb = image_sandbox(debian_image)
    code, out, _ = sb.sh("pwd && python3 -m pytest -q -p no:cacheprovider", timeout=120)
    assert code == 1 and out.startswith("/testbed\n") and "1 failed" in out, out
    sb.exec(["sh", "-c", f"cat > /tmp/fix.patch <<'EOF'\n{PATCH}EOF"])
    code, out, err = sb.sh("git apply /tmp/fix.patch && git diff --stat", timeout=60)
    assert code == 0 and "calc.py" in out, err
    code, out, _ = sb.sh("python3 -m pytest -q -p no:cacheprovider", timeout=120)
    assert code == 0 and "1 passed" in out, out
    # the image's layers are unchanged: the fix lives in the sandbox's upper dir
    rec = backend._image_store().get(sb.endpoint.image_digest)
    assert rec is not None
    top = backend._image_store().lower_dirs(rec)[0]
    assert (top / "testbed" / "calc.py").read_text() == TESTBED_FILES["calc.py"]
    upper = backend.storage.mount / sb.id / "root" / "upper"  # type: ignore[union-attr]
    assert "a + b" in (upper / "testbed" / "calc.py").read_text()


def test_root_of_an_image_cannot_kill_the_agent_despite_cap_kill(
    image_sandbox: Callable[..., Sandbox], busybox_image: str
) -> None:
    """Issue 22 item 9: root of an image keeps Docker's CAP_KILL and CAP_SETUID over the
    user namespace the agent is in, which the agent's own uid does not cover; the
    commands' extra seccomp filter (podagent/seccomp.py, guard_rules) refuses signals
    to the agent's pid (2), its group and -1, and a switch to the agent uid."""
    sb = image_sandbox(busybox_image)
    m = sb.backend._meta(sb.id)
    assert m is not None and m["launch"] == "zygote"
    agent = (int(m["agent_pid"]), proc_start_time(int(m["agent_pid"])))
    assert sb.sh("cat /proc/2/comm")[1] == "hedgerow-agent\n"
    for command in ("kill -9 2", "kill -9 -2", "kill -9 -1", "kill -STOP 2", "pkill -9 -f ."):
        sb.sh(command)
        assert is_alive(*agent), command
    code, out, err = sb.sh("kill -9 2; echo rc=$?")
    assert out == "rc=1\n" and "not permitted" in err, (out, err)
    assert sb.sh("echo alive") == (0, "alive\n", "")
    # any other process is its to signal, as before
    assert sb.sh("sleep 900 & kill -9 $!; wait $!; echo $?")[1] == "137\n"
