"""Snapshots: capture a sandbox's filesystem state, restore it into new sandboxes
(fork), and prove each restore is the same state (docs/snapshots.md).

A snapshot row is written ``capturing`` by the request and captured by a worker
(``capture_snapshot``): the backend freezes the sandbox, copies its writable state
and hashes the tree; the client's probes run just before. Children are ordinary
sandboxes with ``snapshot`` set: provisioning restores the state, the backend checks
the tree, and the child is ``ready`` only once its probes answer as at capture.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from apps.billing.quotas import Ask
from apps.billing.usage import usage_pause_begin, usage_pause_end
from apps.core.errors import Conflict, ValidationFailed
from apps.sandboxes.admission import admission_decide
from apps.sandboxes.admission.use import storage_shortfall
from apps.sandboxes.agent_client import AgentClient, AgentError, AgentUnreachable, agent_token
from apps.sandboxes.backends import get_backend
from apps.sandboxes.backends.base import BackendError, Endpoint, SnapshotFailed
from apps.sandboxes.metering.storage import storage_record_close, storage_record_open
from apps.sandboxes.models import (
    Operation,
    OperationStatus,
    Sandbox,
    Snapshot,
    SnapshotState,
    State,
)
from apps.sandboxes.selectors import snapshot_get
from apps.sandboxes.services.fingerprint import (
    runtime_diff,
    runtime_fingerprint,
    validate_volatile,
)
from apps.sandboxes.services.lifecycle import (
    SandboxRequest,
    sandbox_create_fork,
    sandbox_record_event,
    sandbox_transition,
)
from apps.tenancy.models import Tenant

log = logging.getLogger(__name__)

MAX_PROBES = 16
MAX_PROBE_OUTPUT = 64 << 10  # stdout kept per probe (its sha256 covers all of it)
MAX_MANIFEST_BYTES = 256 << 10
MAX_FORK = 64
PAUSE = "pause"  # Snapshot.kind of what ``sandbox_pause`` captures
PAUSE_VOLATILE = ("ports", "processes")
DEFAULT_TTL_S = 24 * 3600
MAX_TTL_S = 30 * 24 * 3600
QUIESCE_WAIT_S = 30.0  # in-flight operations must end within this before a capture


# ---- validation --------------------------------------------------------------------


def validate_probes(raw: Any) -> list[dict[str, Any]]:
    """``[{"name", "command": str | [str], "volatile": bool, "timeout": s}]``: read-only
    commands whose output is part of the fingerprint (a volatile one is run and shown,
    never compared)."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_PROBES:
        raise ValidationFailed(f"probes: a list of at most {MAX_PROBES}", field="probes")
    probes: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ValidationFailed(f"probes[{i}]: an object", field="probes")
        command = item.get("command")
        as_text = isinstance(command, str) and bool(command.strip())
        as_argv = (
            isinstance(command, list) and bool(command) and all(isinstance(c, str) for c in command)
        )
        if not (as_text or as_argv):
            raise ValidationFailed(
                f"probes[{i}].command: a string or a list of strings", field="probes"
            )
        name = item.get("name", f"probe{i}")
        if not isinstance(name, str) or not name or len(name) > 64 or name in names:
            raise ValidationFailed(f"probes[{i}].name: unique, 1-64 chars", field="probes")
        names.add(name)
        volatile = item.get("volatile", False)
        timeout = item.get("timeout", 30)
        if not isinstance(volatile, bool):
            raise ValidationFailed(f"probes[{i}].volatile: a boolean", field="probes")
        if (
            not isinstance(timeout, int | float)
            or isinstance(timeout, bool)
            or not 0 < timeout <= 300
        ):
            raise ValidationFailed(f"probes[{i}].timeout: 0 < s ≤ 300", field="probes")
        probes.append({"name": name, "command": command, "volatile": volatile, "timeout": timeout})
    return probes


