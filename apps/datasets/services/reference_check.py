"""Hedgerow runs a task's verifier itself: on the initial state, then on the registered
reference solution, once per (task version, image digest, verifier version), in a real
sandbox made through the ordinary create path (quotas, tenancy, cost and the ledger
apply), and always deletes that sandbox (docs/trajectories.md, "Verifier health").

The verdict of each run is the verifier contract's (``apps.trajectories``): a declared
report decides pass/fail from its per-test vector, not found / not executable / the
framework's own error / a timeout is ``error``. A verifier that does not pass the
reference, or passes the initial state, makes the task ``verifier_suspect``
(difficulty.health_refresh). A check that broke on its own (the sandbox never became
ready, was lost, a quota refused it, the reference did not apply) is status ``error``:
it is no evidence about the verifier, and the same key may be checked again."""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from apps.core.errors import ApiError, NotFound, ValidationFailed
from apps.datasets.models import ReferenceRun, Task
from apps.datasets.services.difficulty import health_refresh
from apps.sandboxes.image_catalog import image_catalog
from apps.sandboxes.models import Operation, OperationStatus, Sandbox, State
from apps.sandboxes.services.files import file_open, file_write
from apps.sandboxes.services.lifecycle import SandboxRequest, sandbox_create, sandbox_delete
from apps.sandboxes.services.operations import ExecRequest, operation_exec
from apps.sandboxes.services.waiting import sandbox_wait_settled
from apps.tenancy.models import Tenant
from apps.tenancy.principal import Principal
from apps.trajectories.models import VerifierKind
from apps.trajectories.services.attribution import (
    NOT_RUNNABLE,
    report_outcome,
    verifier_exit_outcome,
    verifier_kind,
)
from apps.trajectories.services.junit import MAX_REPORT_BYTES, ReportInvalid, parse_report

logger = logging.getLogger(__name__)

MAX_SOLUTION_BYTES = 256 * 1024  # the reference's files (or patch) together
MAX_SOLUTION_FILES = 200
MAX_VERIFIER_TIMEOUT_S = 1800
READY_TIMEOUT_S = 300
CHECK_TTL_S = 3600  # the sandbox's TTL: a worker that dies mid-check leaks nothing for long
PATCH_PATH = "/tmp/hedgerow-reference.patch"  # inside the sandbox
ACTIVE = ("queued", "running", "done")
# a queued or running check older than its task's time limit will never finish (a lost
# message, a worker killed mid-check): the next request checks the key again
STALE_AFTER_S = READY_TIMEOUT_S + 2 * MAX_VERIFIER_TIMEOUT_S + 600


def _text(value: Any, name: str, limit: int, *, required: bool = False) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value) or len(value) > limit:
        raise ValidationFailed(
            f"{name} is a {'non-empty ' if required else ''}string of at most {limit} characters",
            field=f"reference.{name}",
        )
    if "\x00" in value:
        raise ValidationFailed(f"{name} has a NUL character", field=f"reference.{name}")
    return value


def _abs_path(value: Any, name: str) -> str:
    path = _text(value, name, 1024, required=True)
    if not path.startswith("/") or "/../" in f"{path}/":
        raise ValidationFailed(
            f"{name} is an absolute path without '..'", field=f"reference.{name}"
        )
    return path


