"""Failure attribution: the documented decision procedure (docs/trajectories.md).

Infra classes (startup, environment, observation) are decided only from the control
plane's own records for the episode's sandboxes and generations — the lifecycle
ledger (SandboxEvent) and Operation rows — never from what the client says. The
client's word decides only what the control plane cannot see: inference failures,
the verifier's verdict and the reward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Max, Min, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from apps.sandboxes.models import Operation, OperationStatus, SandboxEvent, State
from apps.trajectories.models import (
    Episode,
    EpisodeSandbox,
    FailureClass,
    StepKind,
    VerifierKind,
    VerifierOutcome,
)

# The watcher polls; a loss it notices shortly after the harness gave up still
# happened during the episode.
DETECTION_GRACE = timedelta(seconds=60)
POLICY_ENDINGS = frozenset({"step_budget", "wall_clock", "token_budget", "agent_gave_up"})
VERIFIER_BROKEN = frozenset({VerifierOutcome.ERROR, VerifierOutcome.TIMEOUT})

# What apps above trajectories know about an episode's task (import-linter keeps this
# app below them): a check returns facts saying the task's verifier cannot be trusted
# (e.g. apps.datasets: it failed the task's reference solution), or nothing. Any fact
# makes the episode ``verifier``: its verdict does not judge the policy.
TaskVerifierCheck = Callable[[Episode], list[dict[str, Any]]]
_task_verifier_checks: dict[str, TaskVerifierCheck] = {}


def register_task_verifier_check(name: str, check: TaskVerifierCheck) -> None:
    """Registers (or replaces) the check called ``name`` (e.g. in AppConfig.ready())."""
    _task_verifier_checks[name] = check


def _task_verifier_facts(episode: Episode) -> list[dict[str, Any]]:
    return [fact for check in _task_verifier_checks.values() for fact in check(episode)]


@dataclass
class Verdict:
    failure_class: str
    rule: str
    evidence: list[dict[str, Any]] = field(default_factory=list)
    verdict_class: str | None = None  # what a suspect verifier's verdict alone gave

    def as_evidence(self) -> list[dict[str, Any]]:
        decided: dict[str, Any] = {"class": self.failure_class, "rule": self.rule, "decisive": True}
        if self.verdict_class:
            decided["verdict_class"] = self.verdict_class
        return [decided, *self.evidence]


def _fact(cls: str, source: str, detail: str, **extra: Any) -> dict[str, Any]:
    return {"class": cls, "source": source, "detail": detail, **extra}


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _gen_filter(link: EpisodeSandbox) -> Q:
    return Q() if link.generation is None else Q(generation=link.generation)


def _startup_facts(link: EpisodeSandbox, end: datetime) -> list[dict[str, Any]]:
    """A linked generation that was not ready by the episode's end. A ``ready`` after
    the end (the sandbox came up late) does not undo the startup failure the episode
    saw."""
    sandbox = link.sandbox
    assert sandbox is not None
    events = SandboxEvent.objects.filter(sandbox=sandbox, event="transition").filter(
        _gen_filter(link)
    )
    same_generation = link.generation in (None, sandbox.generation)
    if events.filter(to_state=State.READY, at__lte=end).exists() or (
        same_generation and sandbox.ready_at and sandbox.ready_at <= end
    ):
        return []
    failed = events.filter(to_state=State.FAILED).first()
    base = {"sandbox_id": sandbox.external_id, "generation": link.generation}
    if failed is not None:
        return [
            _fact(
                FailureClass.STARTUP,
                "ledger",
                f"sandbox went {failed.from_state} → failed ({failed.reason}): {failed.message}",
                at=_iso(failed.at),
                reason=failed.reason,
                **base,
            )
        ]
    return [
        _fact(
            FailureClass.STARTUP,
            "ledger",
            f"sandbox was not ready by the episode's end (it is {sandbox.state})",
            reason=f"never_ready:{sandbox.state}",
            **base,
        )
    ]


def _environment_facts(
    link: EpisodeSandbox, start: datetime, end: datetime, verdict_at: datetime | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(facts, notes). Inside the window, a linked generation going ``lost`` or
    ``terminating`` (a reaper, or a delete by anyone: the sandbox went away under the
    episode) is an infra fault; a ``lost`` noticed within the detection grace after the
    end counts too (the watcher polls). Nothing after ``verdict_at`` counts: a verdict
    reached while every linked generation was healthy stands (item 3)."""
    sandbox = link.sandbox
    assert sandbox is not None
    base = {"sandbox_id": sandbox.external_id}
    facts: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    transitions = SandboxEvent.objects.filter(
        sandbox=sandbox, event="transition", at__gte=start, at__lte=end + DETECTION_GRACE
    ).filter(_gen_filter(link))
    for event in transitions:
        lost = event.to_state == State.LOST
        ended = event.to_state == State.TERMINATING and event.at <= end
        if not (lost or ended):
            continue  # e.g. a delete after the episode ended: routine cleanup
        detail = f"sandbox went {event.from_state} → {event.to_state} ({event.reason})" + (
            f" by {event.actor}" if event.actor and not lost else ""
        )
        detail += f": {event.message}" if event.message else ""
        if verdict_at is not None and event.at > verdict_at:
            notes.append(
                _fact(
                    "note",
                    "ledger",
                    f"{detail} after the verdict ({_iso(verdict_at)}), which stands",
                    at=_iso(event.at),
                    **base,
                )
            )
            continue
        facts.append(
            _fact(
                FailureClass.ENVIRONMENT,
                "ledger",
                detail,
                at=_iso(event.at),
                reason=event.reason,
                generation=event.generation,
                **base,
            )
        )
    # A command its sandbox's own limits ended (resource_exhausted: the OOM killer, the
    # pids limit) is the policy's doing, not an infra fault: it must not make the
    # episode invalid (a policy could otherwise turn its failing episode into
    # "environment" by exhausting its sandbox). The verdict decides such episodes.
    failed_ops = (
        Operation.objects.filter(
            sandbox=sandbox,
            status=OperationStatus.FAILED,
            created_at__gte=start,
            created_at__lte=verdict_at or end,
        )
        .filter(_gen_filter(link))
        .exclude(error__code="resource_exhausted")
    )
    for op in failed_ops:
        code = (op.error or {}).get("code", "agent_error")
        facts.append(
            _fact(
                FailureClass.ENVIRONMENT,
                "operation",
                f"operation {op.operation_id} failed: {code}",
                at=_iso(op.created_at),
                reason=code,
                operation_id=op.operation_id,
                generation=op.generation,
                **base,
            )
        )
    return facts, notes


