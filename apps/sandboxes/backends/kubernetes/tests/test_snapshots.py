"""Snapshots, forks, pause and resume on the Kubernetes backend (issue 16), against the
FAKE API server and its FAKE CSI snapshot controller (fakekube.py): what is verified
here is the objects the backend makes and deletes and the states it waits on — never
data, which the fake has none of (docs/snapshots.md "Kubernetes")."""

from __future__ import annotations

import importlib.util
import os
import stat
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from apps.sandboxes.backends.base import BackendError, SnapshotFailed, SnapshotNotFound
from apps.sandboxes.backends.kubernetes import KubernetesBackend
from apps.sandboxes.backends.kubernetes.config import startup_refusals

from .conftest import NS, eventually, kubelet_later, make_config, new_spec
from .fakekube import FakeKube

DIGEST = "sha256:" + "a" * 64
CLASS = "csi-snapclass"


@pytest.fixture
def snap_backend(make_backend: Callable[..., KubernetesBackend]) -> KubernetesBackend:
    return make_backend(
        snapshot_class=CLASS,
        snapshot_storage_class="fast-ssd",
        read_only_root=True,
        snapshot_ready_timeout_s=5.0,
        snapshot_poll_s=0.01,
    )


def running(fake: FakeKube, backend: KubernetesBackend, **overrides: Any) -> Any:
    """Provisions a sandbox whose pod the fake kubelet starts with a known image digest."""
    spec = new_spec(**overrides)
    name = f"hr-{spec.sandbox_id}-{spec.generation}"
    thread = kubelet_later(
        fake,
        name,
        phase="Running",
        pod_ip="10.42.7.7",
        running=True,
        image_id=f"docker.io/library/python@{DIGEST}",
    )
    backend.provision(spec)
    thread.join()
    return spec


def objects(fake: FakeKube, resource: str) -> dict[str, dict[str, Any]]:
    with fake.cond:
        return {k[2]: v for k, v in fake.objects.items() if k[0] == resource and k[1] == NS}


