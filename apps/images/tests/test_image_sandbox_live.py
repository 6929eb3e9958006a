"""An OCI image sandbox through the real stack (web + Celery worker + local backend +
the registry fixture): REST create answers with the digest it resolved, the sandbox
shows the pull's progress while provisioning, runs the image, and keeps the digest."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from apps.images.tests.conftest import push_image
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, Registry
from apps.sandboxes.models import Sandbox
from apps.sandboxes.tests.live_api import api_client

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]
PHASES = {"queued", "resolved", "fetching", "fetched", "unpacking", "unpacked", "done"}


def _until(check: Any, what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_rest_create_of_an_oci_image_runs_it_with_its_digest_and_shows_progress(
    live: Any, make_tenant: Any, registry: Registry, tmp_path: Path
) -> None:
    _, secret = make_tenant()
    http = api_client(live, secret)
    ref, digest = push_image(registry, tmp_path, f"live{time.time_ns()}/run")
    login = {"registry": registry.host, "username": USER, "password": PASSWORD}
    assert http.post("/registry-credentials", json=login).status_code == 201
    # the worker holds the sandbox in `provisioning` 3 s after the backend's provision,
    # so the API's progress can be seen deterministically (a pull on loopback is quick)
    live.restart_worker({"HEDGEROW_FAULTS": "provision.after_backend=sleep:3"})
    try:
        created = http.post("/sandboxes", json={"image": ref})
        assert created.status_code == 201, created.text
        body = created.json()
        sid = body["id"]
        # synchronously resolved with the team's login: the digest is in the answer
        assert (body["image"], body["image_digest"]) == (ref, digest)

        def provisioning_progress() -> dict[str, Any] | None:
            shown: dict[str, Any] = http.get(f"/sandboxes/{sid}").json()
            assert shown["state"] in ("requested", "provisioning"), shown
            return shown["progress"] if shown["state"] == "provisioning" else None

        progress = _until(provisioning_progress, "progress while provisioning")
        assert set(progress) == {"phase", "layers", "bytes", "total"}
        assert progress["phase"] in PHASES, progress
        waited = http.get(f"/sandboxes/{sid}/wait", params={"timeout": 60})
        assert waited.status_code == 200, waited.text
    finally:
        live.restart_worker({})
    shown = http.get(f"/sandboxes/{sid}").json()
    assert (shown["state"], shown["image_digest"], shown["progress"]) == ("ready", digest, None)
    # it runs the image: busybox is its /bin/sh, and its root is writable
    ran = http.post(
        f"/sandboxes/{sid}/exec",
        json={"command": "readlink /bin/sh; echo hi > /etc/new && cat /etc/new"},
    )
    assert ran.status_code == 200, ran.text
    assert (ran.json()["status"], ran.json()["stdout"]) == ("completed", "busybox\nhi\n")
    assert Sandbox.objects.get(external_id=sid).image_digest == digest
    assert http.delete(f"/sandboxes/{sid}").status_code in (202, 204)


def test_an_image_that_cannot_be_had_is_a_typed_4xx_on_rest_and_orchard_live(
    live: Any, make_tenant: Any, open_registry: Registry
) -> None:
    tenant, secret = make_tenant()
    missing = f"{open_registry.host}/live{time.time_ns()}/nothing:v1"
    rest = api_client(live, secret).post("/sandboxes", json={"image": missing})
    assert rest.status_code == 422, rest.text
    error = rest.json()["error"]
    assert (error["code"], error["field"], error["reference"]) == (
        "image_not_found",
        "image",
        missing,
    )
    orchard = httpx.post(
        f"{live.url}/orchard/sandboxes",
        json={"image": missing},
        headers={"X-API-Key": secret},
        timeout=60,
        trust_env=False,
    )
    assert orchard.status_code == 422, orchard.text
    assert orchard.json()["code"] == "image_not_found" and missing in orchard.text
    assert not Sandbox.objects.filter(tenant=tenant).exists()
