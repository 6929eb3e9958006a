"""OCI image leftovers (issue 15) in the reconciler and the leak audit: a sandbox's
image lease in the store, its root mount point under ``<state_dir>/roots``, and a
staging layout no pull writes any more. Each is planted for real (files, a real
mount, a real flock), then found by the inventory, counted by the audit, removed by
the reconciler and recorded in the ledger."""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from apps.sandboxes.backends import get_backend, registry_policy
from apps.sandboxes.backends.local import LocalBackend
from apps.sandboxes.backends.local.backend import STAGING_STALE_S, _mount_points, lease_holder
from apps.sandboxes.backends.local.images import ImageStore
from apps.sandboxes.models import Sandbox, SandboxEvent, State
from apps.sandboxes.services.audit import audit_compute
from apps.sandboxes.services.lifecycle import SandboxRequest, sandbox_create, sandbox_transition
from apps.sandboxes.services.reconcile import sandbox_reconcile

pytestmark = [pytest.mark.timeout(120), pytest.mark.django_db]

DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalBackend]:
    """The configured backend with a store of this test's own (the machine-wide one is
    shared with every other instance on the machine)."""
    b = get_backend()
    assert isinstance(b, LocalBackend)
    monkeypatch.setattr(b, "_store", ImageStore(tmp_path / "images", policy=registry_policy))
    yield b
    for item in b.inventory():
        if item.kind in ("sandbox_root", "image_lease", "image_staging"):
            b.reclaim(item)


def _store(backend: LocalBackend) -> ImageStore:
    store = backend._store
    assert store is not None
    return store


def _ended(tenant: Any) -> Sandbox:
    sandbox, _ = sandbox_create(
        tenant=tenant,
        request=SandboxRequest(image="host", cpu_millis=250, memory_mib=128),
        idempotency_key=None,
        actor="test",
    )
    for to_state, reason in [
        (State.PROVISIONING, "scheduled"),
        (State.READY, "agent_healthy"),
        (State.TERMINATING, "user_delete"),
        (State.DELETED, "destroyed"),
    ]:
        extra: dict[str, Any] = {}
        if to_state == State.READY:
            extra["ready_at"] = timezone.now() - timedelta(seconds=5)
        assert sandbox_transition(
            sandbox=sandbox, from_states=(sandbox.state,), to_state=to_state, reason=reason
        )
    return sandbox


def _kinds(backend: LocalBackend, kind: str) -> list[tuple[str, str | None]]:
    return [(i.name, i.sandbox_id) for i in backend.inventory() if i.kind == kind]


def test_a_lease_of_an_ended_sandbox_is_a_leak_found_recorded_and_released(
    backend: LocalBackend, make_tenant: Any
) -> None:
    tenant, _ = make_tenant()
    start = timezone.now() - timedelta(seconds=1)
    ended = _ended(tenant)
    live, _ = sandbox_create(
        tenant=tenant,
        request=SandboxRequest(image="host", cpu_millis=250, memory_mib=128),
        idempotency_key=None,
        actor="test",
    )
    store = _store(backend)
    instance = backend.config.instance
    mine = lease_holder(instance, ended.id.hex)
    store._lease(mine, DIGEST)
    store._lease(lease_holder(instance, live.id.hex), DIGEST)
    others = lease_holder("another-instance", ended.id.hex)  # not this instance's
    store._lease(others, DIGEST)

    leases = _kinds(backend, "image_lease")
    assert (f"lease:{mine}", ended.id.hex) in leases
    assert (f"lease:{lease_holder(instance, live.id.hex)}", live.id.hex) in leases
    assert not [n for n, _ in leases if "another-instance" in n]
    report = audit_compute(period_start=start, period_end=timezone.now())
    assert report.leaked_ids == [str(ended.id)]
    assert report.residual_by_kind == {"image_lease": 1}
    assert report.terms["live"] == 1

    run = sandbox_reconcile()

    assert run.actions == {"leak_reclaimed": 1}
    event = SandboxEvent.objects.get(sandbox=ended, event="leak_reclaimed")
    assert (event.reason, event.actor) == ("record_deleted", "reconciler")
    assert f"image_lease:lease:{mine}" in event.message
    assert set(store.leased()) == {lease_holder(instance, live.id.hex), others}
    after = audit_compute(period_start=start, period_end=timezone.now())
    assert (after.leaked_ids, after.terms["leaked"]) == ([], 0)
    assert after.created == after.accounted


