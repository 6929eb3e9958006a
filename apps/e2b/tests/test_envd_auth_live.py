"""Who may reach envd: the signed access token, its key, its sandbox."""

from __future__ import annotations

import time

import httpx
import pytest
from django.db import transaction
from e2b import AuthenticationException, Sandbox, SandboxNotRunningException

from apps.e2b.tests.live import opts, wait_all_deleted
from apps.sandboxes.models import Operation
from apps.sandboxes.models import Sandbox as Row
from apps.sandboxes.services.lifecycle import sandbox_delete
from apps.tenancy.auth import KEY_CACHE_TTL_S
from apps.tenancy.models import ApiKey
from apps.tenancy.services import api_key_revoke

pytestmark = pytest.mark.timeout(240)


def test_it_reports_health_and_a_killed_sandbox_as_not_running(live, make_tenant):
    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    assert sbx.is_running() is True
    sbx.kill()
    assert sbx.is_running() is False
    with pytest.raises(SandboxNotRunningException):
        sbx.commands.run("echo never")
    with pytest.raises(SandboxNotRunningException):
        sbx.files.list("/workspace")
    assert not Operation.objects.filter(sandbox__external_id=sbx.sandbox_id).exists()
    wait_all_deleted(tenant)


def test_it_stops_honouring_a_token_whose_key_was_revoked(live, make_tenant):
    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    assert sbx.commands.run("echo ok").stdout == "ok\n"
    sbx.files.write("/workspace/x", "x")
    api_key_revoke(key=ApiKey.objects.get(tenant=tenant))
    # the web process drops its cached key within KEY_CACHE_TTL_S (as for any key)
    deadline = time.monotonic() + KEY_CACHE_TTL_S + 10
    while True:
        try:
            sbx.files.read("/workspace/x")
        except AuthenticationException:
            break
        assert time.monotonic() < deadline, "the revoked key's token still works"
        time.sleep(0.2)
    with pytest.raises(AuthenticationException):
        sbx.commands.run("echo no")
    assert Operation.objects.filter(sandbox__external_id=sbx.sandbox_id).count() == 1
    with transaction.atomic():  # the key cannot kill it any more
        sandbox_delete(sandbox=Row.objects.get(external_id=sbx.sandbox_id), actor="test")
    wait_all_deleted(tenant)


def test_it_refuses_a_token_for_another_sandbox_and_forged_tokens(live, make_tenant):
    owner, secret = make_tenant()
    stranger_tenant, stranger = make_tenant()
    mine = Sandbox.create(**opts(live, secret))
    theirs = Sandbox.create(**opts(live, stranger))
    token = mine._envd_access_token
    assert token is not None
    envd = httpx.Client(base_url=live.url + "/e2b/envd", timeout=30, trust_env=False)
    body = {"path": "/workspace"}
    # my token, naming their sandbox: gone, as E2B's proxy answers an unknown sandbox
    response = envd.post(
        "/filesystem.Filesystem/ListDir",
        json=body,
        headers={
            "X-Access-Token": token,
            "E2b-Sandbox-Id": theirs.sandbox_id,
        },
    )
    assert response.status_code == 503 and "was not found" in response.json()["message"]
    for bad in ("", "forged", token + "x"):
        response = envd.post(
            "/filesystem.Filesystem/ListDir",
            json=body,
            headers={"X-Access-Token": bad, "E2b-Sandbox-Id": mine.sandbox_id},
        )
        assert response.status_code == 401, response.text
        assert response.json()["code"] == "unauthenticated"
    assert not Operation.objects.filter(sandbox__external_id=theirs.sandbox_id).exists()
    mine.kill()
    theirs.kill()
    wait_all_deleted(owner)
    wait_all_deleted(stranger_tenant)
