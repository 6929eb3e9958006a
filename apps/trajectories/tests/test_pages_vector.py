"""Issue 22, done-when: the episode page shows a verifier step's per-test result vector
(and says why there is none when the report was missing)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db

JUNIT = (
    '<testsuites><testsuite name="s" tests="3">'
    '<testcase classname="tests.test_a" name="test_ok"/>'
    '<testcase classname="tests.test_a" name="test_bad"><failure message="no"/></testcase>'
    '<testcase classname="tests.test_a" name="test_later"><skipped/></testcase>'
    "</testsuite></testsuites>"
)


def _episode_with_verifier(client, task_id, report):
    ep = client.post("/api/v1/episodes", {"task_id": task_id}, format="json").json()["id"]
    declared = {"kind": "pytest", "report_path": "/tmp/r.xml", "report": report}
    added = client.post(
        f"/api/v1/episodes/{ep}/steps",
        {"steps": [{"kind": "verifier", "action": "pytest", "verifier": declared}]},
        format="json",
    )
    assert added.status_code == 201, added.content
    closed = client.post(f"/api/v1/episodes/{ep}/close", {}, format="json")
    assert closed.status_code == 200, closed.content
    return ep


def test_the_episode_page_shows_the_per_test_vector(make_tenant, api_client, make_user, client):
    tenant, secret = make_tenant()
    other_tenant, _ = make_tenant()
    api = api_client(secret)
    reported = _episode_with_verifier(api, "vec", JUNIT)
    missing = _episode_with_verifier(api, "vec", "")
    client.force_login(make_user("vera", (tenant, "owner")))
    page = client.get(f"/trajectories/{reported}/").content.decode()
    assert 'class="verifier-results" data-step="0"' in page
    assert "1 passed · 1 failed · 0 error · 1 skipped" in page
    for result in ("passed", "failed", "skipped"):
        assert f'<tr data-result="{result}">' in page
    text = page.replace("<wbr>", "")  # test ids may wrap after their separators
    for test_id in ("tests.test_a::test_ok", "tests.test_a::test_bad", "tests.test_a::test_later"):
        assert f"<td>{test_id}</td>" in text
    empty = client.get(f"/trajectories/{missing}/").content.decode()
    assert "No per-test results: the verifier wrote no report." in empty
    assert '<table class="test-vector">' not in empty
    # another team's member sees none of it
    client.force_login(make_user("otto", (other_tenant, "owner")))
    assert client.get(f"/trajectories/{reported}/").status_code == 404
