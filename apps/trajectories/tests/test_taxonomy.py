"""Issue 22, "Also": the termination taxonomy of docs/trajectories.md ("Termination
reasons"), row by row. Each reason, closed without a verifier verdict or reward, gets
the documented class and validity, and η counts them as the table says. The table and
the reasons the API accepts are the same set, so a new reason cannot go undocumented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from apps.trajectories.models import TERMINATION_REASONS

pytestmark = pytest.mark.django_db

DOC = Path(__file__).resolve().parents[3] / "docs" / "trajectories.md"

# termination_reason -> (class without a verdict, valid), as the table states
TABLE = {
    "submitted": ("undetermined", False),
    "agent_gave_up": ("task", True),
    "step_budget": ("task", True),
    "token_budget": ("task", True),
    "wall_clock": ("task", True),
    "harness_crash": ("undetermined", False),
    "sandbox_lost": ("undetermined", False),  # the ledger shows no loss: claim ignored
    "inference_error": ("inference", True),
    "verifier_error": ("verifier", False),
    "cancelled": ("undetermined", False),
}


def _documented_reasons() -> set[str]:
    text = DOC.read_text()
    start = text.index("| termination_reason | meaning |")
    rows = text[start:].split("\n\n", 1)[0].splitlines()[2:]
    return {name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}


def test_the_documented_table_names_every_accepted_reason():
    assert _documented_reasons() == set(TERMINATION_REASONS) == set(TABLE)


def test_each_reason_without_a_verdict_gets_the_documented_class_and_validity(
    make_tenant, api_client
):
    _, secret = make_tenant()
    client = api_client(secret)
    got = {}
    for reason in TERMINATION_REASONS:
        opened = client.post("/api/v1/episodes", {"task_id": "taxonomy"}, format="json")
        assert opened.status_code == 201, opened.content
        closed = client.post(
            f"/api/v1/episodes/{opened.json()['id']}/close",
            {"termination_reason": reason},
            format="json",
        )
        assert closed.status_code == 200, closed.content
        got[reason] = (closed.json()["failure_class"], closed.json()["valid"])
    assert got == TABLE
    stats = client.get("/api/v1/episodes/stats", {"task": "taxonomy"}).json()
    valid = sum(ok for _, ok in TABLE.values())
    assert (stats["episodes"], stats["valid"]) == (len(TABLE), valid)
    assert stats["eta"] == pytest.approx(valid / len(TABLE))
    # a verdict decides before the reason does: a budget-exhausted episode whose
    # verifier passed is a success, one whose verifier broke is verifier
    for outcome, cls in (("pass", "success"), ("error", "verifier")):
        opened = client.post("/api/v1/episodes", {"task_id": "taxonomy-v"}, format="json")
        closed = client.post(
            f"/api/v1/episodes/{opened.json()['id']}/close",
            {"termination_reason": "step_budget", "verifier_outcome": outcome},
            format="json",
        )
        assert closed.json()["failure_class"] == cls, closed.content
