"""Pause, resume and fork through the control plane's services on the Kubernetes
backend: the FAKE API server (and its FAKE CSI snapshot controller) for the cluster,
and for each sandbox pod a REAL agent (this repository's podagent, on a loopback
address of its own, with the token from the pod's Secret) started by a test kubelet.
Real database; no data moves between pods (the fake has none), so the state compared
is the probes' output and the agent's environment (docs/snapshots.md "Kubernetes")."""

from __future__ import annotations

import base64
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from apps.core.errors import ApiError
from apps.sandboxes.backends.kubernetes import KubernetesBackend
from apps.sandboxes.models import Sandbox, SandboxEvent, Snapshot, SnapshotState, State
from apps.sandboxes.services import provisioning, snapshots
from apps.sandboxes.tests.factories import make_sandbox

from .conftest import NS
from .fakekube import FakeKube

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[5]
DIGEST = "sha256:" + "c" * 64
AGENT_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class AgentKubelet:
    """Plays the kubelet of every sandbox pod: once a pod and its token Secret exist,
    starts a real agent for it on 127.0.0.<n>:<port> and reports the pod Running there;
    stops the agent when the pod is gone. Woken by the fake's own change notifications."""

    def __init__(self, fake: FakeKube, port: int, root: Path) -> None:
        self.fake, self.port, self.root = fake, port, root
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.started: list[str] = []
        self.extra_env: dict[str, str] = {}  # for agents started from now on
        self._next = 2
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> AgentKubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.fake.cond:
            self._stop = True
            self.fake.cond.notify_all()
        self._thread.join(10)
        for agent in self.agents.values():
            agent.kill()
            agent.wait()

    def _run(self) -> None:
        while True:
            with self.fake.cond:
                if self._stop:
                    return
                pods = {k[2]: v for k, v in self.fake.objects.items() if k[:2] == ("pods", NS)}
                tokens = {
                    k[2]: v["data"]["token"]
                    for k, v in self.fake.objects.items()
                    if k[:2] == ("secrets", NS) and k[2].endswith("-token")
                }
            for name in pods:
                if name in self.agents or f"{name}-token" not in tokens:
                    continue
                self._start_agent(name, base64.b64decode(tokens[f"{name}-token"]).decode())
            for name in [n for n in self.agents if n not in pods]:
                self.agents.pop(name).kill()
            with self.fake.cond:
                if not self._stop:
                    self.fake.cond.wait(0.2)  # the fake notifies on every change

    def _start_agent(self, name: str, token: str) -> None:
        ip = f"127.0.0.{self._next}"
        self._next += 1
        home = self.root / name
        (home / "workspace").mkdir(parents=True)
        (home / "token").write_text(token)
        self.agents[name] = subprocess.Popen(
            [
                *(sys.executable, "-m", "podagent", "--listen", f"{ip}:{self.port}"),
                *("--token-file", str(home / "token"), "--workdir", str(home / "workspace")),
            ],
            cwd=REPO,
            env=AGENT_ENV | {"PYTHONPATH": str(REPO)} | self.extra_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.started.append(name)
        self.fake.set_pod_status(
            NS,
            name,
            phase="Running",
            pod_ip=ip,
            running=True,
            image_id=f"docker.io/library/python@{DIGEST}",
        )


@pytest.fixture
def cluster(
    fake: FakeKube,
    make_backend: Callable[..., KubernetesBackend],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Iterator[tuple[KubernetesBackend, AgentKubelet]]:
    port = free_port()
    backend = make_backend(
        snapshot_class="csi-snapclass",
        read_only_root=True,
        snapshot_poll_s=0.01,
        agent_port=port,
        ready_timeout_s=30.0,
    )
    for module in (provisioning, snapshots):
        monkeypatch.setattr(module, "get_backend", lambda: backend)
    kubelet = AgentKubelet(fake, port, tmp_path).start()
    yield backend, kubelet
    kubelet.stop()


def objects(fake: FakeKube, resource: str) -> dict[str, dict[str, Any]]:
    with fake.cond:
        return {k[2]: v for k, v in fake.objects.items() if k[0] == resource and k[1] == NS}


def provisioned(sandbox: Sandbox) -> Sandbox:
    provisioning.sandbox_provision(sandbox_id=str(sandbox.pk))
    sandbox.refresh_from_db()
    assert sandbox.state == State.READY, (sandbox.status_message, sandbox.divergence)
    return sandbox


def captured(snapshot: Snapshot) -> Snapshot:
    done = snapshots.snapshot_capture(snapshot_id=str(snapshot.pk))
    assert done is not None and done.state == SnapshotState.READY, done and done.error
    return done


def test_pause_then_resume_restores_the_claim_as_generation_2(
    fake: FakeKube,
    cluster: tuple[KubernetesBackend, AgentKubelet],
    make_tenant: Callable[..., Any],
) -> None:
    backend, kubelet = cluster
    tenant, _ = make_tenant()
    sandbox = make_sandbox(
        tenant,
        backend="kubernetes",
        state=State.REQUESTED,
        generation=0,
        image="python:3.12-slim",
        endpoint_host="",
        endpoint_port=None,
    )
    sid = sandbox.id.hex
    sandbox = provisioned(sandbox)
    assert sandbox.generation == 1 and sandbox.image_digest == DIGEST

    snapshots.sandbox_pause(sandbox=sandbox, actor="test")
    pause = Snapshot.objects.get(sandbox=sandbox, kind="pause")
    pause = captured(pause)
    assert pause.fingerprint["tree"].startswith("csi:snapcontent-")
    assert pause.size_bytes > 0 and pause.image_digest == DIGEST
    sandbox.refresh_from_db()
    assert sandbox.state == State.PAUSED
    assert SandboxEvent.objects.filter(sandbox=sandbox, event="compute_released").exists()
    # compute released: no pod, no claim; the VolumeSnapshot holds the state
    assert not [n for n in objects(fake, "pods") if sid in n]
    assert not [n for n in objects(fake, "persistentvolumeclaims") if sid in n]
    assert set(objects(fake, "volumesnapshots")) == {f"hr-snap-{pause.id.hex}"}

    snapshots.sandbox_resume(sandbox=sandbox, actor="test")
    sandbox = provisioned(sandbox)
    assert sandbox.generation == 2
    claim = objects(fake, "persistentvolumeclaims")[f"hr-{sid}-2-state"]
    assert claim["spec"]["dataSource"]["name"] == f"hr-snap-{pause.id.hex}"
    pod = objects(fake, "pods")[f"hr-{sid}-2"]
    assert pod["spec"]["containers"][0]["image"] == f"python:3.12-slim@{DIGEST}"
    # the spent pause: deleted (the worker's task removes the VolumeSnapshot)
    pause.refresh_from_db()
    assert (pause.state, pause.deleted_reason) == (SnapshotState.DELETED, "resumed")
    snapshots.snapshot_destroy(snapshot_id=str(pause.pk))
    assert objects(fake, "volumesnapshots") == {}
    assert backend.snapshots() == []
    assert kubelet.started == [f"hr-{sid}-1", f"hr-{sid}-2"]


def test_a_fork_restores_and_verifies_k_children_once_and_never_half(
    fake: FakeKube,
    cluster: tuple[KubernetesBackend, AgentKubelet],
    make_tenant: Callable[..., Any],
) -> None:
    from apps.billing.models import TenantQuota
    from apps.billing.quotas import quota_get

    backend, kubelet = cluster
    tenant, _ = make_tenant()
    parent = provisioned(
        make_sandbox(
            tenant,
            backend="kubernetes",
            state=State.REQUESTED,
            generation=0,
            image="python:3.12-slim",
            endpoint_host="",
            endpoint_port=None,
        )
    )
    snap = snapshots.snapshot_create(
        tenant=tenant,
        sandbox=parent,
        actor="test",
        probes=[{"name": "echo", "command": "echo same-state"}],
        volatile=["ports", "processes"],  # the agents share the test machine's
    )
    snap = captured(snap)
    assert snap.fingerprint["probes"]["echo"]["stdout"] == "same-state\n"

    children, created = snapshots.snapshot_fork(
        tenant=tenant, snapshot=snap, count=3, idempotency_key="step-7", actor="test"
    )
    assert created and len(children) == 3
    for child in children:
        child = provisioned(child)  # verified: services, probes, runtime state
        claim = objects(fake, "persistentvolumeclaims")[f"hr-{child.id.hex}-1-state"]
        assert claim["spec"]["dataSource"]["name"] == f"hr-snap-{snap.id.hex}"
    again, created_again = snapshots.snapshot_fork(
        tenant=tenant, snapshot=snap, count=3, idempotency_key="step-7", actor="test"
    )
    assert not created_again and [c.pk for c in again] == [c.pk for c in children]
    assert len(objects(fake, "pods")) == 4  # the parent and 3 children, once each

    live = Sandbox.objects.filter(tenant=tenant).exclude(state=State.DELETED).count()
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(
        max_concurrent_sandboxes=live + 1
    )
    with pytest.raises(ApiError) as refused:
        snapshots.snapshot_fork(
            tenant=tenant, snapshot=snap, count=2, idempotency_key=None, actor="test"
        )
    assert refused.value.status_code == 429 and refused.value.code == "quota_exceeded"
    assert Sandbox.objects.filter(snapshot_id=snap.id).count() == 3  # not one more
    assert len(objects(fake, "pods")) == 4
    assert len(kubelet.started) == 4


def test_a_child_whose_state_differs_fails_with_the_diff_and_leaves_nothing(
    fake: FakeKube,
    cluster: tuple[KubernetesBackend, AgentKubelet],
    make_tenant: Callable[..., Any],
) -> None:
    _, kubelet = cluster
    tenant, _ = make_tenant()
    parent = provisioned(
        make_sandbox(
            tenant,
            backend="kubernetes",
            state=State.REQUESTED,
            generation=0,
            image="python:3.12-slim",
            endpoint_host="",
            endpoint_port=None,
        )
    )
    snap = snapshots.snapshot_create(
        tenant=tenant, sandbox=parent, actor="test", volatile=["ports", "processes"]
    )
    snap = captured(snap)
    kubelet.extra_env = {"MODEL_SEED": "8"}  # the child's environment is not the parent's
    (child,), _ = snapshots.snapshot_fork(
        tenant=tenant, snapshot=snap, count=1, idempotency_key=None, actor="test"
    )
    provisioning.sandbox_provision(sandbox_id=str(child.pk))
    child.refresh_from_db()
    assert child.state == State.FAILED
    assert child.divergence == [{"env": "MODEL_SEED", "expected": None, "actual": "8"}]
    event = SandboxEvent.objects.filter(sandbox=child, to_state=State.FAILED).get()
    assert event.reason == "state_divergence"
    # destroyed: its pod and its claim went
    assert not [n for n in objects(fake, "pods") if child.id.hex in n]
    assert not [n for n in objects(fake, "persistentvolumeclaims") if child.id.hex in n]
