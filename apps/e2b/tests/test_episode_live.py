"""E2B traffic in Hedgerow's own records: an E2B command is an operation a harness can
find through REST and link as an episode step, like a REST exec (issue 19)."""

from __future__ import annotations

import pytest
from e2b import CommandExitException, Sandbox

from apps.e2b.tests.live import opts
from apps.sandboxes.tests.live_api import api_client, wait_all_deleted

pytestmark = pytest.mark.timeout(240)


def test_an_e2b_command_is_listed_and_linked_as_an_episode_step(live, make_tenant):
    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    with pytest.raises(CommandExitException):
        sbx.commands.run("echo tried; exit 3")
    http = api_client(live, secret)

    # the same id under /api/v1; the command is one of its operations, typed and ended
    listed = http.get(f"/sandboxes/{sbx.sandbox_id}/operations")
    assert listed.status_code == 200, listed.text
    [op] = listed.json()["results"]
    assert op["id"].startswith("e2b-")
    assert (op["termination"], op["exit_code"], op["generation"]) == ("exited", 3, 1)

    # a step naming it takes the operation row as its observation
    opened = http.post("/episodes", json={"task_id": "e2b-task", "sandbox_ids": [sbx.sandbox_id]})
    assert opened.status_code == 201, opened.text
    episode = opened.json()["id"]
    step = {
        "index": 0,
        "kind": "exec",
        "action": "echo tried; exit 3",
        "sandbox_id": sbx.sandbox_id,
        "operation_id": op["id"],
    }
    added = http.post(f"/episodes/{episode}/steps", json={"steps": [step]})
    assert added.status_code in (200, 201), added.text
    steps = http.get(f"/episodes/{episode}/steps")
    assert steps.status_code == 200, steps.text
    body = steps.json()
    [stored] = body["results"] if isinstance(body, dict) else body
    assert stored["observation"]["exit_code"] == 3
    assert stored["observation"]["termination"] == "exited"
    assert "tried" in str(stored["observation"]["stdout"])

    # another tenant neither sees its operations nor links them
    _, stranger = make_tenant()
    assert (
        api_client(live, stranger).get(f"/sandboxes/{sbx.sandbox_id}/operations").status_code == 404
    )
    sbx.kill()
    wait_all_deleted(tenant)