def _truncation_facts(episode: Episode) -> list[dict[str, Any]]:
    facts: list[dict[str, Any]] = []
    steps = episode.steps.exclude(kind=StepKind.VERIFIER).filter(operation_record__isnull=False)
    for step in steps.select_related("operation_record", "operation_record__sandbox"):
        op = step.operation_record
        assert op is not None
        streams = [
            name for name in ("stdout", "stderr") if (getattr(op, name) or {}).get("truncated")
        ]
        if op.termination == "output_limit":
            streams.append("output_limit")
        if streams:
            facts.append(
                _fact(
                    FailureClass.OBSERVATION,
                    "operation",
                    f"step {step.index}: operation {op.operation_id} output cut "
                    f"({', '.join(streams)}) before the model saw it",
                    step=step.index,
                    operation_id=op.operation_id,
                    sandbox_id=op.sandbox.external_id,
                    generation=op.generation,
                )
            )
    return facts


# Exit codes that say the verifier itself did not run, for any kind: the shell's
# "found but not executable" and "not found".
NOT_RUNNABLE = {126: "not executable", 127: "not found"}
# Exit codes that are the test framework's own error, per declared kind. pytest's 2
# (interrupted, e.g. a collection error from a SyntaxError in the policy's code) and 1
# (tests failed) are the policy's; 3 (internal error), 4 (usage error, a conftest that
# does not import) and 5 (no tests collected) mean no test judged the policy.
FRAMEWORK_ERRORS: dict[str, dict[int, str]] = {
    VerifierKind.PYTEST: {3: "internal error", 4: "usage error", 5: "no tests collected"},
    VerifierKind.UNITTEST: {5: "no tests ran"},
    VerifierKind.GO: {2: "usage error"},
}


def verifier_kind(declared: dict[str, Any] | None, command: Any) -> str:
    """The declared kind, else one inferred from a command that plainly runs pytest."""
    kind = (declared or {}).get("kind")
    if isinstance(kind, str) and kind in VerifierKind.values:
        return kind
    text = command if isinstance(command, str) else " ".join(map(str, command or []))
    words = text.split()
    if words and (words[0].endswith("pytest") or ("pytest" in words[1:3] and "-m" in words[:2])):
        return VerifierKind.PYTEST
    return VerifierKind.CUSTOM


