"""Security review of the sandboxes API and its websockets: scopes, outsiders against
objects that exist, and the error envelope on every kind of 4xx (and on a 500)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.test import Client

from apps.core.asyncdb import db_async
from apps.sandboxes.models import Operation, OperationStatus, Sandbox, SandboxEvent, State
from apps.sandboxes.tests.factories import make_sandbox
from apps.sandboxes.tests.wscomm import WebsocketCommunicator
from controlplane.asgi import application

WRITES = [
    ("post", "/api/v1/sandboxes", {"image": "host"}),
    ("delete", "/api/v1/sandboxes/{id}", None),
    ("post", "/api/v1/sandboxes/{id}/heartbeat", None),
    ("post", "/api/v1/sandboxes/{id}/exec", {"command": "echo hi"}),
    ("post", "/api/v1/sandboxes/{id}/exec", {"command": "echo hi", "stream": True}),
    ("put", "/api/v1/sandboxes/{id}/files?path=/workspace/x", None),
    ("post", "/api/v1/sandboxes/{id}/files?path=/workspace/x", None),
    ("post", "/api/v1/audits", {}),
]


def _operation(sandbox: Sandbox, operation_id: str = "op-secret") -> Operation:
    return Operation.objects.create(
        tenant=sandbox.tenant,
        sandbox=sandbox,
        operation_id=operation_id,
        generation=sandbox.generation,
        request={"command": "cat /secret"},
        request_hash="x",
        status=OperationStatus.COMPLETED,
        termination="exited",
        exit_code=0,
        stdout={"text": "owner-only-output"},
    )


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert {"code", "message", "field"} <= set(error), error
    assert isinstance(error["code"], str) and error["code"]
    return error


@pytest.mark.django_db
@pytest.mark.parametrize(("method", "path", "body"), WRITES)
def test_it_refuses_every_write_to_a_read_only_key_and_changes_nothing(
    make_tenant, api_client, method, path, body
):
    tenant, secret = make_tenant(scopes=["read"])
    sandbox = make_sandbox(tenant)
    events = SandboxEvent.objects.count()
    response = getattr(api_client(secret), method)(
        path.format(id=sandbox.external_id), body, format="json"
    )
    assert _error(response, 403)["code"] == "permission_denied"
    sandbox.refresh_from_db()
    assert (sandbox.state, sandbox.last_heartbeat_at) == (State.READY, None)
    assert Sandbox.objects.count() == 1
    assert SandboxEvent.objects.count() == events
    assert not Operation.objects.exists()


@pytest.mark.django_db
def test_it_hides_an_existing_operation_from_another_tenant_even_under_the_same_sandbox_id(
    make_tenant, api_client
):
    owner, _ = make_tenant()
    outsider, outsider_secret = make_tenant()
    theirs = make_sandbox(owner, external_id="same-name")
    make_sandbox(outsider, external_id="same-name")
    _operation(theirs)
    client = api_client(outsider_secret)
    response = client.get("/api/v1/sandboxes/same-name/operations/op-secret")
    assert _error(response, 404)["code"] == "operation_not_found"
    listed = client.get("/api/v1/sandboxes/same-name/operations").json()
    assert listed["count"] == 0
    assert b"owner-only-output" not in client.get("/api/v1/sandboxes/same-name/events").content


@pytest.mark.django_db
def test_it_never_replays_another_tenants_operation_id(make_tenant, api_client):
    owner, _ = make_tenant()
    outsider, outsider_secret = make_tenant()
    theirs = make_sandbox(owner, external_id="same-name")
    mine = make_sandbox(outsider, external_id="same-name")
    _operation(theirs)
    response = api_client(outsider_secret).post(
        "/api/v1/sandboxes/same-name/exec",
        {"command": "echo hi", "operation_id": "op-secret"},
        format="json",
    )
    # The outsider's own sandbox has no agent (port 9): whatever the answer, it is a
    # new record in its own sandbox, never the owner's stored output.
    assert b"owner-only-output" not in response.content
    stored = Operation.objects.get(sandbox=theirs)
    assert stored.stdout == {"text": "owner-only-output"}
    assert not Operation.objects.filter(sandbox=mine).exclude(tenant=outsider).exists()


@pytest.mark.django_db
def test_it_answers_every_kind_of_client_error_in_the_one_envelope(make_tenant, client):
    tenant, secret = make_tenant()
    _, read_only = make_tenant(scopes=["read"])
    auth = {"HTTP_AUTHORIZATION": f"Bearer {secret}"}
    assert _error(client.get("/api/v1/sandboxes"), 401)["code"] == "not_authenticated"
    bad_key = client.get("/api/v1/sandboxes", HTTP_AUTHORIZATION="Bearer hr_nope")
    assert _error(bad_key, 401)["code"] == "invalid_api_key"
    refused = client.post(
        "/api/v1/sandboxes", {}, HTTP_AUTHORIZATION=f"Bearer {read_only}"
    )  # fmt: skip
    assert _error(refused, 403)["code"] == "permission_denied"
    assert _error(client.get("/api/v1/sandboxes/nope", **auth), 404)["code"] == (
        "sandbox_not_found"
    )
    assert _error(client.patch("/api/v1/sandboxes", **auth), 405)["code"] == "method_not_allowed"
    malformed = client.post(
        "/api/v1/sandboxes", "{", content_type="application/json", **auth
    )  # fmt: skip
    assert _error(malformed, 400)["code"] == "malformed_request"
    invalid = client.post(
        "/api/v1/sandboxes", {"image": 5}, content_type="application/json", **auth
    )  # fmt: skip
    assert _error(invalid, 400)["field"] == "image"
    for path in ("/api/v1/no-such-thing", "/api/v1/sandboxes/x/nope", "/api/v1/"):
        assert _error(client.get(path, **auth), 404)["code"] == "not_found", path
    assert not Sandbox.objects.filter(tenant=tenant).exists()


@pytest.mark.django_db
def test_it_answers_an_unexpected_failure_with_a_json_500_and_no_traceback(
    make_tenant, monkeypatch
):
    from apps.sandboxes import selectors

    def boom(**kwargs: Any) -> Any:
        raise RuntimeError("secret internals: /srv/hedgerow/db password=hunter2")

    monkeypatch.setattr(selectors, "sandbox_list", boom)
    _, secret = make_tenant()
    client = Client(raise_request_exception=False)
    response = client.get("/api/v1/sandboxes", HTTP_AUTHORIZATION=f"Bearer {secret}")
    error = _error(response, 500)
    assert error["code"] == "internal_error"
    assert b"hunter2" not in response.content
    assert b"Traceback" not in response.content
    assert response["X-Request-Id"] in error["message"]


# --- websockets ----------------------------------------------------------------------


def _key(secret: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {secret}".encode())]


async def _refused(path: str, headers: list[tuple[bytes, bytes]]) -> tuple[dict[str, Any], int]:
    comm = WebsocketCommunicator(application, path, headers=headers)
    connected, _ = await comm.connect()
    assert connected
    error = await comm.receive_json_from(timeout=5)
    closed = await comm.receive_output(timeout=5)
    assert closed["type"] == "websocket.close"
    return error, int(closed["code"])


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
async def test_it_refuses_an_outsider_every_socket_on_an_existing_sandbox(make_tenant):
    owner, _ = await db_async(make_tenant)()
    _, outsider = await db_async(make_tenant)()
    sandbox = await db_async(make_sandbox)(owner, external_id="sb-owned")
    await db_async(_operation)(sandbox)

    error, code = await _refused(
        "/ws/v1/sandboxes/sb-owned/operations/op-secret/stream", _key(outsider)
    )
    assert (error["code"], code) == ("not_found", 4404)
    error, code = await _refused("/ws/v1/sandboxes/sb-owned/pty", _key(outsider))
    assert (error["code"], code) == ("sandbox_not_found", 4404)
    error, code = await _refused("/orchard/sandboxes/sb-owned/exec/pty?api_key=" + outsider, [])
    assert code == 4404

    comm = WebsocketCommunicator(application, "/ws/realtime", headers=_key(outsider))
    assert (await comm.connect())[0]
    await comm.send_json_to(
        {"type": "subscribe", "topic": "operation", "sandbox_id": "sb-owned",
         "operation_id": "op-secret", "after_seq": -1}
    )  # fmt: skip
    frame = await comm.receive_json_from(timeout=5)
    assert (frame["type"], frame["code"]) == ("error", "not_found")
    assert await comm.receive_nothing(timeout=0.3)
    await comm.disconnect()
    assert await db_async(lambda: Operation.objects.count())() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
async def test_it_refuses_orchard_terminals_to_read_only_and_unknown_keys(make_tenant):
    owner, read_only = await db_async(make_tenant)(scopes=["read"])
    await db_async(make_sandbox)(owner, external_id="sb-ro")
    for query in ("", "?api_key=", "?api_key=hr_not_a_key", f"?api_key={read_only}"):
        error, code = await _refused(f"/orchard/sandboxes/sb-ro/exec/pty{query}", [])
        assert (error["type"], code) == ("error", 4401), query


# --- secrets, against the live stack ---------------------------------------------------


def _processes_holding(needle: bytes) -> list[str]:
    """Host processes whose argv or environment contain ``needle``."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        for name in ("cmdline", "environ"):
            try:
                if needle in (proc / name).read_bytes():
                    found.append(f"{proc.name}/{name}")
            except OSError:
                continue  # gone, or a kernel thread
    return found