def test_the_state_lives_on_one_claim_owned_by_the_pod(
    fake: FakeKube, snap_backend: KubernetesBackend
) -> None:
    spec = running(fake, snap_backend)
    pod = objects(fake, "pods")[f"hr-{spec.sandbox_id}-1"]
    claim = objects(fake, "persistentvolumeclaims")[f"hr-{spec.sandbox_id}-1-state"]
    mounts = {m["mountPath"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert (mounts["/workspace"]["name"], mounts["/workspace"]["subPath"]) == ("state", "workspace")
    assert (mounts["/tmp"]["name"], mounts["/tmp"]["subPath"]) == ("state", "tmp")
    (state,) = [v for v in pod["spec"]["volumes"] if v["name"] == "state"]
    assert state["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert not [v for v in pod["spec"]["volumes"] if v["name"] in ("workspace", "tmp")]
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["spec"]["resources"]["requests"]["storage"] == "2048Mi"
    assert "dataSource" not in claim["spec"]
    assert claim["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]
    assert claim["status"]["phase"] == "Bound"
    # the init container makes the claim's subPaths with the emptyDirs' modes
    (init,) = pod["spec"]["initContainers"]
    assert init["command"][-2:] == ["--state-dir", "/hedgerow-state"]
    assert {"name": "state", "mountPath": "/hedgerow-state"} in init["volumeMounts"]


def test_the_injector_makes_missing_state_dirs_writable_and_keeps_restored_ones(
    tmp_path: Path,
) -> None:
    spec = importlib.util.spec_from_file_location(
        "hedgerow_launcher", Path(__file__).resolve().parents[5] / "bundle/hedgerow_launcher.py"
    )
    assert spec is not None and spec.loader is not None
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    fresh, restored = tmp_path / "fresh", tmp_path / "restored"
    fresh.mkdir()
    (restored / "workspace").mkdir(parents=True)
    (restored / "workspace").chmod(0o750)  # as the snapshot has it
    old = os.umask(0o022)
    try:
        assert launcher.prepare_state(str(fresh)) == ["workspace", "tmp"]
        assert launcher.prepare_state(str(restored)) == ["tmp"]
    finally:
        os.umask(old)
    assert stat.S_IMODE((fresh / "workspace").stat().st_mode) == 0o777
    assert stat.S_IMODE((fresh / "tmp").stat().st_mode) == 0o1777
    assert stat.S_IMODE((restored / "workspace").stat().st_mode) == 0o750
    assert launcher.prepare_state(str(fresh)) == []  # idempotent


def test_a_capture_waits_for_the_volume_snapshot_to_be_ready(
    fake: FakeKube, snap_backend: KubernetesBackend
) -> None:
    fake.snapshot_ready_after_reads = 3  # the CSI driver takes its time
    spec = running(fake, snap_backend)
    snap = uuid.uuid4().hex
    info = snap_backend.snapshot(spec.sandbox_id, snap)
    (vs,) = objects(fake, "volumesnapshots").values()
    assert vs["metadata"]["name"] == f"hr-snap-{snap}"
    assert vs["spec"] == {
        "volumeSnapshotClassName": CLASS,
        "source": {"persistentVolumeClaimName": f"hr-{spec.sandbox_id}-1-state"},
    }
    assert vs["status"]["readyToUse"] is True
    assert "ownerReferences" not in vs["metadata"]  # it outlives the pod (a pause)
    assert fake.count("GET", f"/volumesnapshots/hr-snap-{snap}") == 3  # read until ready
    assert info.snapshot_id == snap and info.sandbox_id == spec.sandbox_id
    assert (info.image, info.image_digest) == ("python:3.12-slim", DIGEST)
    assert info.fingerprint == f"csi:snapcontent-{vs['metadata']['uid']}"
    assert info.size_bytes == 2048 << 20  # the CSI restoreSize: the claim's size
    assert snap_backend.snapshots() == [snap]


@pytest.mark.parametrize(
    ("mode", "code", "message"),
    [
        ("never", "snapshot_timeout", "not readyToUse after 0.2s"),
        ("error", "snapshot_failed", "fake driver refused"),
    ],
)
def test_a_snapshot_that_does_not_become_ready_fails_typed_and_leaves_nothing(
    fake: FakeKube,
    make_backend: Callable[..., KubernetesBackend],
    mode: str,
    code: str,
    message: str,
) -> None:
    backend = make_backend(
        snapshot_class=CLASS,
        read_only_root=True,
        snapshot_ready_timeout_s=0.2,
        snapshot_poll_s=0.01,
    )
    spec = running(fake, backend)
    fake.snapshot_mode = mode
    snap = uuid.uuid4().hex
    with pytest.raises(SnapshotFailed, match=message) as failed:
        backend.snapshot(spec.sandbox_id, snap)
    assert failed.value.code == code
    assert objects(fake, "volumesnapshots") == {}  # deleted: no half snapshot
    assert fake.count("DELETE", f"/volumesnapshots/hr-snap-{snap}") == 1
    assert backend.snapshots() == []
    # the sandbox itself is untouched
    assert f"hr-{spec.sandbox_id}-1" in objects(fake, "pods")
    assert f"hr-{spec.sandbox_id}-1-state" in objects(fake, "persistentvolumeclaims")


def test_what_cannot_be_captured_is_refused_before_anything_is_made(
    fake: FakeKube,
    snap_backend: KubernetesBackend,
    make_backend: Callable[..., KubernetesBackend],
) -> None:
    with pytest.raises(SnapshotFailed) as gone:
        snap_backend.snapshot(uuid.uuid4().hex, uuid.uuid4().hex)  # no pod
    assert gone.value.code == "sandbox_not_running"
    plain = make_backend()  # no VolumeSnapshotClass: emptyDirs, no claim
    spec = running(fake, plain)
    with pytest.raises(SnapshotFailed) as unsupported:
        plain.snapshot(spec.sandbox_id, uuid.uuid4().hex)
    assert unsupported.value.code == "snapshots_unsupported"
    with pytest.raises(SnapshotFailed, match="no state volume") as older:
        snap_backend.snapshot(spec.sandbox_id, uuid.uuid4().hex)  # started before
    assert older.value.code == "snapshots_unsupported"
    assert objects(fake, "volumesnapshots") == {}
    assert objects(fake, "persistentvolumeclaims") == {}


def test_snapshots_need_a_read_only_root() -> None:
    config = make_config(snapshot_class=CLASS, injector_image=f"inj@{DIGEST}")
    (refusal,) = startup_refusals(config, allow_no_boundary=False, allow_unpinned_injector=False)
    assert "HEDGEROW_K8S_READ_ONLY_ROOT=true" in refusal
    fine = make_config(snapshot_class=CLASS, read_only_root=True, injector_image=f"inj@{DIGEST}")
    assert startup_refusals(fine, allow_no_boundary=False, allow_unpinned_injector=False) == []
    with pytest.raises(BackendError, match="not a valid class name"):
        make_config(snapshot_class="Not_A_Class")


def test_a_fork_restores_k_claims_from_the_snapshot_idempotently(
    fake: FakeKube, snap_backend: KubernetesBackend
) -> None:
    parent = running(fake, snap_backend)
    snap = uuid.uuid4().hex
    snap_backend.snapshot(parent.sandbox_id, snap)
    fake.auto_start = True
    children = [new_spec(snapshot_id=snap) for _ in range(4)]
    for child in children:
        snap_backend.provision(child)
    snap_backend.provision(children[0])  # a redelivered task adopts what exists
    pods, claims = objects(fake, "pods"), objects(fake, "persistentvolumeclaims")
    assert len(pods) == 5 and len(claims) == 5  # the parent and 4 children, once each
    for child in children:
        pod = pods[f"hr-{child.sandbox_id}-1"]
        claim = claims[f"hr-{child.sandbox_id}-1-state"]
        # the snapshot's image, pinned by the digest its sandbox ran
        assert pod["spec"]["containers"][0]["image"] == f"python:3.12-slim@{DIGEST}"
        assert claim["spec"]["dataSource"] == {
            "apiGroup": "snapshot.storage.k8s.io",
            "kind": "VolumeSnapshot",
            "name": f"hr-snap-{snap}",
        }
        assert claim["status"]["phase"] == "Bound"
        assert claim["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]
    assert fake.count("POST", "/persistentvolumeclaims") == 6  # the retry's 409 adopted


@pytest.mark.parametrize("problem", ["missing", "not_ready", "deleted", "other_image"])
def test_a_restore_that_cannot_be_made_creates_nothing(
    fake: FakeKube, snap_backend: KubernetesBackend, problem: str
) -> None:
    parent = running(fake, snap_backend)
    snap = uuid.uuid4().hex
    snap_backend.snapshot(parent.sandbox_id, snap)
    image = "python:3.12-slim"
    if problem == "missing":
        snap = uuid.uuid4().hex
    elif problem == "not_ready":  # (the fake controller leaves it so from now on)
        fake.snapshot_mode = "never"
        with fake.cond:
            fake.objects[("volumesnapshots", NS, f"hr-snap-{snap}")]["status"] = {
                "readyToUse": False
            }
    elif problem == "deleted":
        snap_backend.delete_snapshot(snap)
    else:
        image = "busybox:stable"
    before = (set(objects(fake, "pods")), set(objects(fake, "persistentvolumeclaims")))
    fake.auto_start = True
    expected = BackendError if problem == "other_image" else SnapshotNotFound
    with pytest.raises(expected):
        snap_backend.provision(new_spec(snapshot_id=snap, image=image))
    after = (set(objects(fake, "pods")), set(objects(fake, "persistentvolumeclaims")))
    assert after == before


def test_pause_and_resume_keep_the_snapshot_and_bump_the_generation(
    fake: FakeKube, snap_backend: KubernetesBackend
) -> None:
    spec = running(fake, snap_backend)
    sid = spec.sandbox_id
    pause = uuid.uuid4().hex
    snap_backend.snapshot(sid, pause)
    snap_backend.destroy(sid)  # the pause releases the compute: pod, and the claim with it
    eventually(lambda: f"hr-{sid}-1" not in objects(fake, "pods"))
    assert f"hr-{sid}-1-state" not in objects(fake, "persistentvolumeclaims")
    assert snap_backend.snapshots() == [pause]  # the state is kept (billed as storage)
    resumed = new_spec(sandbox_id=sid, generation=2, snapshot_id=pause)
    fake.auto_start = True
    endpoint = snap_backend.provision(resumed)
    assert endpoint.host.startswith("10.42.0.")
    pods, claims = objects(fake, "pods"), objects(fake, "persistentvolumeclaims")
    assert set(pods) == {f"hr-{sid}-2"}  # nothing of generation 1 answers
    assert set(claims) == {f"hr-{sid}-2-state"}
    assert claims[f"hr-{sid}-2-state"]["spec"]["dataSource"]["name"] == f"hr-snap-{pause}"
    assert pods[f"hr-{sid}-2"]["metadata"]["labels"]["hedgerow.dev/generation"] == "2"
    # the spent pause is deleted once the resume is ready: the claim keeps its data
    snap_backend.delete_snapshot(pause)
    snap_backend.delete_snapshot(pause)  # idempotent
    assert objects(fake, "volumesnapshots") == {}
    assert snap_backend.snapshots() == []
    assert set(objects(fake, "persistentvolumeclaims")) == {f"hr-{sid}-2-state"}


@pytest.mark.django_db
def test_the_reconciler_and_the_audit_count_volume_snapshots(
    fake: FakeKube,
    snap_backend: KubernetesBackend,
    make_tenant: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from apps.sandboxes.models import Snapshot, SnapshotState
    from apps.sandboxes.services import audit, reconcile
    from apps.sandboxes.tests.factories import make_sandbox

    monkeypatch.setattr(reconcile, "get_backend", lambda: snap_backend)
    monkeypatch.setattr(audit, "get_backend", lambda: snap_backend)
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, backend="kubernetes")
    spec = running(fake, snap_backend, sandbox_id=sandbox.id.hex, tenant_id=str(tenant.pk))

    def row(state: str, **fields: Any) -> Snapshot:
        return Snapshot.objects.create(
            tenant=tenant,
            sandbox=sandbox,
            backend="kubernetes",
            image="python:3.12-slim",
            state=state,
            ttl_seconds=3600,
            expires_at=timezone.now() + timedelta(hours=1),
            **fields,
        )

    start = timezone.now() - timedelta(minutes=1)
    live = row(SnapshotState.READY)
    leaked = row(SnapshotState.DELETED, deleted_reason="deleted")
    orphan = uuid.uuid4()
    for snap_id in (live.id, leaked.id, orphan):
        snap_backend.snapshot(spec.sandbox_id, snap_id.hex)

    report = audit.audit_compute(
        period_start=start, period_end=timezone.now() + timedelta(minutes=1)
    )
    assert report.snapshots.created == 2
    assert report.snapshots.terms["live"] == 1 and report.snapshots.terms["leaked"] == 1
    assert report.snapshots.leaked_ids == [str(leaked.id)]
    assert report.snapshots.orphaned == [str(orphan)]

    run = reconcile.sandbox_reconcile()
    assert run.actions.get("snapshot_leak_reclaimed") == 2, run.details
    assert snap_backend.snapshots() == [live.id.hex]
    assert set(objects(fake, "volumesnapshots")) == {f"hr-snap-{live.id.hex}"}
    after = audit.audit_compute(
        period_start=start, period_end=timezone.now() + timedelta(minutes=1)
    )
    assert after.snapshots.terms["leaked"] == 0 and after.snapshots.terms["deleted"] == 1
    assert after.snapshots.orphaned == [] and after.snapshots.balanced


def test_a_restore_whose_pod_never_starts_leaves_no_claim(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(
        snapshot_class=CLASS, read_only_root=True, snapshot_poll_s=0.01, ready_timeout_s=0.5
    )
    parent = running(fake, backend)
    snap = uuid.uuid4().hex
    backend.snapshot(parent.sandbox_id, snap)
    child = new_spec(snapshot_id=snap)  # no kubelet starts it
    with pytest.raises(BackendError, match="not started"):
        backend.provision(child)
    assert not [n for n in objects(fake, "pods") if child.sandbox_id in n]
    # the claim was the pod's: the garbage collector took it with the rolled-back pod
    assert not [n for n in objects(fake, "persistentvolumeclaims") if child.sandbox_id in n]
    assert objects(fake, "volumesnapshots")  # the snapshot itself is not the child's
