"""Failure attribution: the documented decision procedure (docs/trajectories.md).

Infra classes (startup, environment, observation) are decided only from the control
plane's own records for the episode's sandboxes and generations — the lifecycle
ledger (SandboxEvent) and Operation rows — never from what the client says. The
client's word decides only what the control plane cannot see: inference failures,
the verifier's verdict and the reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Q
from django.utils import timezone

from apps.sandboxes.models import Operation, OperationStatus, SandboxEvent, State
from apps.trajectories.models import (
    Episode,
    EpisodeSandbox,
    FailureClass,
    StepKind,
    VerifierOutcome,
)

# The watcher polls; a loss it notices shortly after the harness gave up still
# happened during the episode.
DETECTION_GRACE = timedelta(seconds=60)
REAPER_REASONS = frozenset({"ttl_expired", "heartbeat_expired", "pending_timeout"})
POLICY_ENDINGS = frozenset({"step_budget", "wall_clock", "token_budget", "agent_gave_up"})
VERIFIER_BROKEN = frozenset({VerifierOutcome.ERROR, VerifierOutcome.TIMEOUT})


@dataclass
class Verdict:
    failure_class: str
    rule: str
    evidence: list[dict[str, Any]] = field(default_factory=list)

    def as_evidence(self) -> list[dict[str, Any]]:
        decided = {"class": self.failure_class, "rule": self.rule, "decisive": True}
        return [decided, *self.evidence]


def _fact(cls: str, source: str, detail: str, **extra: Any) -> dict[str, Any]:
    return {"class": cls, "source": source, "detail": detail, **extra}


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _gen_filter(link: EpisodeSandbox) -> Q:
    return Q() if link.generation is None else Q(generation=link.generation)


def _startup_facts(link: EpisodeSandbox) -> list[dict[str, Any]]:
    sandbox = link.sandbox
    assert sandbox is not None
    events = SandboxEvent.objects.filter(sandbox=sandbox, event="transition").filter(
        _gen_filter(link)
    )
    same_generation = link.generation in (None, sandbox.generation)
    if events.filter(to_state=State.READY).exists() or (same_generation and sandbox.ready_at):
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
            f"sandbox never became ready (it is {sandbox.state})",
            reason=f"never_ready:{sandbox.state}",
            **base,
        )
    ]


def _environment_facts(
    link: EpisodeSandbox, start: datetime, end: datetime
) -> list[dict[str, Any]]:
    sandbox = link.sandbox
    assert sandbox is not None
    base = {"sandbox_id": sandbox.external_id}
    facts: list[dict[str, Any]] = []
    transitions = SandboxEvent.objects.filter(
        sandbox=sandbox, event="transition", at__gte=start, at__lte=end + DETECTION_GRACE
    ).filter(_gen_filter(link))
    for event in transitions:
        lost = event.to_state == State.LOST
        reaped = event.to_state == State.TERMINATING and event.reason in REAPER_REASONS
        # A reaper ending the sandbox after the episode ended is routine cleanup.
        if lost or (reaped and event.at <= end):
            facts.append(
                _fact(
                    FailureClass.ENVIRONMENT,
                    "ledger",
                    f"sandbox went {event.from_state} → {event.to_state} ({event.reason})"
                    + (f": {event.message}" if event.message else ""),
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
            created_at__lte=end,
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
    return facts


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


def _verifier_outcome(episode: Episode) -> tuple[str, list[dict[str, Any]]]:
    """The verifier's verdict: its own step's operation (control plane) beats the
    client's report when the command timed out or was killed."""
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
        if op.termination == "timeout":
            outcome = VerifierOutcome.TIMEOUT
        elif op.termination in ("signaled", "agent_error", "output_limit"):
            outcome = VerifierOutcome.ERROR
        elif not outcome and op.termination == "exited":
            outcome = VerifierOutcome.PASS if op.exit_code == 0 else VerifierOutcome.FAIL
        facts.append(
            _fact(
                FailureClass.VERIFIER if outcome in VERIFIER_BROKEN else "verdict",
                "operation",
                f"verifier step {step.index}: operation {op.operation_id} ended "
                f"{op.termination} (exit {op.exit_code})",
                step=step.index,
                operation_id=op.operation_id,
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
    return outcome, facts


def episode_attribution(*, episode: Episode, now: datetime | None = None) -> Verdict:
    """Applies the decision procedure to a closed episode. Pure read: the caller stores
    the verdict. First matching rule wins, in this order: startup, environment,
    observation (failed episodes only), inference, verifier, then the verdict."""
    now = now or timezone.now()
    start, end = episode.started_at, episode.ended_at or now
    links = [link for link in episode.sandbox_links.select_related("sandbox") if link.sandbox]
    notes: list[dict[str, Any]] = []
    if episode.termination_reason == "sandbox_lost":
        notes.append(_fact("note", "client", "client reported sandbox_lost"))

    startup = [fact for link in links for fact in _startup_facts(link)]
    if startup:
        return Verdict(FailureClass.STARTUP, "sandbox_never_ready", startup + notes)
    environment = [fact for link in links for fact in _environment_facts(link, start, end)]
    if environment:
        return Verdict(FailureClass.ENVIRONMENT, "infra_fault_during_episode", environment)
    if episode.termination_reason == "sandbox_lost":
        notes.append(_fact("note", "ledger", "the ledger shows no loss: the claim is ignored"))

    outcome, verifier_facts = _verifier_outcome(episode)
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
