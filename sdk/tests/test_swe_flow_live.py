"""The user's flow of issue 15, end to end through the SDK and the real stack: a
SWE-style task image (Debian userland with python3, pytest and git, and a repository at
/testbed whose test fails) from a private registry; an episode in a sandbox of that
image; the "policy" applies a patch; the verifier runs pytest in /testbed. The right
patch ends ``success``, a wrong one ``task``, and both episodes record the image digest
(in the API and the JSONL export)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hedgerow import Client

from apps.sandboxes.backends.local.images.tests.fixtures import SweImage
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, Registry
from apps.sandboxes.backends.local.images.tests.swe import PATCH, WRONG_PATCH
from apps.trajectories.models import Episode

pytestmark = pytest.mark.timeout(420)


def test_a_swe_task_image_episode_ends_success_or_task_with_its_digest(
    live: Any, make_tenant: Any, registry: Registry, swe_image: SweImage
) -> None:
    _, secret = make_tenant()
    rest = httpx.Client(
        base_url=live.url + "/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=60,
        trust_env=False,
    )
    login = {"registry": registry.host, "username": USER, "password": PASSWORD}
    assert rest.post("/registry-credentials", json=login).status_code == 201

    outcomes: dict[str, tuple[str, str, int]] = {}
    with Client(url=live.url, api_key=secret, max_retries=1, timeout=120) as hr:
        for name, patch in (("right", PATCH), ("wrong", WRONG_PATCH)):
            with hr.create_sandbox(image=swe_image.reference, wait_timeout=300) as sb:
                assert sb.data["image_digest"] == swe_image.digest
                with sb.episode(task_id="swe-calc", harness="test", model=name) as ep:
                    # the policy: reads the task, writes and applies its patch
                    before = sb.exec("python3 -m pytest -q -p no:cacheprovider", timeout=120)
                    assert before.exit_code == 1 and "1 failed" in before.stdout
                    sb.write_file("/tmp/answer.patch", patch)
                    applied = sb.exec("git apply /tmp/answer.patch && git diff --stat")
                    assert applied.exit_code == 0 and "calc.py" in applied.stdout
                    verdict = ep.verify(
                        ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                        kind="pytest",
                        timeout=120,
                    )
                outcomes[name] = (ep.id, ep.failure_class, verdict.exit_code)
    verdicts = {k: v[1:] for k, v in outcomes.items()}
    assert verdicts == {"right": ("success", 0), "wrong": ("task", 1)}
    ids = {v[0] for v in outcomes.values()}
    for episode_id in ids:
        assert Episode.objects.get(episode_id=episode_id).image_digest == swe_image.digest
        shown = rest.get(f"/episodes/{episode_id}").json()
        assert shown["image_digest"] == swe_image.digest
    exported = [json.loads(line) for line in rest.get("/episodes/export").text.splitlines()]
    assert {
        r["episode_id"]: r["image_digest"] for r in exported if r["episode_id"] in ids
    } == dict.fromkeys(ids, swe_image.digest)