def verifier_exit_outcome(kind: str, exit_code: int | None) -> tuple[str, str]:
    """(outcome, why) of a verifier that exited: the one mapping the SDK and the
    control plane share."""
    if exit_code == 0:
        return VerifierOutcome.PASS, "exit 0"
    if exit_code in NOT_RUNNABLE:
        return VerifierOutcome.ERROR, f"exit {exit_code}: verifier {NOT_RUNNABLE[exit_code]}"
    framework = FRAMEWORK_ERRORS.get(kind, {})
    if exit_code in framework:
        return VerifierOutcome.ERROR, f"exit {exit_code}: {kind} {framework[exit_code]}"
    return VerifierOutcome.FAIL, f"exit {exit_code}"


def report_outcome(verifier: dict[str, Any]) -> tuple[str, str]:
    """The verdict of a declared report: a valid report with at least one executed test
    decides pass/fail (a test erroring because the code under test is broken is the
    policy's failure); no report, an invalid one, or zero executed tests: the verifier
    did not judge."""
    error = (verifier.get("report") or {}).get("error")
    if error:
        return VerifierOutcome.ERROR, f"no valid report: {error}"
    summary = verifier.get("summary") or {}
    executed = sum(int(summary.get(k) or 0) for k in ("passed", "failed", "error"))
    if not executed:
        return VerifierOutcome.ERROR, "the report has no executed test"
    bad = int(summary.get("failed") or 0) + int(summary.get("error") or 0)
    counts = ", ".join(f"{summary.get(k, 0)} {k}" for k in ("passed", "failed", "error", "skipped"))
    return (VerifierOutcome.FAIL if bad else VerifierOutcome.PASS), f"report: {counts}"


def _verifier_outcome(episode: Episode) -> tuple[str, list[dict[str, Any]]]:
    """The verifier's verdict. Its own step's operation (control plane) decides when
    the verifier did not run or broke (timeout, kill, not found / not executable); then
    a declared report decides (``report_outcome``); then the framework's own error
    codes; otherwise the client's reported pass/fail stands, else the exit code. A
    client's explicit ``verifier_error`` termination is a broken verifier."""
    facts: list[dict[str, Any]] = []
    outcome = episode.verifier_outcome
    step = (
        episode.steps.filter(kind=StepKind.VERIFIER, operation_record__isnull=False)
        .select_related("operation_record")
        .order_by("-index")
        .first()
    )
    if step is not None and step.operation_record is not None:
        op = step.operation_record
        kind = verifier_kind(step.verifier, step.action or (op.request or {}).get("command"))
        why = op.termination or op.status
        if op.termination == "timeout":
            outcome = VerifierOutcome.TIMEOUT
        elif op.termination != "exited":  # signaled, agent_error, output_limit, failed
            outcome = VerifierOutcome.ERROR
        elif op.exit_code in NOT_RUNNABLE:
            outcome, why = verifier_exit_outcome(kind, op.exit_code)
        elif (step.verifier or {}).get("report") is not None:
            outcome, why = report_outcome(step.verifier)
        else:
            exit_outcome, why = verifier_exit_outcome(kind, op.exit_code)
            if exit_outcome in VERIFIER_BROKEN or not outcome:
                outcome = exit_outcome
        facts.append(
            _fact(
                FailureClass.VERIFIER if outcome in VERIFIER_BROKEN else "verdict",
                "operation",
                f"verifier step {step.index} ({kind}): operation {op.operation_id} ended "
                f"{op.termination or op.status} (exit {op.exit_code}): {why}",
                step=step.index,
                operation_id=op.operation_id,
                verifier_kind=kind,
            )
        )
    elif outcome:
        facts.append(
            _fact(
                FailureClass.VERIFIER if outcome in VERIFIER_BROKEN else "verdict",
                "client",
                f"verifier {episode.verifier_name or '?'} reported {outcome}",
            )
        )
    if episode.termination_reason == "verifier_error" and outcome not in VERIFIER_BROKEN:
        outcome = VerifierOutcome.ERROR
        facts.append(
            _fact(FailureClass.VERIFIER, "client", "client reported termination verifier_error")
        )
    return outcome, facts


def episode_window(episode: Episode, now: datetime | None = None) -> tuple[datetime, datetime]:
    """The window the ledger is read in: the episode's [started_at, ended_at], widened to
    hold every operation its steps link (the control plane's order beats a client's
    clock: a step the episode ran is inside it, whatever its clock said)."""
    start, end = episode.started_at, episode.ended_at or now or timezone.now()
    linked = Operation.objects.filter(
        pk__in=episode.steps.filter(operation_record__isnull=False).values("operation_record")
    ).aggregate(first=Min("created_at"), last=Max(Coalesce("finished_at", "created_at")))
    if linked["first"] is not None:
        start = min(start, linked["first"])
        end = max(end, linked["last"])
    return start, end