def reference_spec_check(raw: Any) -> dict[str, Any]:
    """The reference a task registers, checked and normalised, or a 400 naming the field:

    ``{"image": "host", "task_version": "v1", "verifier": {"command": str | [str],
    "kind": "pytest", "version": "3", "report_path": "/workspace/report.xml",
    "timeout": 120, "cwd": "/workspace"}, "solution": {"files": {path: text}} or
    {"patch": "unified diff", "cwd": "/workspace"}}`` — the solution at most
    ``MAX_SOLUTION_BYTES`` in all."""
    if not isinstance(raw, dict):
        raise ValidationFailed("reference is an object", field="reference")
    unknown = set(raw) - {"image", "task_version", "verifier", "solution"}
    if unknown:
        raise ValidationFailed(f"unknown keys {sorted(unknown)}", field="reference")
    spec: dict[str, Any] = {
        "image": _text(raw.get("image", "host"), "image", 200, required=True),
        "task_version": _text(raw.get("task_version"), "task_version", 100),
    }
    verifier = raw.get("verifier")
    if not isinstance(verifier, dict):
        raise ValidationFailed("verifier is an object", field="reference.verifier")
    command = verifier.get("command")
    if isinstance(command, list):
        if not command or not all(isinstance(c, str) and "\x00" not in c for c in command):
            raise ValidationFailed(
                "verifier.command is a string or a non-empty list of strings",
                field="reference.verifier.command",
            )
        if sum(len(c) for c in command) > 8192:
            raise ValidationFailed(
                "verifier.command is at most 8192 characters", field="reference.verifier.command"
            )
    else:
        command = _text(command, "verifier.command", 8192, required=True)
    kind = verifier.get("kind", VerifierKind.CUSTOM)
    if kind not in VerifierKind.values:
        raise ValidationFailed(
            f"verifier.kind is one of {', '.join(VerifierKind.values)}",
            field="reference.verifier.kind",
        )
    timeout = verifier.get("timeout", 300)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 1 <= timeout <= MAX_VERIFIER_TIMEOUT_S
    ):
        raise ValidationFailed(
            f"verifier.timeout is 1–{MAX_VERIFIER_TIMEOUT_S} seconds",
            field="reference.verifier.timeout",
        )
    spec["verifier"] = {
        "command": command,
        "kind": kind,
        "version": _text(verifier.get("version"), "verifier.version", 100),
        "timeout": timeout,
    }
    for key in ("report_path", "cwd"):
        if verifier.get(key) is not None:
            spec["verifier"][key] = _abs_path(verifier[key], f"verifier.{key}")
    solution = raw.get("solution")
    if not isinstance(solution, dict) or ("files" in solution) == ("patch" in solution):
        raise ValidationFailed(
            'solution is {"files": {path: text}} or {"patch": "…"}', field="reference.solution"
        )
    if "files" in solution:
        files = solution["files"]
        if not isinstance(files, dict) or not files or len(files) > MAX_SOLUTION_FILES:
            raise ValidationFailed(
                f"solution.files is an object of 1–{MAX_SOLUTION_FILES} paths",
                field="reference.solution.files",
            )
        clean: dict[str, str] = {}
        for path, text in files.items():
            where = f"solution.files[{path!r}]"
            clean[_abs_path(path, where)] = _text(text, where, MAX_SOLUTION_BYTES)
        size = sum(len(t.encode()) for t in clean.values())
        spec["solution"] = {"files": clean}
    else:
        patch = _text(solution["patch"], "solution.patch", MAX_SOLUTION_BYTES, required=True)
        size = len(patch.encode())
        spec["solution"] = {
            "patch": patch,
            "cwd": _abs_path(solution.get("cwd", "/workspace"), "solution.cwd"),
        }
    if size > MAX_SOLUTION_BYTES:
        raise ValidationFailed(
            f"the reference solution is {size} bytes; at most {MAX_SOLUTION_BYTES}",
            field="reference.solution",
            code="too_large",
        )
    return spec


def reference_summary(spec: dict[str, Any]) -> dict[str, Any]:
    """What the API shows of a registered reference: everything but the solution's
    content (its paths and size)."""
    if not spec:
        return {}
    solution = spec["solution"]
    shown = (
        {
            "files": sorted(solution["files"]),
            "bytes": sum(len(t.encode()) for t in solution["files"].values()),
        }
        if "files" in solution
        else {"patch_bytes": len(solution["patch"]), "cwd": solution["cwd"]}
    )
    return {
        "image": spec["image"],
        "task_version": spec["task_version"],
        "verifier": spec["verifier"],
        "solution": shown,
    }


def reference_check_request(
    *, tenant: Tenant, task_id: str, actor: str
) -> tuple[ReferenceRun, bool]:
    """The task's check for its current key: the stored run when there is one that did
    not break (cached: no sandbox is made), else a new ``queued`` run whose Celery task
    is enqueued after commit. Returns (run, enqueued). An image the tenant cannot have
    is the create path's typed 4xx before anything is recorded."""
    from apps.datasets.tasks import run_reference_check

    task = Task.objects.filter(tenant=tenant, task_id=task_id).first()
    if task is None:
        raise NotFound(f"no task {task_id!r}", code="task_not_found")
    spec = task.reference
    if not spec:
        raise ValidationFailed(
            "the task has no reference registered (PUT /tasks/{id} with reference)",
            field="reference",
            code="no_reference",
        )
    digest = image_catalog().resolve_digest(tenant, spec["image"])
    key = {
        "tenant": tenant,
        "task_id": task_id,
        "task_version": spec["task_version"],
        "image_digest": digest,
        "verifier_version": spec["verifier"]["version"],
    }
    queued = {
        "reference_outcome": "",
        "initial_outcome": "",
        "source": "check",
        "status": "queued",
        "episode": None,
        "initial_episode": None,
        "detail": {"image": spec["image"]},
        "recorded_by": actor,
        "recorded_at": timezone.now(),
    }
    with transaction.atomic():
        run = ReferenceRun.objects.select_for_update().filter(**key).first()
        stale = run is not None and (
            run.status in ("queued", "running")
            and run.recorded_at < timezone.now() - timedelta(seconds=STALE_AFTER_S)
        )
        if run is not None and run.status in ACTIVE and not stale:
            return run, False
        try:
            with transaction.atomic():
                if run is None:
                    run = ReferenceRun.objects.create(**key, **queued)
                else:  # the last check of this key broke (or is stale): check again
                    for name, value in queued.items():
                        setattr(run, name, value)
                    run.save()
        except IntegrityError:  # a concurrent request made it first: that one is the run
            return ReferenceRun.objects.get(**key), False
        run_pk = run.pk
        transaction.on_commit(lambda: run_reference_check.delay(run_pk))
    return run, True


