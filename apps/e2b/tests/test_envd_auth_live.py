"""Who may reach envd: the signed access token, its key, its sandbox."""

from __future__ import annotations

import json
import struct
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


def _frames(raw: bytes) -> list[tuple[int, dict[str, object]]]:
    """A Connect stream's envelopes: (flags, message)."""
    out = []
    while raw:
        flags, length = struct.unpack(">BI", raw[:5])
        out.append((flags, json.loads(raw[5 : 5 + length])))
        raw = raw[5 + length :]
    return out


def test_a_read_only_key_reads_but_cannot_run_or_write(live, make_tenant):
    """Issue 19: "a key without write scope cannot create or run". A read-only key of the
    owning team can look (get answers it an envd token; list, stat, read work with it)
    but every call that runs or writes is refused with permission_denied, nothing ran and
    nothing was written, on the SDK's own calls and on envd straight."""
    from e2b import SandboxException

    from apps.tenancy.services import api_key_create

    tenant, secret = make_tenant()
    reader = api_key_create(tenant=tenant, name="reader", scopes=["read"]).secret
    sbx = Sandbox.create(**opts(live, secret))
    sbx.files.write("/workspace/seen.txt", "seen")
    with pytest.raises(SandboxException) as refused:
        Sandbox.connect(sbx.sandbox_id, **opts(live, reader))  # connect is a write
    assert refused.value.status_code == 403

    api = httpx.Client(base_url=live.url + "/e2b", timeout=30, trust_env=False)
    detail = api.get(f"/sandboxes/{sbx.sandbox_id}", headers={"X-API-KEY": reader})
    assert detail.status_code == 200, detail.text
    headers = {
        "X-Access-Token": detail.json()["envdAccessToken"],
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "Connect-Protocol-Version": "1",
    }
    envd = httpx.Client(base_url=live.url + "/e2b/envd", timeout=30, trust_env=False)
    listed = envd.post(
        "/filesystem.Filesystem/ListDir", json={"path": "/workspace"}, headers=headers
    )
    assert listed.status_code == 200, listed.text
    assert "seen.txt" in {e["name"] for e in listed.json()["entries"]}
    read = envd.get("/files", params={"path": "/workspace/seen.txt"}, headers=headers)
    assert (read.status_code, read.content) == (200, b"seen")

    made = envd.post(
        "/filesystem.Filesystem/MakeDir", json={"path": "/workspace/ro"}, headers=headers
    )
    assert made.status_code == 403 and made.json()["code"] == "permission_denied"
    upload = envd.post(
        "/files",
        params={"path": "/workspace/ro.txt"},
        content=b"no",
        headers={**headers, "Content-Type": "application/octet-stream"},
    )
    assert upload.status_code == 403, upload.text
    # a command start (the envd fast path's route too) ends its stream permission_denied
    message = json.dumps(
        {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "touch /workspace/ran"]}}
    ).encode()
    started = envd.post(
        "/process.Process/Start",
        content=struct.pack(">BI", 0, len(message)) + message,
        headers={**headers, "Content-Type": "application/connect+json"},
    )
    frames = _frames(started.content)
    assert frames and frames[-1][0] & 0x02, started.content
    assert frames[-1][1]["error"]["code"] == "permission_denied"  # type: ignore[index]
    assert all("start" not in str(m) for _, m in frames[:-1])

    # nothing of it happened: no operation, no directory, no file
    assert not Operation.objects.filter(sandbox__external_id=sbx.sandbox_id).exists()
    assert sbx.files.exists("/workspace/ro") is False
    assert sbx.files.exists("/workspace/ro.txt") is False
    assert sbx.files.exists("/workspace/ran") is False
    sbx.kill()
    wait_all_deleted(tenant)
