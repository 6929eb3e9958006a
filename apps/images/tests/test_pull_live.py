"""A pull through the real stack: the API records it, the Celery worker pulls with the
team's stored login, the row carries progress and ends ``ready`` with the digest;
?wait=true blocks until then; DELETE forgets it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from apps.images.tests.conftest import push_image
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, Registry
from apps.sandboxes.tests.live_api import api_client

pytestmark = pytest.mark.django_db(transaction=True)


def _until_done(http: httpx.Client, image_id: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        body: dict[str, Any] = http.get(f"/images/{image_id}").json()
        if body["status"] != "pulling" or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def test_a_private_image_is_pulled_by_the_worker_with_the_stored_login(
    live: Any, make_tenant: Any, registry: Registry, tmp_path: Path
) -> None:
    _, secret = make_tenant()
    http = api_client(live, secret)
    ref, digest = push_image(registry, tmp_path, f"live{time.time_ns()}/app")
    stored = http.post(
        "/registry-credentials",
        json={"registry": registry.host, "username": USER, "password": PASSWORD},
    )
    assert stored.status_code == 201, stored.text
    started = http.post("/images", json={"reference": ref})
    assert started.status_code == 202, started.text
    image = _until_done(http, started.json()["id"])
    assert image["status"] == "ready", image
    assert (image["digest"], image["layers"], image["error"], image["progress"]) == (
        digest,
        1,
        None,
        None,
    )
    assert image["size_bytes"] > 0 and image["private"] is True
    # ready: a new POST pulls again (a tag may move) and ?wait=true answers when done
    waited = http.post("/images", params={"wait": "true", "timeout": 120}, json={"reference": ref})
    assert waited.status_code == 200, waited.text
    assert waited.json()["status"] == "ready" and waited.json()["id"] == image["id"]
    assert http.delete(f"/images/{image['id']}").status_code == 204
    assert http.get(f"/images/{image['id']}").status_code == 404


def test_a_pull_whose_login_is_revoked_meanwhile_fails_typed(
    live: Any, make_tenant: Any, registry: Registry, tmp_path: Path
) -> None:
    _, secret = make_tenant()
    http = api_client(live, secret)
    ref, _ = push_image(registry, tmp_path, f"live{time.time_ns()}/revoked")
    cred = http.post(
        "/registry-credentials",
        json={"registry": registry.host, "username": USER, "password": PASSWORD},
    ).json()
    first = _until_done(http, http.post("/images", json={"reference": ref}).json()["id"])
    assert first["status"] == "ready", first
    # the login is replaced by a wrong one: the next create proves access again
    http.post(
        "/registry-credentials",
        json={"registry": registry.host, "username": USER, "password": "wrong"},
    )
    refused = http.post("/sandboxes", json={"image": ref})
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["code"] == "registry_unauthorized"
    assert http.delete(f"/registry-credentials/{cred['id']}").status_code == 204


def test_concurrent_pull_requests_make_one_record_and_no_secret_reaches_a_log(
    live: Any, make_tenant: Any, registry: Registry, tmp_path: Path
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    _, secret = make_tenant()
    http = api_client(live, secret)
    ref, digest = push_image(registry, tmp_path, f"live{time.time_ns()}/busy")
    http.post(
        "/registry-credentials",
        json={"registry": registry.host, "username": USER, "password": PASSWORD},
    )

    def post(_: int) -> tuple[int, str]:
        with api_client(live, secret) as own:
            response = own.post("/images", json={"reference": ref})
            return response.status_code, str(response.json().get("id"))

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, range(8)))
    assert {code for code, _ in answers} <= {200, 202}, answers
    ids = {image_id for _, image_id in answers}
    assert len(ids) == 1, answers
    assert len(http.get("/images").json()["results"]) == 1
    done = _until_done(http, ids.pop())
    assert (done["status"], done["digest"]) == ("ready", digest), done
    for proc in (live.web, live.worker):
        assert PASSWORD not in proc.log_path.read_text(errors="replace"), proc.name