def _verdict_at(episode: Episode, end: datetime, outcome: str) -> datetime | None:
    """When the verdict was reached, if there is one: the verifier's operation finishing
    (it ran to its end in a sandbox the control plane could reach), else the episode's
    end for a client-reported verdict or reward. None: no verdict."""
    step = (
        episode.steps.filter(kind=StepKind.VERIFIER, operation_record__isnull=False)
        .select_related("operation_record")
        .order_by("-index")
        .first()
    )
    op = step.operation_record if step is not None else None
    if op is not None and op.status == OperationStatus.COMPLETED and op.finished_at:
        return min(op.finished_at, end)
    if outcome in (VerifierOutcome.PASS, VerifierOutcome.FAIL) or episode.reward is not None:
        return end
    return None


# The verdicts a suspect verifier gave: its pass/fail, or the reward the harness took from it.
VERDICT_RULES = frozenset({"verifier_pass", "verifier_fail", "reward"})


def episode_attribution(*, episode: Episode, now: datetime | None = None) -> Verdict:
    """Applies the decision procedure to a closed episode. Pure read: the caller stores
    the verdict. First matching rule wins, in this order: startup, environment,
    observation (failed episodes only), inference, verifier, then the verdict. A verdict
    from the verifier of a task registered checks call suspect is ``verifier``; the
    decisive fact keeps what the verdict said (``verdict_class``), which is what a
    reference run taken from the episode records."""
    verdict = _procedure(episode, now)
    if verdict.rule not in VERDICT_RULES:
        return verdict
    suspect = _task_verifier_facts(episode)
    if not suspect:
        return verdict
    return Verdict(
        FailureClass.VERIFIER,
        "task_verifier_suspect",
        suspect + verdict.evidence,
        verdict_class=verdict.failure_class,
    )


def _procedure(episode: Episode, now: datetime | None) -> Verdict:
    start, end = episode_window(episode, now)
    links = [link for link in episode.sandbox_links.select_related("sandbox") if link.sandbox]
    notes: list[dict[str, Any]] = []
    if episode.termination_reason == "sandbox_lost":
        notes.append(_fact("note", "client", "client reported sandbox_lost"))

    startup = [fact for link in links for fact in _startup_facts(link, end)]
    if startup:
        return Verdict(FailureClass.STARTUP, "sandbox_never_ready", startup + notes)
    outcome, verifier_facts = _verifier_outcome(episode)
    verdict_at = _verdict_at(episode, end, outcome)
    environment: list[dict[str, Any]] = []
    for link in links:
        facts, later = _environment_facts(link, start, end, verdict_at)
        environment += facts
        notes += later
    if environment:
        return Verdict(FailureClass.ENVIRONMENT, "infra_fault_during_episode", environment)
    if episode.termination_reason == "sandbox_lost":
        notes.append(_fact("note", "ledger", "the ledger shows no loss: the claim is ignored"))

    succeeded = outcome == VerifierOutcome.PASS or (
        not outcome and episode.reward is not None and episode.reward > 0
    )
    if not succeeded:
        truncated = _truncation_facts(episode)
        if truncated:
            return Verdict(FailureClass.OBSERVATION, "observation_cut_and_failed", truncated)
    if episode.inference_error or episode.termination_reason == "inference_error":
        detail = episode.inference_error or {"message": "termination_reason inference_error"}
        fact = _fact(FailureClass.INFERENCE, "client", f"model endpoint failed: {detail}")
        return Verdict(FailureClass.INFERENCE, "client_reported_inference_error", [fact])
    if outcome in VERIFIER_BROKEN:
        return Verdict(FailureClass.VERIFIER, f"verifier_{outcome}", verifier_facts + notes)
    if outcome == VerifierOutcome.PASS:
        return Verdict(FailureClass.SUCCESS, "verifier_pass", verifier_facts + notes)
    if outcome == VerifierOutcome.FAIL:
        return Verdict(FailureClass.TASK, "verifier_fail", verifier_facts + notes)
    if episode.reward is not None:
        cls = FailureClass.SUCCESS if episode.reward > 0 else FailureClass.TASK
        fact = _fact(cls, "client", f"no verifier verdict; reward {episode.reward:g}")
        return Verdict(cls, "reward", [fact, *notes])
    if episode.termination_reason in POLICY_ENDINGS:
        fact = _fact(FailureClass.TASK, "client", f"ended by {episode.termination_reason}")
        return Verdict(FailureClass.TASK, "policy_ran_out", [fact, *notes])
    fact = _fact(
        FailureClass.UNDETERMINED,
        "client",
        f"no verifier verdict or reward (ended: {episode.termination_reason or 'unknown'})",
    )
    return Verdict(FailureClass.UNDETERMINED, "no_verdict", [fact, *notes])