@dataclass
class _CheckPrincipal(Principal):
    """The check acts for the team that asked, named in the ledger as who asked."""

    name: str = "reference-check"

    @property
    def actor(self) -> str:
        return self.name


class CheckBroke(Exception):
    """The check itself failed (not the verifier): recorded as status ``error``."""


def _still_ready(sandbox: Sandbox, generation: int) -> None:
    sandbox.refresh_from_db()
    if sandbox.state != State.READY or sandbox.generation != generation:
        raise CheckBroke(
            f"the sandbox {sandbox.external_id} went away during the check "
            f"({sandbox.state}, generation {sandbox.generation})"
        )


def _exec(principal: Principal, sandbox: Sandbox, command: Any, **kw: Any) -> Operation:
    """One command; a sandbox that went away, was re-provisioned, or whose agent failed
    is the check breaking (its commands may have been killed with it), never a verdict."""
    generation = sandbox.generation
    _still_ready(sandbox, generation)
    try:
        op = operation_exec(
            principal=principal,
            sandbox=sandbox,
            request=ExecRequest(command=command, **kw),
            expected_generation=generation,
        )
    except ApiError as exc:
        raise CheckBroke(f"exec refused: {exc.code}: {exc.message}") from exc
    _still_ready(sandbox, generation)
    error = op.error or {}
    if op.status == OperationStatus.FAILED and error.get("code") != "resource_exhausted":
        raise CheckBroke(f"the exec failed: {error.get('code')}: {error.get('message')}")
    return op


def _read_report(sandbox: Sandbox, path: str) -> str | None:
    try:
        data = file_open(sandbox=sandbox, path=path).read_all(MAX_REPORT_BYTES)
    except ApiError as exc:
        if exc.status_code in (400, 403, 404):
            return None  # no report: the contract's "verifier wrote no report"
        raise CheckBroke(f"report read failed: {exc.code}: {exc.message}") from exc
    return data.decode("utf-8", "replace")


def _run_verifier(principal: Principal, sandbox: Sandbox, spec: dict[str, Any]) -> dict[str, Any]:
    """One verifier run and its verdict under the verifier contract."""
    verifier = spec["verifier"]
    report_path = verifier.get("report_path")
    if report_path:  # a report left by an earlier run (or the image) must not count
        _exec(principal, sandbox, ["rm", "-f", "--", report_path], timeout=30)
    started = time.monotonic()
    op = _exec(
        principal,
        sandbox,
        verifier["command"],
        timeout=float(verifier["timeout"]),
        cwd=verifier.get("cwd"),
    )
    run: dict[str, Any] = {
        "operation_id": op.operation_id,
        "termination": op.termination or op.status,
        "exit_code": op.exit_code,
        "duration_s": round(time.monotonic() - started, 3),
    }
    kind = verifier_kind({"kind": verifier["kind"]}, verifier["command"])
    if op.termination == "timeout":
        run["outcome"], run["why"] = "timeout", "the verifier timed out"
    elif op.termination != "exited":
        run["outcome"], run["why"] = "error", f"the verifier ended {op.termination or op.status}"
    elif op.exit_code in NOT_RUNNABLE or not report_path:
        run["outcome"], run["why"] = verifier_exit_outcome(kind, op.exit_code)
    else:
        declared: dict[str, Any] = {"report": {"format": "junit-xml", "path": report_path}}
        text = _read_report(sandbox, report_path)
        if not text:
            declared["report"]["error"] = "the verifier wrote no report"
        else:
            try:
                declared["report"]["format"], parsed = parse_report(text)
                declared["results"], declared["summary"] = parsed.results, parsed.summary
            except ReportInvalid as exc:
                declared["report"]["error"] = str(exc)
        run["outcome"], run["why"] = report_outcome(declared)
        run["report"] = declared["report"]
        if "results" in declared:
            run["results"], run["summary"] = declared["results"], declared["summary"]
    return run