@pytest.mark.timeout(180)
def test_it_keeps_keys_and_agent_tokens_out_of_logs_argv_and_the_sandbox(live, make_tenant):
    from websockets.sync.client import connect

    from apps.sandboxes.agent_client import agent_token
    from apps.sandboxes.backends import get_backend

    _, secret = make_tenant()
    wrong = "hr_" + "Q" * 43  # shaped like a real key, known to no one
    http = httpx.Client(
        base_url=live.url,
        headers={"Authorization": f"Bearer {secret}"},
        timeout=90,
        trust_env=False,
    )
    created = http.post("/api/v1/sandboxes", json={"image": "host", "sandbox_id": "sb-secrets"})
    assert created.status_code == 201, created.text
    assert http.get("/api/v1/sandboxes/sb-secrets/wait", params={"timeout": 60}).status_code == 200
    sandbox = Sandbox.objects.get(external_id="sb-secrets")
    token = agent_token(sandbox.id.hex, sandbox.generation)

    # The key travels every way a client may send it, right and wrong.
    assert (
        http.get("/api/v1/sandboxes", headers={"Authorization": f"Bearer {wrong}"}).status_code
        == 401
    )
    orchard = http.get("/orchard/sandboxes/sb-secrets", headers={"X-API-Key": secret})
    assert orchard.status_code == 200
    ws_url = live.url.replace("http://", "ws://") + "/orchard/sandboxes/sb-secrets/exec/pty"
    with connect(f"{ws_url}?api_key={secret}") as ws:
        ws.send(json.dumps({"type": "init", "cmd": ["true"]}))
        frames = [json.loads(ws.recv(timeout=20)) for _ in range(2)]
        assert frames[0]["type"] == "ready", frames
    with connect(f"{ws_url}?api_key={wrong}") as ws:
        assert json.loads(ws.recv(timeout=20))["type"] == "error"

    # What a command can see: every process's argv and environment in its sandbox.
    looked = http.post(
        "/api/v1/sandboxes/sb-secrets/exec",
        json={"command": "env; for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do "
              "tr '\\0' '\\n' < $f; done 2>/dev/null; ls -a /run /tmp /workspace"},
    )  # fmt: skip
    assert looked.status_code == 200, looked.text
    seen = looked.json()["stdout"]
    assert "HEDGEROW_AGENT_TOKEN" not in seen and token not in seen and secret not in seen

    assert _processes_holding(token.encode()) == []
    sandbox_dir = get_backend().sandboxes_dir / sandbox.id.hex  # type: ignore[attr-defined]
    assert not (sandbox_dir / "secret" / "token").exists()
    logs = [live.web.log_path, live.worker.log_path, *sandbox_dir.glob("*.log")]
    assert len(logs) >= 3
    for log in logs:
        text = log.read_text(errors="replace")
        for needle in (secret, wrong, token, secret[3:], wrong[3:]):
            assert needle not in text, (log.name, needle[:8])
    assert "sb-secrets" in live.web.log_path.read_text()  # the log was written at all
    http.delete("/api/v1/sandboxes/sb-secrets")


