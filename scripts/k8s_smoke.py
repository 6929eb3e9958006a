"""The public lifecycle against a Hedgerow running on a real Kubernetes cluster.

create → wait ready → exec → upload/download/list → isolation probes (API server,
kubelet, metadata, pod to pod, DNS enumeration; with and without egress) → delete →
nothing left in the sandbox namespace → the tenant's leak audit balances.

Run through `make k8s-smoke` (scripts/k8s_smoke.sh sets HEDGEROW_URL and
HEDGEROW_API_KEY, port-forwarding and creating a key when they are not given).
Exit status 0 = every step passed; each step prints one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import httpx

URL = os.environ["HEDGEROW_URL"].rstrip("/")
KEY = os.environ["HEDGEROW_API_KEY"]
IMAGE = os.environ.get("SMOKE_IMAGE", "host")
RUN_ID = f"k8s-smoke-{uuid.uuid4().hex[:12]}"
SANDBOX_NS = os.environ.get("HEDGEROW_K8S_NAMESPACE", "hedgerow-sandboxes")
http = httpx.Client(
    base_url=URL + "/api/v1",
    headers={"Authorization": f"Bearer {KEY}"},
    timeout=180,
    trust_env=False,
)


def step(name: str, ok: bool, detail: Any = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail if not ok else ''}".rstrip(), flush=True)
    if not ok:
        sys.exit(1)


def kubectl_names(sandbox_label: str) -> list[str]:
    out = subprocess.run(
        [
            "kubectl",
            "-n",
            SANDBOX_NS,
            "get",
            "pods,secrets,networkpolicies",
            "-l",
            f"hedgerow.dev/sandbox={sandbox_label}",
            "-o",
            "name",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def kubectl_sandbox_label(run_id: str) -> str:
    """The backend's sandbox label of our pod, found by the labels annotation."""
    out = subprocess.run(
        ["kubectl", "-n", SANDBOX_NS, "get", "pods", "-l", "hedgerow.dev/sandbox", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    for pod in json.loads(out.stdout)["items"]:
        annotations = pod["metadata"].get("annotations") or {}
        if run_id in annotations.get("hedgerow.dev/labels", ""):
            return str(pod["metadata"]["labels"]["hedgerow.dev/sandbox"])
    return ""


def kubectl_pod_field(sandbox_label: str, jsonpath: str) -> str:
    out = subprocess.run(
        [
            *("kubectl", "-n", SANDBOX_NS, "get", "pods"),
            *("-l", f"hedgerow.dev/sandbox={sandbox_label}", "-o", f"jsonpath={jsonpath}"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def tcp_probe(host: str, port: int | str) -> str:
    """A command printing "open" when a TCP connection to host:port succeeds in 5 s."""
    return (
        f"timeout 5 bash -c 'exec 3<>/dev/tcp/{host}/{port}' 2>/dev/null"
        " && echo open || echo closed"
    )


def run_in(sid: str, command: str) -> str:
    ran = http.post(f"/sandboxes/{sid}/exec", json={"command": command, "timeout": 30})
    return str(ran.json().get("stdout", "")).strip()


def kubectl_value(*args: str) -> str:
    out = subprocess.run(["kubectl", *args], capture_output=True, text=True, check=False)
    return out.stdout.strip()


def isolation_probes(sid: str, sandbox_label: str) -> None:
    """What only a real cluster can show (docs/deploy-kubernetes.md): from a sandbox
    without network access and from one with `egress: all`, the API server's ClusterIP,
    the node's kubelet, the cloud metadata service and another sandbox's agent are
    unreachable, and cluster DNS does not enumerate services."""
    api_ip = kubectl_value("-n", "default", "get", "svc", "kubernetes", "-o",
                           "jsonpath={.spec.clusterIP}")  # fmt: skip
    node_ip = kubectl_pod_field(sandbox_label, "{.items[0].status.hostIP}")
    peer_ip = kubectl_pod_field(sandbox_label, "{.items[0].status.podIP}")
    agent_port = (
        kubectl_pod_field(sandbox_label, "{.items[0].spec.containers[0].ports[0].containerPort}")
        or "7777"
    )
    net = http.post(
        "/sandboxes",
        json={"image": IMAGE, "labels": {"smoke": RUN_ID + "-net"}, "ttl_seconds": 900,
              "egress": "all"},
        headers={"Idempotency-Key": RUN_ID + "-net"},
    )  # fmt: skip
    step("create a sandbox with egress: all", net.status_code == 201, net.text)
    other = net.json()["id"]
    try:
        waited = http.get(f"/sandboxes/{other}/wait", params={"timeout": 170})
        step("it is ready", waited.json().get("state") == "ready", waited.text)
        for name, target in (("without network", sid), ("with egress: all", other)):
            if api_ip:
                step(f"API server's ClusterIP closed ({name})",
                     run_in(target, tcp_probe(api_ip, 443)) == "closed")  # fmt: skip
            if node_ip:
                step(f"node's kubelet closed ({name})",
                     run_in(target, tcp_probe(node_ip, 10250)) == "closed")  # fmt: skip
            step(f"cloud metadata closed ({name})",
                 run_in(target, tcp_probe("169.254.169.254", 80)) == "closed")  # fmt: skip
        if peer_ip:
            step("another sandbox's agent closed (pod to pod)",
                 run_in(other, tcp_probe(peer_ip, agent_port)) == "closed")  # fmt: skip
        dns = run_in(other, "getent hosts kubernetes.default.svc.cluster.local || echo none")
        step("cluster DNS does not enumerate services", dns == "none", dns)
    finally:
        http.delete(f"/sandboxes/{other}")


def main() -> None:
    started = time.time()
    created = http.post(
        "/sandboxes",
        json={"image": IMAGE, "labels": {"smoke": RUN_ID}, "ttl_seconds": 900},
        headers={"Idempotency-Key": RUN_ID},
    )
    step("create", created.status_code == 201, created.text)
    sid = created.json()["id"]
    sandbox_label = ""
    try:
        waited = http.get(f"/sandboxes/{sid}/wait", params={"timeout": 170})
        body = waited.json()
        step("ready", waited.status_code == 200 and body.get("state") == "ready", waited.text)
        print(f"     ready in {time.time() - started:.1f}s, isolation={body.get('isolation')}")
        sandbox_label = kubectl_sandbox_label(RUN_ID)
        step("pod found by its labels", bool(sandbox_label), RUN_ID)

        ran = http.post(f"/sandboxes/{sid}/exec", json={"command": "echo hello from $(hostname)"})
        result = ran.json()
        step("exec", ran.status_code == 200 and result.get("exit_code") == 0, ran.text)
        step("exec output", result["stdout"].startswith("hello from"), result["stdout"])

        # hostUsers: false is only a request: a container runtime without user-namespace
        # support may ignore it. Inside a real one, no uid maps to the node's root.
        if kubectl_pod_field(sandbox_label, "{.items[0].spec.hostUsers}") == "false":
            uid_map = http.post(
                f"/sandboxes/{sid}/exec", json={"command": "cat /proc/self/uid_map"}
            )
            lines = uid_map.json().get("stdout", "").splitlines()
            outside = [line.split()[1] for line in lines if len(line.split()) == 3]
            step("user namespace", bool(outside) and "0" not in outside, uid_map.text)
        else:
            print("     user namespace: off (HEDGEROW_K8S_USER_NAMESPACES=false)")

        payload = os.urandom(64 * 1024)
        up = http.put(
            f"/sandboxes/{sid}/files", params={"path": "/workspace/smoke/data.bin"}, content=payload
        )
        step("upload", up.status_code == 200 and up.json()["size"] == len(payload), up.text)
        down = http.get(f"/sandboxes/{sid}/files", params={"path": "/workspace/smoke/data.bin"})
        step("download", down.status_code == 200 and down.content == payload, down.status_code)
        listing = http.get(f"/sandboxes/{sid}/files/list", params={"path": "/workspace/smoke"})
        names = [e["name"] for e in listing.json().get("entries", [])]
        step("list", names == ["data.bin"], listing.text)

        # no network access requested: the cloud metadata service must be unreachable
        probe = http.post(
            f"/sandboxes/{sid}/exec",
            json={
                "command": "(exec 3<>/dev/tcp/169.254.169.254/80) 2>/dev/null && echo open"
                " || echo closed",
                "timeout": 20,
            },
        )
        step("egress denied", "open" not in probe.json().get("stdout", "open"), probe.text)
        isolation_probes(sid, sandbox_label)
    finally:
        deleted = http.delete(f"/sandboxes/{sid}")
        step("delete", deleted.status_code == 202, deleted.text)

    deadline = time.time() + 120
    state = http.get(f"/sandboxes/{sid}").json().get("state")
    while time.time() < deadline and state != "deleted":
        time.sleep(2)
        state = http.get(f"/sandboxes/{sid}").json().get("state")
    step("deleted", state == "deleted", state)
    left = kubectl_names(sandbox_label)
    while left and time.time() < deadline + 60:  # a pod takes a moment to terminate
        time.sleep(2)
        left = kubectl_names(sandbox_label)
    step("no pod, secret or policy left", not left, left)

    audit = http.post("/audits")  # computed by a worker: 202, then poll its row
    report = audit.json()
    while audit.status_code == 202 and report.get("status") == "running":
        if time.time() > deadline + 120:
            break
        time.sleep(2)
        report = http.get(audit.headers["Location"].removeprefix("/api/v1")).json()
    step(
        "audit balances",
        audit.status_code == 202 and report.get("balanced") is True,
        json.dumps(report, indent=1),
    )
    step("no leaks", not report.get("leaked") and not report.get("leaked_ids"), report)
    print(f"k8s smoke passed in {time.time() - started:.1f}s")


if __name__ == "__main__":
    main()
