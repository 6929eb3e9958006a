"""The injected agent under the pod's own settings, without a cluster: the init and main
containers' commands from ``build_pod``, run on this machine with the pod's mount
points mapped to directories laid out like kubelet's (emptyDirs 0777, the Secret file
0400 root), the init container as root and the main container as the uid the spec
names. What the runtime adds (user namespace, read-only root, seccomp) is not
emulated here; ``make k8s-smoke`` checks it on a real cluster."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from apps.sandboxes.backends.base import Endpoint
from apps.sandboxes.backends.kubernetes.specs import build_pod
from apps.sandboxes.backends.local import wait_healthy

from .conftest import make_config, new_spec

REPO = Path(__file__).resolve().parents[5]
SERIALIZER = client.ApiClient()


@pytest.fixture(scope="module")
def bundle() -> Iterator[Path]:
    # not under pytest's 0700 tmp dirs: the sandbox's uid must be able to reach it, as
    # it reaches the pod's volumes
    root = Path(tempfile.mkdtemp(prefix="hedgerow-inject-"))
    root.chmod(0o755)
    out = root / "hedgerow-bundle"
    subprocess.run(
        [str(REPO / "scripts" / "build_agent_bundle.sh"), "--no-compile", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    yield out
    shutil.rmtree(root)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def agent_exec(endpoint: Endpoint, token: str, command: str) -> dict[str, Any]:
    conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=30)
    body = {"operation_id": f"op-{uuid.uuid4().hex}", "command": command, "timeout": 20}
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    conn.request("POST", "/exec", json.dumps(body), headers)
    data: dict[str, Any] = json.loads(conn.getresponse().read())
    conn.close()
    return data


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: runs the sandbox as another uid")
def test_the_injected_agent_serves_as_the_non_root_uid_the_pod_runs_it_as(bundle: Path) -> None:
    # no user namespace and no runtime class: the pod runs the sandbox as a non-root uid
    pod = SERIALIZER.sanitize_for_serialization(
        build_pod(make_config(user_namespaces=False), new_spec())
    )
    (init,) = pod["spec"]["initContainers"]
    (main,) = pod["spec"]["containers"]
    uid = main["securityContext"]["runAsUser"]
    gid = main["securityContext"]["runAsGroup"]
    assert uid != 0 and main["securityContext"]["runAsNonRoot"] is True

    root = Path(tempfile.mkdtemp(prefix="hedgerow-pod-"))
    root.chmod(0o755)
    port = free_port()
    token = "tok-" + uuid.uuid4().hex
    paths = {"/hedgerow-bundle": str(bundle), f"0.0.0.0:{7777}": f"127.0.0.1:{port}"}
    try:
        for mount in init["volumeMounts"] + main["volumeMounts"]:
            local = root / mount["name"]
            paths[mount["mountPath"]] = str(local)
            local.mkdir(exist_ok=True)
            local.chmod(0o777)  # kubelet's emptyDir mode
        secret = Path(paths["/var/run/hedgerow-secret"])
        secret.chmod(0o755)
        (secret / "token").write_text(token)
        (secret / "token").chmod(0o400)  # defaultMode 0400, owned by root

        def local(argv: list[str]) -> list[str]:
            out = []
            for arg in argv:
                for pod_path, host_path in paths.items():
                    if arg == pod_path or arg.startswith(pod_path + "/"):
                        arg = host_path + arg[len(pod_path) :]
                        break  # once: host paths live under /tmp, a pod mount point too
                out.append(arg)
            return out

        env = {"PATH": "/usr/bin:/bin"}
        subprocess.run(local(init["command"]), env=env, check=True, capture_output=True)
        agent = subprocess.Popen(
            local(main["command"]),
            cwd=paths["/workspace"],
            env=env,
            user=uid,
            group=gid,
            extra_groups=[],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            endpoint = Endpoint("127.0.0.1", port, "none")
            wait_healthy(endpoint, token, timeout=30)
            token_copy = Path(paths["/run/hedgerow"]) / "token"
            assert not token_copy.exists()  # read and unlinked by the non-root agent
            ran = agent_exec(endpoint, token, "id -u; id -g; echo hi > made && cat made")
            termination = ran["termination"]
            assert (termination["reason"], termination["exit_code"]) == ("exited", 0), ran
            assert ran["stdout"]["head"].split() == [str(uid), str(gid), "hi"]
            assert (Path(paths["/workspace"]) / "made").stat().st_uid == uid
        finally:
            agent.kill()
            agent.wait()
    finally:
        shutil.rmtree(root)
