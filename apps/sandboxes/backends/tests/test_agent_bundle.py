"""The self-contained agent bundle: built by scripts/build_agent_bundle.sh and run in a
local-backend sandbox whose root filesystem is busybox only — no Python, no glibc."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from apps.sandboxes.backends.base import Endpoint, UnknownImage
from apps.sandboxes.backends.local import LocalBackend, LocalBackendConfig, wait_healthy

from .conftest import HAS_TOOLS, IS_ROOT, PODAGENT, REPO, Sandbox, new_spec, searchable

BUSYBOX = shutil.which("busybox")


def load_launcher() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "hedgerow_launcher", REPO / "bundle" / "hedgerow_launcher.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_it_restores_what_the_bundled_interpreter_changes_and_keeps_other_restores() -> None:
    launcher = load_launcher()
    env = launcher.agent_env({"PATH": "/bin", "HEDGEROW_AGENT_ENV_RESTORE": '{"PYTHONPATH": null}'})
    assert json.loads(env["HEDGEROW_AGENT_ENV_RESTORE"]) == {"PYTHONPATH": None, "LC_CTYPE": None}
    env = launcher.agent_env({"LC_CTYPE": "de_DE.UTF-8"})
    assert json.loads(env["HEDGEROW_AGENT_ENV_RESTORE"]) == {"LC_CTYPE": "de_DE.UTF-8"}
    assert "PYTHONHOME" not in env and "LD_LIBRARY_PATH" not in env


def test_it_reads_the_pristine_environment_not_the_coerced_one() -> None:
    launcher = load_launcher()
    os.environ["HEDGEROW_TEST_LATE_VAR"] = "set-after-start"
    try:
        pristine = launcher.pristine_environ()
    finally:
        del os.environ["HEDGEROW_TEST_LATE_VAR"]
    assert "HEDGEROW_TEST_LATE_VAR" not in pristine  # /proc/self/environ: as exec'd
    assert pristine.get("PATH") == os.environ.get("PATH")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = searchable(tmp_path_factory.mktemp("bundle")) / "agent-bundle"  # sandboxes bind it
    subprocess.run(
        [str(REPO / "scripts" / "build_agent_bundle.sh"), "--no-compile", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def test_it_builds_a_bundle_with_interpreter_loader_libraries_and_agent(bundle: Path) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text())
    version = manifest["python"]
    assert manifest["launch"][:4] == ["lib/ld.so", "--library-path", "lib", "bin/python3"]
    for path in ("bin/python3", "lib/ld.so", "lib/libc.so.6", f"lib/python{version}/os.py"):
        assert (bundle / path).exists(), path
    assert (bundle / f"lib/python{version}/podagent/server.py").exists()
    assert (bundle / f"lib/python{version}/hedgerow_launcher.py").exists()
    assert not (bundle / f"lib/python{version}/podagent/tests").exists()
    assert not (bundle / f"lib/python{version}/test").exists()
    # runs with an empty environment, from nothing but itself
    lib = str(bundle / "lib")
    code = "import sys, podagent; print(sys.prefix)"
    out = subprocess.run(
        [f"{lib}/ld.so", "--library-path", lib, str(bundle / "bin/python3"), "-I", "-c", code],
        env={},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(bundle)


def busybox_rootfs_tarball(dest: Path) -> Path:
    """A root filesystem of busybox and its applet links: no python3, no shared libs."""
    assert BUSYBOX is not None
    root = dest / "rootfs"
    for d in ("bin", "etc", "tmp", "usr/bin"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True)
    for applet in applets.stdout.split():
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/workspace:/bin/sh\n")
    tarball = dest / "busybox.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(root, arcname=".")
    return tarball


@pytest.fixture(scope="module")
def bundle_backend(
    tmp_path_factory: pytest.TempPathFactory, bundle: Path
) -> Iterator[LocalBackend]:
    if not (IS_ROOT and HAS_TOOLS):
        pytest.skip("needs root, bwrap, ip, nft")
    # static: the rootfs then holds no libc at all (ldd fails on a static binary)
    if BUSYBOX is None or subprocess.run(["ldd", BUSYBOX], capture_output=True).returncode == 0:
        pytest.skip("needs busybox-static (apt-get install busybox-static)")
    tmp = searchable(tmp_path_factory.mktemp("bundle-local"))
    backend = LocalBackend(
        LocalBackendConfig(
            state_dir=tmp / "state",
            instance=f"bb{os.getpid()}",
            podagent_dir=PODAGENT,
            isolation="netns",
            agent_bundle=bundle,
            agent_launch="exec",  # the bundle is for exec-started agents
            allow_unprotected_exec_launch=True,
        )
    )
    backend.import_image("busybox", busybox_rootfs_tarball(tmp))
    try:
        yield backend
    finally:
        backend.teardown_instance()


@pytest.fixture
def busybox_sandbox(bundle_backend: LocalBackend) -> Iterator[Sandbox]:
    spec = new_spec(image="busybox")
    endpoint = bundle_backend.provision(spec)
    try:
        wait_healthy(endpoint, spec.agent_token, timeout=30)
        yield Sandbox(bundle_backend, spec, endpoint)
    finally:
        bundle_backend.destroy(spec.sandbox_id)


def test_it_runs_a_command_through_the_bundled_agent_in_an_image_without_python(
    busybox_sandbox: Sandbox,
) -> None:
    code, out, _ = busybox_sandbox.sh("echo hello from $(busybox | head -1 | cut -d' ' -f1)")
    assert (code, out) == (0, "hello from BusyBox\n")
    # the image really has no python: the agent is the bundle's
    code, out, _ = busybox_sandbox.sh(
        "ls /usr/bin/python3 /usr/local/bin/python3 /usr/lib/x86_64-linux-gnu 2>&1; echo rc=$?"
    )
    assert out.endswith("rc=1\n")
    code, out, _ = busybox_sandbox.sh("tr '\\0' ' ' </proc/$PPID/cmdline")
    assert code == 0
    assert "/opt/hedgerow/bundle/bin/python3 -I -m podagent" in out


def test_it_leaves_the_commands_environment_as_the_sandbox_defines_it(
    busybox_sandbox: Sandbox,
) -> None:
    code, out, _ = busybox_sandbox.sh("env | sort")
    assert code == 0
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    for leaked in ("PYTHONHOME", "PYTHONPATH", "LD_LIBRARY_PATH", "LC_CTYPE"):
        assert leaked not in env, leaked
    assert not [k for k in env if k.startswith("HEDGEROW_")]
    assert env["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert env["HOME"] == "/workspace" and env["LANG"] == "C.UTF-8"


def test_it_refuses_an_image_without_python_when_no_bundle_is_configured(
    bundle_backend: LocalBackend, tmp_path: Path
) -> None:
    plain = LocalBackend(
        LocalBackendConfig(
            state_dir=bundle_backend.config.state_dir,
            instance=bundle_backend.config.instance,
            podagent_dir=PODAGENT,
            isolation="netns",
            agent_launch="exec",
            allow_unprotected_exec_launch=True,
        )
    )
    spec = new_spec(image="busybox", sandbox_id=uuid.uuid4().hex)
    with pytest.raises(UnknownImage, match="no python3 and no agent bundle"):
        plain.provision(spec)


def _agent_exec(endpoint: Endpoint, token: str, command: str) -> dict[str, Any]:
    conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=30)
    body = {"operation_id": f"op-{uuid.uuid4().hex}", "command": command, "timeout": 20}
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    conn.request("POST", "/exec", json.dumps(body), headers)
    data: dict[str, Any] = json.loads(conn.getresponse().read())
    conn.close()
    return data


@pytest.mark.skipif(not IS_ROOT or shutil.which("unshare") is None, reason="needs root, unshare")
def test_it_supervises_the_agent_as_pid_1_and_ends_when_the_agent_dies(
    bundle: Path, tmp_path: Path
) -> None:
    """A pod's main container: the launcher is PID 1, keeps running while the agent
    lives, and exits with the agent's status once it dies (so the pod fails)."""
    token_file = tmp_path / "token"
    token_file.write_text("pid1-token")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lib = str(bundle / "lib")
    launcher = [f"{lib}/ld.so", "--library-path", lib, str(bundle / "bin/python3"), "-I"]
    agent = ["--listen", f"127.0.0.1:{port}", "--token-file", str(token_file)]
    proc = subprocess.Popen(
        [
            *("unshare", "--pid", "--fork", "--mount-proc", *launcher, "-m", "hedgerow_launcher"),
            *("run", "--", *agent, "--unlink-token", "--workdir", str(tmp_path)),
        ],
        env={"PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        endpoint = Endpoint("127.0.0.1", port, "none")
        wait_healthy(endpoint, "pid1-token", timeout=30)
        assert not token_file.exists()  # read, then unlinked
        init = _agent_exec(
            endpoint, "pid1-token", "tr '\\0' ' ' </proc/1/cmdline; echo; echo $PPID"
        )
        pid1_cmdline, agent_pid = init["stdout"]["head"].splitlines()
        assert "-m hedgerow_launcher run" in pid1_cmdline
        assert agent_pid != "1"  # the agent is PID 1's child, not PID 1
        with pytest.raises((http.client.HTTPException, OSError)):
            _agent_exec(endpoint, "pid1-token", "kill -9 $PPID")  # dies before answering
        assert proc.wait(timeout=30) == 128 + 9
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