def _apply(principal: Principal, sandbox: Sandbox, solution: dict[str, Any]) -> dict[str, Any]:
    def put(path: str, text: str) -> None:
        data = text.encode()
        try:
            file_write(
                sandbox=sandbox,
                path=path,
                chunks=iter([data]),
                size=len(data),
                max_bytes=MAX_SOLUTION_BYTES,
            )
        except ApiError as exc:
            raise CheckBroke(f"writing {path} failed: {exc.code}: {exc.message}") from exc

    if "files" in solution:
        for path, text in solution["files"].items():
            put(path, text)
        return {"files": len(solution["files"])}
    put(PATCH_PATH, solution["patch"])
    op = _exec(
        principal,
        sandbox,
        ["patch", "-p1", "--batch", "--forward", "-i", PATCH_PATH],
        cwd=solution["cwd"],
        timeout=60,
    )
    if op.termination != "exited" or op.exit_code != 0:
        out = op.stdout or {}
        tail = str(out.get("tail") or out.get("head") or "")
        if out.get("encoding") == "base64":
            tail = base64.b64decode(tail).decode("utf-8", "replace")
        raise CheckBroke(f"the reference patch did not apply (exit {op.exit_code}): {tail[-500:]}")
    return {"patch": "applied"}


def reference_check_run(*, run_pk: int) -> ReferenceRun | None:
    """The Celery task's body: queued → running, then sandbox, initial run, reference,
    reference run, delete the sandbox (always), done (or error)."""
    moved = ReferenceRun.objects.filter(pk=run_pk, status="queued").update(status="running")
    if not moved:
        return None  # already taken (a redelivered message) or gone
    run = ReferenceRun.objects.select_related("tenant").get(pk=run_pk)
    task = Task.objects.filter(tenant_id=run.tenant_id, task_id=run.task_id).first()
    spec = task.reference if task is not None else {}
    detail: dict[str, Any] = dict(run.detail)
    principal = _CheckPrincipal(
        tenant=run.tenant, scopes=frozenset({"read", "write"}), name=run.recorded_by or "check"
    )
    sandbox: Sandbox | None = None
    started = time.monotonic()
    status = "done"
    try:
        if not spec:
            raise CheckBroke("the task's reference was removed")
        try:
            sandbox, _ = sandbox_create(
                tenant=run.tenant,
                request=SandboxRequest(
                    image=spec["image"],
                    cpu_millis=1000,
                    memory_mib=1024,
                    ttl_seconds=CHECK_TTL_S,
                    labels={"hedgerow-reference-check": str(run.pk)},
                    queue=False,  # over a quota: an error now, not a check that never runs
                ),
                idempotency_key=f"reference-check-{run.pk}-{run.recorded_at.timestamp()}",
                actor=principal.actor,
            )
        except ApiError as exc:
            raise CheckBroke(f"sandbox create refused: {exc.code}: {exc.message}") from exc
        detail["sandbox_id"] = sandbox.external_id
        ReferenceRun.objects.filter(pk=run_pk).update(detail=detail)
        sandbox = sandbox_wait_settled(sandbox=sandbox, timeout_s=READY_TIMEOUT_S)
        if sandbox.state != State.READY:
            raise CheckBroke(f"the sandbox did not become ready: {sandbox.state}")
        initial = _run_verifier(principal, sandbox, spec)
        detail["initial"] = initial
        detail["apply"] = _apply(principal, sandbox, spec["solution"])
        reference = _run_verifier(principal, sandbox, spec)
        detail["reference"] = reference
        run.initial_outcome, run.reference_outcome = initial["outcome"], reference["outcome"]
    except CheckBroke as exc:
        status, detail["error"] = "error", str(exc)
    except Exception as exc:  # the check must end; the sandbox must go
        logger.exception("reference check %s failed", run_pk)
        status, detail["error"] = "error", f"{type(exc).__name__}: {exc}"
    finally:
        if sandbox is not None:
            try:
                sandbox.refresh_from_db()
                sandbox_delete(
                    sandbox=sandbox, actor=principal.actor, reason="reference_check_done"
                )
            except Exception as exc:  # the TTL reaps it; the run says so
                logger.exception("reference check %s: deleting %s failed", run_pk, sandbox.pk)
                status, detail["error"] = "error", f"sandbox delete failed: {exc}"
    detail["duration_s"] = round(time.monotonic() - started, 3)
    with transaction.atomic():
        run.status, run.detail = status, detail
        if status == "error":
            run.reference_outcome = run.reference_outcome or ""
        run.save(update_fields=["status", "detail", "initial_outcome", "reference_outcome"])
        health_refresh(tenant_id=run.tenant_id, task_id=run.task_id)
    return run