def _validate_manifest(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValidationFailed("manifest: a JSON object", field="manifest")
    if len(json.dumps(raw)) > MAX_MANIFEST_BYTES:
        raise ValidationFailed(
            f"manifest: at most {MAX_MANIFEST_BYTES} bytes of JSON", field="manifest"
        )
    return raw


# ---- capture -----------------------------------------------------------------------


def snapshot_create(
    *,
    tenant: Tenant,
    sandbox: Sandbox,
    actor: str,
    name: str = "",
    manifest: Any = None,
    probes: Any = None,
    ttl_seconds: int | None = None,
    volatile: Any = None,
) -> Snapshot:
    """Records a ``capturing`` snapshot of a ``ready`` sandbox and enqueues its capture
    after commit. 409 ``sandbox_not_ready`` for any other state; bad probes or manifest
    are a 400 and nothing is recorded."""
    clean_probes = validate_probes(probes)
    clean_manifest = _validate_manifest(manifest)
    clean_volatile = validate_volatile(volatile)
    ttl = DEFAULT_TTL_S if ttl_seconds is None else ttl_seconds
    if not 60 <= ttl <= MAX_TTL_S:
        raise ValidationFailed(f"ttl_seconds: 60 ≤ s ≤ {MAX_TTL_S}", field="ttl_seconds")
    if len(name) > 128:
        raise ValidationFailed("name: at most 128 chars", field="name")
    if sandbox.state != State.READY:
        raise Conflict(
            f"sandbox is {sandbox.state}: only a ready sandbox can be snapshotted",
            code="sandbox_not_ready",
        )
    with transaction.atomic():
        _check_storage(tenant)
        return _record_capture(
            tenant=tenant,
            sandbox=sandbox,
            actor=actor,
            name=name,
            manifest=clean_manifest,
            probes=clean_probes,
            ttl=ttl,
            volatile=clean_volatile,
        )


def _check_storage(tenant: Tenant, adding: int = 0) -> None:
    """The storage quota (kept snapshots and pauses): 429 ``quota_exceeded`` naming
    ``max_snapshot_bytes``, nothing recorded."""
    shortfall = storage_shortfall(tenant=tenant, adding=adding)
    if shortfall is not None:
        raise shortfall


def _record_capture(
    *,
    tenant: Tenant,
    sandbox: Sandbox,
    actor: str,
    name: str,
    manifest: dict[str, Any],
    probes: list[dict[str, Any]],
    ttl: int,
    volatile: list[str],
) -> Snapshot:
    from apps.sandboxes.tasks import capture_snapshot

    now = timezone.now()
    snapshot = Snapshot.objects.create(
        tenant=tenant,
        sandbox=sandbox,
        parent_id=sandbox.snapshot_id,
        name=name,
        backend=sandbox.backend,
        image=sandbox.image,
        image_digest=sandbox.image_digest,
        generation=sandbox.generation,
        manifest=manifest,
        probes=probes,
        # the client's volatile declarations, kept with the fingerprint they qualify
        fingerprint={"volatile": volatile} if volatile else {},
        ttl_seconds=ttl,
        expires_at=now + timedelta(seconds=ttl),
        created_by=actor,
        created_at=now,
    )
    snapshot_id = str(snapshot.id)
    transaction.on_commit(lambda: capture_snapshot.delay(snapshot_id))
    return snapshot


def _agent(sandbox: Sandbox) -> AgentClient:
    if not sandbox.endpoint_host or sandbox.endpoint_port is None:
        raise BackendError(f"sandbox {sandbox.external_id} has no endpoint")
    return AgentClient(
        sandbox.endpoint_host,
        sandbox.endpoint_port,
        agent_token(sandbox.id.hex, sandbox.generation),
    )


def run_probes(client: AgentClient, probes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each probe's ``{"exit_code", "stdout", "stdout_sha256"}`` (stdout cut at
    MAX_PROBE_OUTPUT; the hash is of what the agent returned)."""
    results: dict[str, dict[str, Any]] = {}
    for probe in probes:
        body = {
            "operation_id": f"probe-{uuid.uuid4().hex}",
            "command": probe["command"],
            "timeout": probe["timeout"],
        }
        answer = client.exec(body, timeout=float(probe["timeout"]) + 15)
        stdout = str((answer.get("stdout") or {}).get("head", ""))
        results[probe["name"]] = {
            "exit_code": (answer.get("termination") or {}).get("exit_code"),
            "stdout": stdout[:MAX_PROBE_OUTPUT],
            "stdout_sha256": hashlib.sha256(stdout.encode()).hexdigest(),
        }
    return results


def probe_diff(
    probes: list[dict[str, Any]],
    expected: dict[str, dict[str, Any]],
    actual: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    """Non-volatile probes whose exit code or output differ: ``{"probe", "expected",
    "actual"}`` each ``{"exit_code", "stdout"}``."""
    out = []
    for probe in probes:
        if probe["volatile"]:
            continue
        want, got = expected.get(probe["name"], {}), actual.get(probe["name"], {})
        key = ("exit_code", "stdout_sha256")
        if tuple(want.get(k) for k in key) != tuple(got.get(k) for k in key):
            out.append(
                {
                    "probe": probe["name"],
                    "expected": {"exit_code": want.get("exit_code"), "stdout": want.get("stdout")},
                    "actual": {"exit_code": got.get("exit_code"), "stdout": got.get("stdout")},
                }
            )
    return out


def _wait_quiet(sandbox: Sandbox) -> None:
    """Waits (bounded) until no operation of the sandbox is running: a command still
    writing would be cut at an arbitrary point by the freeze."""
    deadline = time.monotonic() + QUIESCE_WAIT_S
    while Operation.objects.filter(sandbox=sandbox, status=OperationStatus.RUNNING).exists():
        if time.monotonic() > deadline:
            raise SnapshotFailed(
                f"operations still running after {QUIESCE_WAIT_S:g}s", code="sandbox_busy"
            )
        time.sleep(0.05)


def _fail(snapshot: Snapshot, code: str, message: str) -> None:
    Snapshot.objects.filter(pk=snapshot.pk, state=SnapshotState.CAPTURING).update(
        state=SnapshotState.FAILED, error={"code": code, "message": message[:2000]}
    )


def snapshot_capture(*, snapshot_id: str) -> Snapshot | None:
    """The worker's half: quiesce (no running operation), run the probes, capture on
    the backend, record the fingerprint; ``capturing`` → ``ready``, or ``failed`` with a
    typed error and nothing kept on the backend. Idempotent: a snapshot no longer
    ``capturing`` is left alone."""
    snapshot = Snapshot.objects.select_related("sandbox").filter(pk=snapshot_id).first()
    if snapshot is None or snapshot.state != SnapshotState.CAPTURING:
        return snapshot
    sandbox = snapshot.sandbox
    backend = get_backend()
    pausing = snapshot.kind == PAUSE
    # a pause moved the sandbox to ``paused`` first: no new operation starts meanwhile
    expected = State.PAUSED if pausing else State.READY
    try:
        if sandbox.state != expected or sandbox.generation != snapshot.generation:
            raise SnapshotFailed(f"sandbox is {sandbox.state}", code="sandbox_not_running")
        started = time.monotonic()
        _wait_quiet(sandbox)
        client = _agent(sandbox)
        probes = run_probes(client, snapshot.probes)
        unreachable: AgentUnreachable | None = None
        runtime: dict[str, Any] = {}
        try:
            runtime = read_runtime(client)
        except AgentUnreachable as exc:
            unreachable = exc  # a sandbox gone entirely is the backend's to name, below
        info = backend.snapshot(sandbox.id.hex, snapshot.id.hex)
        if unreachable is not None:
            backend.delete_snapshot(snapshot.id.hex)
            raise unreachable
        wall = time.monotonic() - started
    except SnapshotFailed as exc:
        _fail(snapshot, exc.code, str(exc))
    except (AgentError, AgentUnreachable) as exc:
        _fail(snapshot, "probe_failed", f"a probe could not run: {exc}")
    except BackendError as exc:
        _fail(snapshot, "snapshot_failed", str(exc))
    else:
        # The storage quota is decided and the size recorded under the team's quota
        # row lock, in one transaction: two captures finishing together are counted
        # one after the other, never both against the same remaining room.
        with transaction.atomic():
            shortfall = storage_shortfall(tenant=snapshot.tenant, adding=max(1, info.size_bytes))
            moved = 0
            if shortfall is None:
                moved = Snapshot.objects.filter(
                    pk=snapshot.pk, state=SnapshotState.CAPTURING
                ).update(
                    state=SnapshotState.READY,
                    fingerprint={
                        "tree": info.fingerprint,
                        "files": info.files,
                        "probes": probes,
                        **runtime,
                        "volatile": (snapshot.fingerprint or {}).get("volatile", []),
                    },
                    size_bytes=info.size_bytes,
                    capture_s=info.capture_s,
                    capture_wall_s=wall,
                    captured_at=timezone.now(),
                )
        if shortfall is not None:
            backend.delete_snapshot(snapshot.id.hex)
            _fail(snapshot, "quota_exceeded", shortfall.message)
            return _after_capture(snapshot, sandbox, pausing)
        if not moved:  # deleted meanwhile: its backend copy must not outlive the row
            backend.delete_snapshot(snapshot.id.hex)
        else:
            _open_storage(snapshot)
            if pausing:
                _release_paused(sandbox)
    return _after_capture(snapshot, sandbox, pausing)


def _open_storage(snapshot: Snapshot) -> None:
    """Starts metering the kept bytes; a metering problem never fails a capture (the
    periodic sweep opens what is missing)."""
    snapshot.refresh_from_db()
    try:
        storage_record_open(snapshot=snapshot)
    except Exception as exc:  # noqa: BLE001 - repaired by storage_sweep
        log.warning("storage record failed: %s", exc, extra={"snapshot_id": str(snapshot.pk)})


def _after_capture(snapshot: Snapshot, sandbox: Sandbox, pausing: bool) -> Snapshot:
    snapshot.refresh_from_db()
    if pausing and snapshot.state == SnapshotState.FAILED:
        # nothing was released: the sandbox runs on as it was
        sandbox_transition(
            sandbox=sandbox,
            from_states=(State.PAUSED,),
            to_state=State.READY,
            reason="pause_failed",
            message=str((snapshot.error or {}).get("message", ""))[:1000],
        )
    return snapshot


# ---- delete and reap ---------------------------------------------------------------


def snapshot_delete(*, snapshot: Snapshot, reason: str = "deleted") -> Snapshot:
    """``capturing``/``ready``/``failed`` → ``deleted`` (with ``reason``) and the backend
    copy removed after commit (a worker). Idempotent. Sandboxes restored from it keep
    their state."""
    from apps.sandboxes.tasks import destroy_snapshot

    moved = (
        Snapshot.objects.filter(pk=snapshot.pk)
        .exclude(state=SnapshotState.DELETED)
        .update(state=SnapshotState.DELETED, deleted_at=timezone.now(), deleted_reason=reason)
    )
    snapshot.refresh_from_db()
    if moved:
        snapshot_id = str(snapshot.id)
        storage_record_close(snapshot=snapshot)
        transaction.on_commit(lambda: destroy_snapshot.delay(snapshot_id))
    return snapshot


def snapshot_reap_expired(*, now: Any = None) -> int:
    """Deletes every snapshot past its ``expires_at`` (reason ``ttl_expired``); the
    periodic reaper calls it. Returns how many."""
    now = now or timezone.now()
    reaped = 0
    for snapshot in Snapshot.objects.filter(
        state__in=(SnapshotState.READY, SnapshotState.FAILED), expires_at__lt=now
    ):
        if snapshot_delete(snapshot=snapshot, reason="ttl_expired").deleted_reason == "ttl_expired":
            reaped += 1
    return reaped


def snapshot_destroy(*, snapshot_id: str) -> None:
    """Removes the backend copy of a deleted snapshot. Idempotent; BackendError retries."""
    snapshot = Snapshot.objects.filter(pk=snapshot_id).first()
    if snapshot is None or snapshot.state != SnapshotState.DELETED:
        return
    get_backend().delete_snapshot(snapshot.id.hex)


# ---- restore and fork --------------------------------------------------------------


def snapshot_for_restore(*, tenant: Tenant, snapshot_id: str) -> Snapshot:
    """The tenant's ``ready`` snapshot a sandbox may start from: another tenant's is a
    404, one not ready a 409 ``snapshot_not_ready``."""
    snapshot = snapshot_get(tenant=tenant, snapshot_id=snapshot_id)
    if snapshot.state != SnapshotState.READY:
        raise Conflict(f"snapshot is {snapshot.state}", code="snapshot_not_ready")
    return snapshot


def snapshot_fork(
    *,
    tenant: Tenant,
    snapshot: Snapshot,
    count: int,
    idempotency_key: str | None,
    actor: str,
) -> tuple[list[Sandbox], bool]:
    """K sandboxes restored from the snapshot, with the shape of the sandbox it was
    taken of: all K recorded (and enqueued) in one transaction, or none — a quota
    that admits only some refuses the fork as a whole. With an idempotency key a
    retried fork returns the same K (created=False)."""
    if not 1 <= count <= MAX_FORK:
        raise ValidationFailed(f"count: 1 ≤ K ≤ {MAX_FORK}", field="count")
    snapshot = snapshot_for_restore(tenant=tenant, snapshot_id=str(snapshot.id))
    parent = snapshot.sandbox
    base = SandboxRequest(
        image=snapshot.image,
        cpu_millis=parent.cpu_millis,
        memory_mib=parent.memory_mib,
        network_access=parent.network_access,
        egress=parent.egress,  # the parent's egress policy, allowlist included
        ttl_seconds=min(parent.ttl_seconds, settings.HEDGEROW_MAX_TTL_S),
        labels=dict(parent.labels),
        snapshot_id=str(snapshot.id),
        queue=False,  # all now or none: never half of a fork waiting in the queue
    )
    keys = [f"{idempotency_key}:{i}" for i in range(count)] if idempotency_key else None
    if keys is not None:
        replayed = _fork_replayed(tenant=tenant, snapshot=snapshot, keys=keys)
        if replayed is not None:
            return replayed, False
    try:
        children = sandbox_create_fork(
            tenant=tenant,
            request=base,
            snapshot=snapshot,
            count=count,
            idempotency_keys=keys,
            actor=actor,
            backend_name=snapshot.backend,
        )
    except IntegrityError:
        # a concurrent fork with the same key won the race: its K are the answer
        replayed = _fork_replayed(tenant=tenant, snapshot=snapshot, keys=keys) if keys else None
        if replayed is None:
            raise Conflict("a sandbox of this fork already exists", code="sandbox_exists") from None
        return replayed, False
    return children, True


def _fork_replayed(*, tenant: Tenant, snapshot: Snapshot, keys: list[str]) -> list[Sandbox] | None:
    """The K children an earlier fork with these keys made (in order), None if there
    was none; 409 ``idempotency_mismatch`` if the key was used for another fork."""
    found = {
        s.idempotency_key: s
        for s in Sandbox.objects.filter(tenant=tenant, idempotency_key__in=keys)
    }
    if not found:
        return None
    existing = [found.get(k) for k in keys]
    if any(s is None or s.snapshot_id != snapshot.id for s in existing):
        raise Conflict(
            "this idempotency key was used for a different fork",
            field="idempotency_key",
            code="idempotency_mismatch",
        )
    return [s for s in existing if s is not None]


def _services(manifest: dict[str, Any]) -> list[str | list[str]]:
    services = manifest.get("services") if isinstance(manifest, dict) else None
    if not isinstance(services, list):
        return []
    return [s for s in services if isinstance(s, str | list)]


def restart_services(client: AgentClient, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs the manifest's ``services`` commands (what restarts a database server or a
    daemon after a restore: processes are not in a snapshot), in order. Returns one
    ``{"service", "expected", "actual"}`` per command that did not exit 0."""
    failed: list[dict[str, Any]] = []
    for command in _services(manifest):
        body = {"operation_id": f"service-{uuid.uuid4().hex}", "command": command, "timeout": 120}
        answer = client.exec(body, timeout=135)
        code = (answer.get("termination") or {}).get("exit_code")
        if code != 0:
            stderr = str((answer.get("stderr") or {}).get("head", ""))[:2000]
            failed.append(
                {
                    "service": command,
                    "expected": {"exit_code": 0},
                    "actual": {"exit_code": code, "stderr": stderr},
                }
            )
    return failed


def snapshot_verify_child(*, sandbox: Sandbox, endpoint: Endpoint) -> list[dict[str, Any]]:
    """In a restored sandbox (its agent just answered): restarts the manifest's
    services, then runs the snapshot's probes; returns what differs from the capture —
    services that failed, non-volatile probes that answer otherwise (empty: same state)."""
    assert sandbox.snapshot_id is not None
    snapshot = Snapshot.objects.get(pk=sandbox.snapshot_id)
    client = AgentClient(
        endpoint.host, endpoint.port, agent_token(sandbox.id.hex, sandbox.generation)
    )
    failed = restart_services(client, snapshot.manifest)
    if failed:
        return failed
    actual = run_probes(client, snapshot.probes)
    fingerprint = snapshot.fingerprint or {}
    diff = probe_diff(snapshot.probes, fingerprint.get("probes", {}), actual)
    if any(part in fingerprint for part in RUNTIME_PARTS):
        diff += runtime_diff(fingerprint, read_runtime(client), fingerprint.get("volatile", []))
    return diff


RUNTIME_PARTS = ("ports", "processes", "env")


def read_runtime(client: AgentClient) -> dict[str, Any]:
    """The runtime fingerprint (ports, processes, environment) from the agent; empty
    from an agent too old to answer ``/state`` (nothing of it is then compared)."""
    try:
        return runtime_fingerprint(client.state())
    except AgentError as exc:
        if exc.status == 404:
            return {}
        raise


# ---- pause and resume --------------------------------------------------------------


def sandbox_pause(*, sandbox: Sandbox, actor: str) -> Sandbox:
    """``ready`` → ``paused`` (no new operation starts), and a worker captures its
    state as a ``pause`` snapshot, then releases its compute (the backend's sandbox is
    destroyed). A capture that fails moves it back to ``ready`` (reason
    ``pause_failed``), running as before. 409 unless ``ready``."""
    from apps.sandboxes.tasks import capture_snapshot

    with transaction.atomic():
        if sandbox.state == State.READY:
            _check_storage(sandbox.tenant)
        if not sandbox_transition(
            sandbox=sandbox,
            from_states=(State.READY,),
            to_state=State.PAUSED,
            reason="paused",
            actor=actor,
        ):
            raise Conflict(
                f"sandbox is {sandbox.state}: only a ready sandbox can be paused",
                code="sandbox_not_ready",
            )
        now = timezone.now()
        ttl = max(60, int((sandbox.expires_at - now).total_seconds()))
        snapshot = Snapshot.objects.create(
            tenant_id=sandbox.tenant_id,
            sandbox=sandbox,
            parent_id=sandbox.snapshot_id,
            name="pause",
            kind=PAUSE,
            # a pause restarts no services: what ran is shown, not compared at resume
            fingerprint={"volatile": list(PAUSE_VOLATILE)},
            backend=sandbox.backend,
            image=sandbox.image,
            image_digest=sandbox.image_digest,
            generation=sandbox.generation,
            ttl_seconds=ttl,
            expires_at=now + timedelta(seconds=ttl),
            created_by=actor,
            created_at=now,
        )
        snapshot_id = str(snapshot.id)
        transaction.on_commit(lambda: capture_snapshot.delay(snapshot_id))
    return sandbox


def _release_paused(sandbox: Sandbox) -> None:
    """The pause is captured: the sandbox's processes, address and cgroups go (its
    state lives in the snapshot). Still ``paused`` when this runs, or it was deleted."""
    try:
        get_backend().destroy(sandbox.id.hex)
    except BackendError as exc:  # the reconciler finds what is left
        sandbox_record_event(sandbox=sandbox, event="destroy_error", message=str(exc))
        return
    event = sandbox_record_event(sandbox=sandbox, event="compute_released", reason="paused")
    # from here the sandbox holds no CPU or memory: its usage record stops accruing and
    # its pause's bytes are billed as storage (docs/billing.md, "Paused sandboxes")
    usage_pause_begin(sandbox_id=sandbox.pk, at=event.at)


def _pause_snapshot(sandbox: Sandbox) -> Snapshot | None:
    return (
        Snapshot.objects.filter(sandbox=sandbox, kind=PAUSE, generation=sandbox.generation)
        .exclude(state=SnapshotState.DELETED)
        .order_by("-created_at")
        .first()
    )


def sandbox_resume(*, sandbox: Sandbox, actor: str) -> Sandbox:
    """``paused`` → ``requested``: provisioning restores the pause snapshot under the
    same id with generation + 1 (operations naming the old generation get 409
    ``stale_generation``), verified like any restore. 409 ``sandbox_pausing`` while the
    capture runs, ``sandbox_not_paused`` unless paused."""
    from apps.sandboxes.tasks import provision_sandbox

    if sandbox.state != State.PAUSED:
        raise Conflict(f"sandbox is {sandbox.state}, not paused", code="sandbox_not_paused")
    snapshot = _pause_snapshot(sandbox)
    if snapshot is None or snapshot.state != SnapshotState.READY:
        raise Conflict("the pause is still being captured", code="sandbox_pausing")
    with transaction.atomic():
        # it takes CPU and memory again: admitted like a create (429/403 naming the
        # limit, and it stays paused), never queued
        ask = Ask(
            cpu_millis=sandbox.cpu_millis,
            memory_mib=sandbox.memory_mib,
            ttl_seconds=sandbox.ttl_seconds,
            actor=actor,
        )
        admission_decide(tenant=sandbox.tenant, ask=ask, queue=False)
        now = timezone.now()
        if not sandbox_transition(
            sandbox=sandbox,
            from_states=(State.PAUSED,),
            to_state=State.REQUESTED,
            reason="resumed",
            actor=actor,
            snapshot_id=snapshot.id,
            admitted_at=now,
        ):
            raise Conflict(f"sandbox is {sandbox.state}, not paused", code="sandbox_not_paused")
        usage_pause_end(sandbox_id=sandbox.pk, at=now)
        sandbox_id = str(sandbox.id)
        transaction.on_commit(lambda: provision_sandbox.delay(sandbox_id))
    return sandbox


def snapshot_drop_pause(*, sandbox: Sandbox) -> None:
    """A resumed sandbox no longer needs its pause snapshot; an ended one neither."""
    for snapshot in Snapshot.objects.filter(sandbox=sandbox, kind=PAUSE).exclude(
        state=SnapshotState.DELETED
    ):
        snapshot_delete(snapshot=snapshot, reason="resumed" if sandbox.is_live else "deleted")