def test_it_redacts_keys_from_server_log_lines_and_json_logs():
    import logging

    from apps.core.logging import JsonFormatter, RedactSecretsFilter

    key = "hr_" + "k" * 43
    record = logging.LogRecord(
        "uvicorn.error", logging.INFO, __file__, 1, '%s - "WebSocket %s" [accepted]',
        ("127.0.0.1:5", f"/orchard/sandboxes/sb/exec/pty?api_key={key}&x=1"), None,
    )  # fmt: skip
    assert RedactSecretsFilter().filter(record)
    assert record.getMessage() == (
        '127.0.0.1:5 - "WebSocket /orchard/sandboxes/sb/exec/pty?api_key=[redacted]&x=1" [accepted]'
    )
    quoted = logging.LogRecord("x", logging.ERROR, __file__, 1, "bad %s", (f"Bearer {key}",), None)
    line = JsonFormatter().format(quoted)
    assert key not in line and "hr_kkkkkkkk[redacted]" in line


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
async def test_it_refuses_a_viewers_session_a_terminal_and_an_outsiders_session_the_sandbox(
    make_tenant,
):
    from django.contrib.auth.models import User

    from apps.tenancy.models import Membership

    def session_of(username: str, tenant: Any, role: str) -> bytes:
        user = User.objects.create_user(username, password="pw-" + username)
        Membership.objects.create(tenant=tenant, user=user, role=role)
        client = Client()
        assert client.login(username=username, password="pw-" + username)
        return f"sessionid={client.cookies['sessionid'].value}".encode()

    owner, _ = await db_async(make_tenant)()
    other, _ = await db_async(make_tenant)()
    await db_async(make_sandbox)(owner, external_id="sb-viewed")
    viewer = await db_async(session_of)("viewer", owner, "viewer")
    outsider = await db_async(session_of)("outsider", other, "owner")
    browser = [(b"host", b"testserver"), (b"origin", b"http://testserver")]
    error, code = await _refused("/ws/v1/sandboxes/sb-viewed/pty", [(b"cookie", viewer), *browser])
    assert (error["code"], code) == ("permission_denied", 4403)
    error, code = await _refused(
        "/ws/v1/sandboxes/sb-viewed/pty", [(b"cookie", outsider), *browser]
    )
    assert (error["code"], code) == ("sandbox_not_found", 4404)
