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


def test_a_json_result_file_gives_the_same_vector(make_tenant, api_client):
    from apps.trajectories.models import Step

    _, secret = make_tenant()
    api = api_client(secret)
    pytest_json = (
        '{"tests": [{"nodeid": "tests/test_a.py::test_ok", "outcome": "passed"},'
        ' {"nodeid": "tests/test_a.py::test_bad", "outcome": "failed"},'
        ' {"nodeid": "tests/test_a.py::test_x", "outcome": "xfailed"}]}'
    )
    plain = '{"results": {"pkg.TestA.test_ok": "passed", "pkg.TestA.test_err": "error"}}'
    runs = {
        "pytest-json": _episode_with_verifier(api, "vec-json", pytest_json),
        "plain": _episode_with_verifier(api, "vec-json", plain),
        "bad": _episode_with_verifier(
            api, "vec-json", '{"tests": [{"nodeid": "t", "outcome": "ok"}]}'
        ),
    }
    steps = {name: Step.objects.get(episode__episode_id=ep).verifier for name, ep in runs.items()}
    assert steps["pytest-json"]["results"] == {
        "tests/test_a.py::test_ok": "passed",
        "tests/test_a.py::test_bad": "failed",
        "tests/test_a.py::test_x": "skipped",
    }
    assert steps["pytest-json"]["report"]["format"] == "json"
    assert steps["plain"]["summary"] == {"passed": 1, "failed": 0, "error": 1, "skipped": 0}
    assert "results" not in steps["bad"] and steps["bad"]["report"]["format"] == "json"
    assert "outcome 'ok'" in steps["bad"]["report"]["error"]