def test_a_root_left_mounted_without_a_sandbox_is_unmounted_and_removed(
    backend: LocalBackend, make_tenant: Any
) -> None:
    tenant, _ = make_tenant()
    ended = _ended(tenant)
    roots = backend.config.state_dir / "roots"
    orphan = roots / uuid.uuid4().hex  # no record at all, still mounted
    stale = roots / ended.id.hex  # its sandbox ended, a bare mount point left
    orphan.mkdir(parents=True)
    stale.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(orphan)], check=True)
    try:
        (orphan / "upper-file").write_text("x")
        assert str(orphan) in _mount_points()
        found = _kinds(backend, "sandbox_root")
        assert (str(orphan), orphan.name) in found
        assert (str(stale), ended.id.hex) in found
        report = audit_compute(period_start=ended.created_at, period_end=timezone.now())
        assert report.leaked_ids == [str(ended.id)]
        assert orphan.name in report.orphaned

        run = sandbox_reconcile()

        assert run.actions == {"leak_reclaimed": 2}
        assert str(orphan) not in _mount_points()
        assert not orphan.exists() and not stale.exists()
        event = SandboxEvent.objects.get(sandbox=ended, event="leak_reclaimed")
        assert f"sandbox_root:{stale}" in event.message
        assert _kinds(backend, "sandbox_root") == []
    finally:
        if str(orphan) in _mount_points():
            subprocess.run(["umount", "-l", str(orphan)], check=False)


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    for dirpath, _dirs, files in os.walk(path):
        for p in [dirpath, *(os.path.join(dirpath, f) for f in files)]:
            os.utime(p, (then, then))


def test_a_staging_layout_no_pull_writes_is_removed_once_stale(backend: LocalBackend) -> None:
    store = _store(backend)
    stale, fresh, busy, import_stale = (
        store.staging / ("1" * 64),
        store.staging / ("2" * 64),
        store.staging / ("3" * 64),
        store.staging / f"import-{uuid.uuid4().hex}",
    )
    for stage in (stale, fresh, busy, import_stale):
        (stage / "blobs" / "sha256").mkdir(parents=True)
        (stage / "blobs" / "sha256" / ".partial").write_bytes(b"half a layer")
    for stage in (stale, busy, import_stale):
        _age(stage, STAGING_STALE_S + 60)
    # a pull of the third image is running: it holds that manifest's lock
    fd = os.open(store.locks / f"{busy.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        found = _kinds(backend, "image_staging")
        assert sorted(found) == sorted([(str(stale), None), (str(import_stale), None)])
        report = audit_compute(period_start=timezone.now(), period_end=timezone.now())
        assert f"image_staging:{stale}" in report.orphaned

        run = sandbox_reconcile()

        assert run.actions == {"leak_reclaimed": 1}  # the unowned items, as one reclaim
        assert run.details[0]["kinds"] == ["image_staging"]
        assert not stale.exists() and not import_stale.exists()
        assert fresh.exists() and busy.exists()
        assert list(store.tmp.iterdir()) == []  # deleted, not just moved aside
    finally:
        os.close(fd)
    # the pull ended without finishing (crashed): stale now, and removed
    assert _kinds(backend, "image_staging") == [(str(busy), None)]
    sandbox_reconcile()
    assert not busy.exists() and fresh.exists()


def test_a_staging_layout_a_pull_took_up_again_since_the_listing_is_kept(
    backend: LocalBackend,
) -> None:
    store = _store(backend)
    stage = store.staging / ("4" * 64)
    (stage / "blobs" / "sha256").mkdir(parents=True)
    _age(stage, STAGING_STALE_S + 60)
    [item] = [i for i in backend.inventory() if i.kind == "image_staging"]
    # a retried pull resumes it between the listing and the reclaim: new bytes arrive
    (stage / "blobs" / "sha256" / "partial").write_bytes(b"more")

    backend.reclaim(item)

    assert (stage / "blobs" / "sha256" / "partial").exists()
