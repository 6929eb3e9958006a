"""Episodes: a portable record of one rollout.

    with sandbox.episode(task_id="fix-bug-12", harness="my-harness", model="m-1") as ep:
        out = sandbox.exec("pytest -x")           # recorded as a step automatically
        ep.step(action=model_text, observation={"text": prompt}, kind="model",
                model_call={"tokens_in": 812, "tokens_out": 64, "latency_s": 1.9})
        ep.verify("pytest -q", kind="pytest", timeout=60)  # the verdict, as a step
    # closed on exit: an exception closes it as ``harness_crash`` (and is re-raised)

The control plane links exec steps to its own operation records and decides the
failure class from its own ledger when the episode closes.

Provenance (docs/trajectories.md, "Provenance keys"): supply what the server cannot know
and the episode's key is derived from it (missing parts are ``unknown``)::

    sb.episode(task_id="fix-bug-12", task_hash=hedgerow.content_hash(task_spec),
               policy_checkpoint="run-7/step-1200", harness_commit="3f2a9c1",
               verifier_commit="b71e0d4", sampling={"temperature": 0.7}, attempt_id="a-3")
"""

from __future__ import annotations

import contextvars
import hashlib
import json
from datetime import datetime, timezone
from types import TracebackType
from typing import TYPE_CHECKING, Any

from hedgerow._common import USER_AGENT, Command, new_operation_id
from hedgerow.errors import HedgerowError, SandboxLost, SandboxTerminating
from hedgerow.shapes import EpisodeData

if TYPE_CHECKING:
    from hedgerow.aio import AsyncClient, AsyncSandbox
    from hedgerow.client import Client, Sandbox
    from hedgerow.results import ExecResult

_current: contextvars.ContextVar[Episode | None] = contextvars.ContextVar(
    "hedgerow_episode", default=None
)
FLUSH_EVERY = 16
VERIFIER_KINDS = ("pytest", "unittest", "go", "jest", "junit-xml", "custom")
# The control plane's mapping (apps/trajectories/services/attribution.py), so the
# local verdict agrees with the recorded one: these exits mean the verifier did not
# run or the framework failed on its own (no test judged the policy).
_NOT_RUNNABLE = frozenset({126, 127})
_FRAMEWORK_ERRORS = {
    "pytest": frozenset({3, 4, 5}),
    "unittest": frozenset({5}),
    "go": frozenset({2}),
}
# Errors that mean the sandbox went away under the episode (lost, or deleted by
# anyone): the episode ends ``sandbox_lost``, not ``harness_crash``.
_SANDBOX_GONE = (SandboxLost, SandboxTerminating)
_SANDBOX_GONE_CODES = frozenset({"sandbox_lost", "sandbox_terminating", "sandbox_deleted"})


def _sandbox_gone(exc: BaseException) -> bool:
    return isinstance(exc, _SANDBOX_GONE) or (
        isinstance(exc, HedgerowError) and exc.code in _SANDBOX_GONE_CODES
    )


_current_async: contextvars.ContextVar[AsyncEpisode | None] = contextvars.ContextVar(
    "hedgerow_async_episode", default=None
)


def content_hash(content: Any) -> str:
    """``sha256:<hex>`` of a task's content, for ``sb.episode(task_hash=…)``: bytes as
    given, a str as UTF-8, anything else as canonical JSON (sorted keys, no spaces), so
    the same task hashes the same wherever it is recorded."""
    if isinstance(content, bytes):
        raw = content
    elif isinstance(content, str):
        raw = content.encode()
    else:
        raw = json.dumps(
            content, sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode()
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def current_episode() -> Episode | None:
    return _current.get()


def current_async_episode() -> AsyncEpisode | None:
    return _current_async.get()


def _storable(command: Command) -> Command:
    """The command as a step's action. A NUL cannot be stored (the control plane
    refuses it, as it refused the exec itself): shown as the two characters ``\\0``, so
    the step records what was tried instead of failing the whole episode."""
    if isinstance(command, str):
        return command.replace("\x00", "\\0")
    return [arg.replace("\x00", "\\0") for arg in command]


def local_outcome(result: ExecResult, kind: str) -> str:
    """The verifier's outcome as the control plane reads it from its exit (a declared
    report, parsed there, can still overrule it)."""
    if result.timed_out:
        return "timeout"
    if result.termination != "exited":
        return "error"
    if result.exit_code == 0:
        return "pass"
    if result.exit_code in _NOT_RUNNABLE or result.exit_code in _FRAMEWORK_ERRORS.get(
        kind, frozenset()
    ):
        return "error"
    return "fail"


def check_verifier_kind(kind: str) -> None:
    if kind not in VERIFIER_KINDS:
        raise ValueError(f"kind is one of {', '.join(VERIFIER_KINDS)}")


class EpisodeRecord:
    """What the sync and async episodes share: the open body, the pending steps and the
    result; no I/O."""

    def __init__(
        self,
        client: Any,
        sandboxes: list[Any],
        *,
        task_id: str,
        episode_id: str | None = None,
        **fields: Any,
    ) -> None:
        self._client = client
        self._sandboxes = {s.id for s in sandboxes}
        self._open_body: dict[str, Any] = {
            "task_id": task_id,
            "sandbox_ids": sorted(self._sandboxes),
            **{k: v for k, v in fields.items() if v is not None},
        }
        if episode_id:
            self._open_body["episode_id"] = episode_id
        self._open_body.setdefault("versions", {})
        self._open_body["versions"].setdefault("client", USER_AGENT)
        self.data: EpisodeData = {}  # the server's JSON as last read
        self._pending: list[dict[str, Any]] = []
        self._next_index = 0
        self._result: dict[str, Any] = {}

    @property
    def id(self) -> str:
        """The episode's id (once opened)."""
        return str(self.data["id"])

    @property
    def failure_class(self) -> str:
        """Why it failed, as the server classified it ('' while open or if it did not)."""
        return str(self.data.get("failure_class") or "")

    # -- steps ----------------------------------------------------------------
    def _add(self, step: dict[str, Any]) -> None:
        step["index"] = self._next_index
        self._next_index += 1
        self._pending.append(step)

    def step(
        self,
        *,
        action: Any = None,
        observation: dict[str, Any] | None = None,
        kind: str = "model",
        shown: Any = None,
        diff: str | None = None,
        model_call: dict[str, Any] | None = None,
        request: Any = None,
    ) -> None:
        """Adds a model/tool step that is not an exec (execs are recorded for you)."""
        step: dict[str, Any] = {
            "kind": kind,
            "action": action,
            "started_at": datetime.now(timezone.utc).isoformat(),
        }
        for key, value in (
            ("observation", observation),
            ("shown", shown),
            ("diff", diff),
            ("model_call", model_call),
            ("request", request),
        ):
            if value is not None:
                step[key] = value
        self._add(step)

    def record_exec(
        self,
        sandbox: Any,
        operation_id: str,
        command: Command,
        *,
        error: HedgerowError | None = None,
        kind: str = "exec",
        verifier: dict[str, Any] | None = None,
    ) -> None:
        """Adds the step of an exec that ran (the clients call it for every exec made
        inside the episode; call it yourself for one made outside)."""
        if sandbox.id not in self._sandboxes and self.data:
            self._sandboxes.add(sandbox.id)
        step: dict[str, Any] = {
            "kind": kind,
            "action": _storable(command),
            "sandbox_id": sandbox.id,
        }
        if verifier:
            step["verifier"] = verifier
        if error is None or error.status >= 500:
            # The control plane has the operation (a 502 leaves a failed row): link it.
            step["operation_id"] = operation_id
        else:
            step["observation"] = {"error": {"code": error.code, "message": error.message}}
        self._add(step)

    def set_result(self, **result: Any) -> None:
        """termination_reason, reward, reward_components, verifier_name/version/outcome,
        inference_error, client_cost (what the episode cost outside the sandbox, e.g.
        model tokens, as a decimal string) — sent when the episode closes."""
        self._result.update({k: v for k, v in result.items() if v is not None})

    def _exit_reason(self, exc: BaseException) -> None:
        if "termination_reason" not in self._result:
            reason = "sandbox_lost" if _sandbox_gone(exc) else "harness_crash"
            self._result["termination_reason"] = reason

    def _close_body(self, result: dict[str, Any]) -> dict[str, Any]:
        self.set_result(**result)
        body = dict(self._result)
        body.setdefault("termination_reason", "submitted")
        return body


class Episode(EpisodeRecord):
    def __init__(
        self,
        client: Client,
        sandboxes: list[Sandbox],
        *,
        task_id: str,
        episode_id: str | None = None,
        **fields: Any,
    ) -> None:
        super().__init__(client, sandboxes, task_id=task_id, episode_id=episode_id, **fields)
        self._client: Client = client
        self._token: contextvars.Token[Episode | None] | None = None

    def open(self) -> Episode:
        """Opens the episode on the server (``with`` does it for you)."""
        self.data = self._client.request("POST", "/episodes", json=self._open_body).json()
        return self

    def _add(self, step: dict[str, Any]) -> None:
        super()._add(step)
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Sends the steps not sent yet (every 16 steps and at close on their own)."""
        if not self._pending or not self.data:
            return
        batch, self._pending = self._pending, []
        self._client.request("POST", f"/episodes/{self.id}/steps", json={"steps": batch})

    # -- outcome ----------------------------------------------------------------
    def verify(
        self,
        command: Command,
        *,
        sandbox: Sandbox | None = None,
        timeout: float | None = None,
        name: str | None = None,
        version: str | None = None,
        kind: str = "custom",
        report: str | None = None,
    ) -> ExecResult:
        """Runs the verifier as a step. ``kind`` (pytest, unittest, go, jest, junit-xml,
        custom) says which exit codes are the framework's own errors. Exit 0 = pass; exit
        126/127 (not executable / not found), a framework error (pytest 3/4/5,
        unittest 5, go 2), a timeout or a kill = the verifier did not judge the policy
        (``error``/``timeout``: class ``verifier``); other exits = fail. An exec that
        raises is recorded as a step too (the refused command), then re-raised.

        ``report``: where the verifier writes JUnit XML (``pytest --junitxml=PATH``). It
        is read back from the sandbox and the control plane keeps the per-test results
        on the step; the report then decides pass/fail, and no report or a report with
        no executed test means the verifier did not judge (``verifier``)."""
        check_verifier_kind(kind)
        target = sandbox or self._only_sandbox()
        token = _current.set(None)  # recorded below as a verifier step, not an exec
        declared: dict[str, Any] = {"kind": kind}
        operation_id = new_operation_id()
        try:
            result = target.exec(command, timeout=timeout, operation_id=operation_id)
        except HedgerowError as exc:
            self.record_exec(
                target, operation_id, command, error=exc, kind="verifier", verifier=declared
            )
            raise
        finally:
            _current.reset(token)
        if report is not None:
            declared["report_path"] = report
            try:
                declared["report"] = target.read_file(report).decode("utf-8", "replace")
            except HedgerowError:
                declared["report"] = ""  # the verifier wrote none: the control plane decides
        self.record_exec(target, result.operation_id, command, kind="verifier", verifier=declared)
        outcome = local_outcome(result, kind)
        self.set_result(verifier_outcome=outcome, verifier_name=name, verifier_version=version)
        return result

    def _only_sandbox(self) -> Sandbox:
        if len(self._sandboxes) != 1:
            raise HedgerowError("verify() needs sandbox= when the episode has several")
        return self._client._sandbox({"id": next(iter(self._sandboxes))})

    def close(self, **result: Any) -> EpisodeData:
        """Sends the last steps and closes the episode with ``result`` (``reward=``,
        ``termination_reason=``, …); returns the closed episode (``with`` closes it)."""
        body = self._close_body(result)
        self.flush()
        self.data = self._client.request("POST", f"/episodes/{self.id}/close", json=body).json()
        return self.data

    def __enter__(self) -> Episode:
        if not self.data:
            self.open()
        self._token = _current.set(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        if exc is None:
            self.close()
            return
        self._exit_reason(exc)
        try:
            self.close()
        except HedgerowError:
            pass  # the harness's own exception is the one to see


class AsyncEpisode(EpisodeRecord):
    """The episode for ``hedgerow.aio``: ``async with sandbox.episode(task_id=...) as ep``.
    Execs (``await sandbox.exec``) inside the block become steps; ``await ep.verify``."""

    def __init__(
        self,
        client: AsyncClient,
        sandboxes: list[AsyncSandbox],
        *,
        task_id: str,
        episode_id: str | None = None,
        **fields: Any,
    ) -> None:
        super().__init__(client, sandboxes, task_id=task_id, episode_id=episode_id, **fields)
        self._client: AsyncClient = client
        self._token: contextvars.Token[AsyncEpisode | None] | None = None

    async def open(self) -> AsyncEpisode:
        """See ``Episode.open``."""
        self.data = (await self._client.request("POST", "/episodes", json=self._open_body)).json()
        return self

    async def flush(self) -> None:
        """See ``Episode.flush``."""
        if not self._pending or not self.data:
            return
        batch, self._pending = self._pending, []
        await self._client.request("POST", f"/episodes/{self.id}/steps", json={"steps": batch})

    async def flush_if_due(self) -> None:
        """Flushes once 16 steps are waiting (called from the event loop)."""
        if len(self._pending) >= FLUSH_EVERY:
            await self.flush()

    async def verify(
        self,
        command: Command,
        *,
        sandbox: AsyncSandbox | None = None,
        timeout: float | None = None,
        name: str | None = None,
        version: str | None = None,
        kind: str = "custom",
        report: str | None = None,
    ) -> ExecResult:
        """See ``Episode.verify``."""
        check_verifier_kind(kind)
        target = sandbox or self._only_sandbox()
        token = _current_async.set(None)  # recorded below as a verifier step
        declared: dict[str, Any] = {"kind": kind}
        operation_id = new_operation_id()
        try:
            result = await target.exec(command, timeout=timeout, operation_id=operation_id)
        except HedgerowError as exc:
            self.record_exec(
                target, operation_id, command, error=exc, kind="verifier", verifier=declared
            )
            raise
        finally:
            _current_async.reset(token)
        if report is not None:
            declared["report_path"] = report
            try:
                declared["report"] = (await target.read_file(report)).decode("utf-8", "replace")
            except HedgerowError:
                declared["report"] = ""
        self.record_exec(target, result.operation_id, command, kind="verifier", verifier=declared)
        outcome = local_outcome(result, kind)
        self.set_result(verifier_outcome=outcome, verifier_name=name, verifier_version=version)
        return result

    def _only_sandbox(self) -> AsyncSandbox:
        if len(self._sandboxes) != 1:
            raise HedgerowError("verify() needs sandbox= when the episode has several")
        return self._client._sandbox({"id": next(iter(self._sandboxes))})

    async def close(self, **result: Any) -> EpisodeData:
        """See ``Episode.close``."""
        body = self._close_body(result)
        await self.flush()
        self.data = (
            await self._client.request("POST", f"/episodes/{self.id}/close", json=body)
        ).json()
        return self.data

    async def __aenter__(self) -> AsyncEpisode:
        if not self.data:
            await self.open()
        self._token = _current_async.set(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _current_async.reset(self._token)
            self._token = None
        if exc is None:
            await self.close()
            return
        self._exit_reason(exc)
        try:
            await self.close()
        except HedgerowError:
            pass  # the harness's own exception is the one to see
