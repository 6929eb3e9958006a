"""The REST exec fast path (apps/sandboxes/api/exec_fastpath.py) answers exactly what the
DRF view answers, and hands everything it does not handle to Django untouched.

Unit tests for the body check and the renderer; in-process ASGI tests against the
test database, Redis and a fake pod agent on loopback for the path itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from datetime import UTC, datetime
from typing import Any

import pytest
import uvloop
from django.utils import timezone
from rest_framework.renderers import JSONRenderer

from apps.billing import limits
from apps.billing.limits import _key, hot_limits, limits_cache_clear
from apps.billing.models import TenantQuota
from apps.core.redis_async import RedisBatches
from apps.core.redis_sync import redis_client
from apps.sandboxes.agent_async import pool_clear
from apps.sandboxes.api.exec_fastpath import ExecFastPath, parse_exec_body, render_operation
from apps.sandboxes.api.serializers import ExecSerializer, OperationSerializer
from apps.sandboxes.exec_env import ENV_REDACTED
from apps.sandboxes.models import Operation, OperationStatus, Sandbox, State
from apps.sandboxes.services import exec_async
from apps.sandboxes.services.exec_async import clients_close, operation_fields
from apps.sandboxes.services.operations import request_from_record
from apps.sandboxes.services.streaming import pump_key, pumps
from apps.sandboxes.tests.factories import make_sandbox
from apps.tenancy import auth
from apps.tenancy.auth import forget_cached_keys, principal_for_key
from apps.tenancy.models import ApiKey
from apps.tenancy.secrets import hash_secret

OK_RESULT = {
    "termination": {"reason": "exited", "exit_code": 3, "signal": None, "message": None},
    "stdout": {"head": "hi\u2028\n", "tail": "", "encoding": "utf-8", "total_bytes": 6},
    "stderr": {"head": "", "tail": "", "encoding": "utf-8", "total_bytes": 0},
    "usage": {"wall_s": 0.002, "user_cpu_s": 0.001},
    "children_remained": False,
}


# -- the body check ----------------------------------------------------------------
BODIES: list[Any] = [
    {"command": "echo hi"},
    {"command": ["ls", "-l"], "cwd": "/tmp", "env": {"A": "1", "B": ""}, "timeout": 5},
    {"command": "x", "timeout": 2.5, "login_shell": True, "operation_id": "op-1.a:b"},
    {"command": "x", "output_window": 256, "output_limit": 10, "generation": 0},
    {"command": "x", "stdin": "aGk=", "stream": False},
    {"command": "x", "cwd": None, "timeout": None, "output_limit": None},
    # DRF rejects, coerces or trims these: all must go to DRF.
    {"command": "  "},
    {"command": []},
    {"command": ["a", 1]},
    {"command": 5},
    {},
    {"command": "x", "cwd": "tmp"},
    {"command": "x", "cwd": " /tmp"},
    {"command": "x", "env": {"A": " 1"}},
    {"command": "x", "env": {"A": None}},
    {"command": "x", "env": None},
    {"command": "x", "timeout": "5"},
    {"command": "x", "timeout": 0},
    {"command": "x", "timeout": True},
    {"command": "x", "timeout": 100000},
    {"command": "x", "login_shell": "true"},
    {"command": "x", "output_window": 255},
    {"command": "x", "output_window": 300.0},
    {"command": "x", "operation_id": "has space"},
    {"command": "x", "operation_id": " op"},
    {"command": "x", "generation": -1},
    {"command": "x", "stdin": "not base64!"},
    {"command": "x", "stream": True},
    {"command": "x", "stream": "false"},
    {"command": "x", "unknown": 1},
    ["echo hi"],
    # A NUL cannot reach execve nor be recorded: DRF's 400 names where it is.
    {"command": ["echo", "a\x00b"]},
    {"command": "echo a\x00b"},
    {"command": "x", "env": {"K\x00": "v"}},
    {"command": "x", "env": {"K": "v\x00"}},
    {"command": "x", "cwd": "/tmp\x00"},
]


@pytest.mark.parametrize("body", BODIES)
def test_it_accepts_only_bodies_drf_turns_into_the_same_request(body):
    parsed = parse_exec_body(json.dumps(body).encode())
    serializer = ExecSerializer(data=body)
    if parsed is None:
        # Sent to DRF: fine whether DRF accepts it or not. What matters is the converse.
        return
    assert serializer.is_valid(), serializer.errors
    request, operation_id, generation = parsed
    assert request == serializer.to_request()
    assert request.fingerprint() == serializer.to_request().fingerprint()
    record, fingerprint = exec_async.request_record(request)
    assert fingerprint == request.fingerprint()
    # the stored form: the same fields, env values sealed (random tokens: compared
    # through what they decrypt to)
    assert request_from_record(json.loads(record)) == request
    if request.env:
        assert json.loads(record)["env"] == dict.fromkeys(request.env, ENV_REDACTED)
    else:
        assert json.loads(record) == dataclasses.asdict(request)
    assert operation_id == serializer.validated_data.get("operation_id")
    assert generation == serializer.validated_data.get("generation")


def test_it_takes_the_common_bodies_and_leaves_the_doubtful_ones():
    assert parse_exec_body(b'{"command": "echo hi", "timeout": 30}') is not None
    assert parse_exec_body(json.dumps(BODIES[1]).encode()) is not None
    for raw in (b'{"command": "x", "timeout": NaN}', b"not json", b"\xff", b""):
        assert parse_exec_body(raw) is None
    for body in BODIES[6:]:
        assert parse_exec_body(json.dumps(body).encode()) is None, body


# -- the renderer --------------------------------------------------------------------
def test_it_renders_an_operation_byte_for_byte_like_drf(db, make_tenant):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant)
    whole_second = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    rows = [
        Operation.objects.create(
            tenant=tenant, sandbox=sandbox, operation_id="op-run", generation=1, request_hash="x"
        ),
        Operation.objects.create(
            tenant=tenant,
            sandbox=sandbox,
            operation_id="op-done",
            generation=2,
            request_hash="y",
            status=OperationStatus.COMPLETED,
            termination="timeout",
            signal=9,
            stdout={
                "head": "aGk=",
                "tail": "eg==",
                "encoding": "base64",
                "total_bytes": 9,
                "truncated": True,
            },
            stderr={"head": "é \u2029 ✓", "tail": "", "encoding": "utf-8", "total_bytes": 9},
            usage={"wall_s": 1.5, "max_rss_kb": 3},
            children_remained=True,
            created_at=whole_second,
            finished_at=whole_second,
        ),
        Operation.objects.create(
            tenant=tenant,
            sandbox=sandbox,
            operation_id="op-failed",
            generation=1,
            request_hash="z",
            status=OperationStatus.FAILED,
            termination="agent_error",
            error={"code": "agent_unreachable", "message": "gone"},
            finished_at=datetime.now(UTC),
        ),
    ]
    for row in rows:
        row = Operation.objects.select_related("sandbox").get(pk=row.pk)
        expected = JSONRenderer().render(OperationSerializer(row).data)
        assert render_operation(operation_fields(row)) == expected


def test_it_writes_to_the_tables_the_models_name():
    # The fast path's SQL is written out; a renamed table must fail here, not in prod.
    assert f"FROM {Sandbox._meta.db_table}" in exec_async._START_SQL
    assert f"INSERT INTO {Operation._meta.db_table} " in exec_async._START_SQL
    assert f"UPDATE {Operation._meta.db_table} " in exec_async._FINISH_SQL


def test_the_start_insert_writes_every_column_of_the_model():
    # Built from Operation's metadata: every concrete column appears once, in the
    # model's order, so a column added to the model cannot be silently left out.
    columns = [f.column for f in Operation._meta.concrete_fields]
    insert = exec_async._START_SQL.split(f"INSERT INTO {Operation._meta.db_table} (")[1]
    assert insert.split(")", 1)[0].split(", ") == columns


def test_a_fast_path_row_equals_what_the_orm_would_have_written(make_tenant: Any) -> None:
    # The defaults the INSERT writes for the columns it does not set are the model's.
    from django.db import connection

    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant, state=State.READY)
    op_id = "00000000-0000-4000-8000-000000000001"
    with connection.cursor() as cur:
        sql = exec_async._START_SQL
        for n in range(9, 0, -1):  # $n::type -> %s placeholders, in order below
            sql = sql.replace(f"${n}", f"%(p{n})s")
        cur.execute(
            sql,
            {
                "p1": str(tenant.id),
                "p2": sandbox.external_id,
                "p3": op_id,
                "p4": "op-1",
                "p5": "{}",
                "p6": "h",
                "p7": "actor",
                "p8": "2026-12-02T00:00:00Z",
                "p9": None,
            },
        )
    row = Operation.objects.get(pk=op_id)
    orm = Operation(tenant=tenant, sandbox=sandbox, generation=sandbox.generation)
    for field in Operation._meta.concrete_fields:
        if field.column in exec_async._START_PARAMS:
            continue
        assert getattr(row, field.attname) == getattr(orm, field.attname), field.name


def test_a_column_without_default_or_value_is_refused_by_name():
    from django.db import models

    field: models.CharField[str, str] = models.CharField(max_length=3)
    field.set_attributes_from_name("new_column")
    with pytest.raises(ValueError, match="new_column"):
        exec_async.build_start_insert([field], "t")


# -- the path itself, in process -------------------------------------------------------
class FakeAgent:
    """A pod agent on loopback answering /exec with a canned status and JSON body."""

    def __init__(self, status: int = 200, body: Any = None) -> None:
        self.status, self.body = status, body if body is not None else OK_RESULT
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.port = 0

    async def start(self) -> asyncio.Server:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return server

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                headers = {
                    k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])
                }
                body = json.loads(await reader.readexactly(int(headers["content-length"])))
                self.requests.append((headers, body))
                payload = json.dumps(self.body).encode()
                writer.write(
                    f"HTTP/1.1 {self.status} X\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


class Inner:
    """Stands for Django: records what it was handed."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.calls.append(body)
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b"django"})


def _call(
    app: Any, sandbox_id: str, body: bytes, headers: list[tuple[bytes, bytes]]
) -> tuple[int, dict[bytes, bytes], bytes]:
    scope = {
        "type": "http",
        "method": "POST",
        "path": f"/api/v1/sandboxes/{sandbox_id}/exec",
        "query_string": b"",
        "headers": [(b"host", b"testserver"), *headers],
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run() -> None:
        await app(scope, receive, send)

    asyncio.get_event_loop().run_until_complete(run())
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


@pytest.fixture(params=["asyncio", "uvloop"])
def fast(request, transactional_db, make_tenant):
    """A tenant whose key and limits are cached, a ready sandbox on a fake agent, and
    the fast path in front of a recording stand-in for Django; on both event loops
    (uvicorn runs uvloop: a path that only fails there would fall back silently)."""
    loop = uvloop.new_event_loop() if request.param == "uvloop" else asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    agent = FakeAgent()
    server = loop.run_until_complete(agent.start())
    tenant, secret = make_tenant()
    sandbox = make_sandbox(tenant, endpoint_port=agent.port)
    principal_for_key(secret)
    hot_limits(str(tenant.pk))
    inner = Inner()
    auth = [(b"authorization", f"Bearer {secret}".encode()), (b"content-type", b"application/json")]
    env = {"tenant": tenant, "secret": secret, "sandbox": sandbox, "agent": agent}
    env.update(inner=inner, app=ExecFastPath(inner), auth=auth, loop=loop)
    yield env
    pool_clear()  # our side of the kept-alive agent connections: the handlers end
    loop.run_until_complete(asyncio.sleep(0.05))
    server.close()
    loop.run_until_complete(server.wait_closed())
    loop.run_until_complete(clients_close())
    loop.close()
    asyncio.set_event_loop(None)
    forget_cached_keys()
    limits_cache_clear()


def _leases(tenant: Any) -> int:
    count: Any = redis_client().zcard(_key("exec", str(tenant.pk)))
    return int(count)


def test_it_answers_a_plain_exec_without_django_as_the_view_would(fast, api_client):
    body = json.dumps({"command": "echo hi", "operation_id": "op-fast", "timeout": 5}).encode()
    headers = [*fast["auth"], (b"x-request-id", b"trace-123")]
    status, response_headers, payload = _call(
        fast["app"], fast["sandbox"].external_id, body, headers
    )
    assert status == 200
    assert fast["inner"].calls == []
    assert response_headers[b"x-request-id"] == b"trace-123"
    assert response_headers[b"content-type"] == b"application/json"
    # The agent got the request id, its token and the regular path's body.
    agent_headers, agent_body = fast["agent"].requests[0]
    assert agent_headers["x-request-id"] == "trace-123"
    assert agent_body["operation_id"] == "op-fast" and agent_body["command"] == "echo hi"
    operation = Operation.objects.get(sandbox=fast["sandbox"], operation_id="op-fast")
    assert operation.status == OperationStatus.COMPLETED
    assert (operation.termination, operation.exit_code) == ("exited", 3)
    assert operation.stdout == OK_RESULT["stdout"] and operation.finished_at is not None
    assert operation.request["command"] == "echo hi" and operation.request["timeout"] == 5.0
    assert operation.actor.startswith("key:") and operation.generation == 1
    assert _leases(fast["tenant"]) == 0
    # The same operation read back through DRF is the same record.
    detail = api_client(fast["secret"]).get(
        f"/api/v1/sandboxes/{fast['sandbox'].external_id}/operations/op-fast"
    )
    assert detail.status_code == 200
    assert json.loads(payload) == json.loads(detail.content)


@pytest.mark.parametrize(
    "case",
    ["uncached_key", "read_only", "stream", "replay", "terminating", "stale", "other", "quota"],
)
def test_it_hands_everything_else_to_django_untouched(fast, make_tenant, case):
    sandbox, tenant = fast["sandbox"], fast["tenant"]
    data: dict[str, Any] = {"command": "echo hi", "operation_id": "op-1"}
    headers = fast["auth"]
    target = sandbox.external_id
    if case == "uncached_key":
        forget_cached_keys()
    elif case == "read_only":
        _, secret = make_tenant(scopes=["read"])
        principal_for_key(secret)
        headers = [(b"authorization", f"Bearer {secret}".encode()), headers[1]]
    elif case == "stream":
        data["stream"] = True
    elif case == "replay":
        Operation.objects.create(
            tenant=tenant, sandbox=sandbox, operation_id="op-1", generation=1, request_hash="h"
        )
    elif case == "terminating":
        Sandbox.objects.filter(pk=sandbox.pk).update(state=State.TERMINATING)
    elif case == "stale":
        data["generation"] = 7
    elif case == "other":
        other, _ = make_tenant()
        target = make_sandbox(other, external_id="sb-theirs").external_id
    elif case == "quota":
        TenantQuota.objects.update_or_create(tenant=tenant, defaults={"max_concurrent_execs": 1})
        limits_cache_clear()
        hot_limits(str(tenant.pk))
        redis_client().zadd(_key("exec", str(tenant.pk)), {"held": 10**13})
    before = Operation.objects.count()
    body = json.dumps(data).encode()
    status, _headers, payload = _call(fast["app"], target, body, headers)
    assert (status, payload) == (299, b"django")
    assert fast["inner"].calls == [body]
    assert fast["agent"].requests == []
    assert Operation.objects.count() == before  # an inserted row was taken back
    assert _leases(tenant) == (1 if case == "quota" else 0)  # a taken lease was released


@pytest.mark.parametrize("failure", ["agent_error", "unreachable"])
def test_it_ends_an_operation_whose_agent_failed_like_the_regular_path(fast, failure):
    if failure == "agent_error":
        fast["agent"].status = 400
        fast["agent"].body = {
            "error": {"code": "cwd_not_found", "message": "no /x", "field": "cwd"}
        }
    else:
        Sandbox.objects.filter(pk=fast["sandbox"].pk).update(endpoint_port=9)
    body = json.dumps({"command": "pwd", "cwd": "/x", "operation_id": "op-f"}).encode()
    status, _headers, payload = _call(fast["app"], fast["sandbox"].external_id, body, fast["auth"])
    operation = Operation.objects.get(operation_id="op-f")
    assert operation.status == OperationStatus.FAILED and operation.finished_at is not None
    error = json.loads(payload)["error"]
    if failure == "agent_error":
        assert status == 400
        assert (error["code"], error["field"]) == ("cwd_not_found", "cwd")
        assert operation.error == {"code": "cwd_not_found", "message": "no /x"}
    else:
        assert status == 502
        assert (error["code"], error["operation_id"]) == ("agent_unreachable", "op-f")
        assert (operation.error or {}).get("code") == "agent_unreachable"
    assert _leases(fast["tenant"]) == 0
    assert fast["inner"].calls == []


def test_it_answers_an_unexpected_failure_in_the_envelope_and_gives_the_slot_back(fast):
    fast["agent"].body = "not an exec result"  # the agent answers 200 with nonsense
    headers = [*fast["auth"], (b"x-request-id", b"trace-500")]
    body = json.dumps({"command": "true", "operation_id": "op-bug"}).encode()
    status, _headers, payload = _call(fast["app"], fast["sandbox"].external_id, body, headers)
    assert status == 500
    error = json.loads(payload)["error"]
    assert error["code"] == "internal_error" and "trace-500" in error["message"]
    assert _leases(fast["tenant"]) == 0
    # Left ``running`` without a live relay: recovery asks the agent later.
    operation = Operation.objects.get(operation_id="op-bug")
    assert operation.status == OperationStatus.RUNNING
    assert pump_key(str(operation.pk)) not in pumps._keys


def test_it_keeps_retry_after_on_a_resource_exhausted_answer_as_the_view_does(fast, api_client):
    # the agent is alive but has no process left under the sandbox's pids limit
    fast["agent"].status = 503
    fast["agent"].body = {
        "error": {"code": "resource_exhausted", "message": "no process left", "kind": "pids"}
    }
    body = json.dumps({"command": "true", "operation_id": "op-full"}).encode()
    status, headers, payload = _call(fast["app"], fast["sandbox"].external_id, body, fast["auth"])
    assert fast["inner"].calls == []
    assert status == 503
    assert headers[b"retry-after"] == b"1"
    assert json.loads(payload)["error"]["code"] == "resource_exhausted"


def test_it_hands_the_exec_to_django_when_redis_is_down_leaving_no_row(fast, caplog):
    loop = fast["loop"]
    loop.run_until_complete(exec_async._clients.get())
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    exec_async._clients.redis = RedisBatches(host="127.0.0.1", port=port)
    before = Operation.objects.count()
    body = json.dumps({"command": "echo hi", "operation_id": "op-noredis"}).encode()
    status, _headers, payload = _call(fast["app"], fast["sandbox"].external_id, body, fast["auth"])
    assert (status, payload) == (299, b"django")
    assert fast["agent"].requests == []
    assert Operation.objects.count() == before  # the inserted row was taken back
    failures = [r for r in caplog.records if "Redis or Postgres failed" in r.getMessage()]
    assert failures and failures[0].exc_info is not None
    assert issubclass(failures[0].exc_info[0], OSError)  # the real error, with its traceback


def _age_cached_key_and_limits(secret: str, tenant: Any) -> None:
    digest = hash_secret(secret)
    principal, _at = auth._key_cache[digest]
    auth._key_cache[digest] = (principal, time.monotonic() - 60)
    limits._cache[str(tenant.pk)] = (time.monotonic() - 1, limits._cache[str(tenant.pk)][1])


def test_it_refreshes_a_stale_key_and_limits_once_for_concurrent_execs(fast, monkeypatch):
    lookups: list[str] = []
    real_lookup, real_limits = auth._principal_for_digest, limits.hot_limits

    def counted_lookup(digest: str, source: str | None = None) -> Any:
        lookups.append("key")
        return real_lookup(digest, source)

    def counted_limits(tenant_id: str) -> Any:
        lookups.append("limits")
        return real_limits(tenant_id)

    monkeypatch.setattr(auth, "_principal_for_digest", counted_lookup)
    monkeypatch.setattr(exec_async, "hot_limits", counted_limits)
    _age_cached_key_and_limits(fast["secret"], fast["tenant"])
    sent: list[list[dict[str, Any]]] = [[], [], []]

    async def one(i: int) -> None:
        body = json.dumps({"command": "echo hi", "operation_id": f"op-stale-{i}"}).encode()
        scope = {
            "type": "http",
            "method": "POST",
            "path": f"/api/v1/sandboxes/{fast['sandbox'].external_id}/exec",
            "query_string": b"",
            "headers": [(b"host", b"testserver"), *fast["auth"]],
        }

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent[i].append(message)

        await fast["app"](scope, receive, send)

    async def three() -> None:
        await asyncio.gather(one(0), one(1), one(2))

    fast["loop"].run_until_complete(three())
    assert [messages[0]["status"] for messages in sent] == [200, 200, 200]
    assert fast["inner"].calls == []  # none took the regular path
    assert sorted(lookups) == ["key", "limits"]  # one lookup each, shared by the three
    assert Operation.objects.filter(operation_id__startswith="op-stale-").count() == 3


def test_it_hands_a_stale_key_that_was_revoked_meanwhile_to_django(fast):
    _age_cached_key_and_limits(fast["secret"], fast["tenant"])
    ApiKey.objects.filter(secret_hash=hash_secret(fast["secret"])).update(revoked_at=timezone.now())
    body = json.dumps({"command": "echo hi", "operation_id": "op-revoked"}).encode()
    status, _headers, payload = _call(fast["app"], fast["sandbox"].external_id, body, fast["auth"])
    assert (status, payload) == (299, b"django")  # the view answers the 401 with its reason
    assert fast["agent"].requests == []
    assert not Operation.objects.filter(operation_id="op-revoked").exists()


def test_its_headers_are_the_ones_django_sends_for_the_same_exec(fast, api_client):
    """The fast path writes Django's response headers by hand (issue 18): compare them
    with what the middleware chain and DRF put on the same exec answered by the view,
    so a header added to Django's chain cannot be missing from the fast path unseen."""
    sandbox_id = fast["sandbox"].external_id
    body = {"command": "echo hi", "operation_id": "op-headers-fast", "timeout": 5}
    status, ours, _ = _call(fast["app"], sandbox_id, json.dumps(body).encode(), fast["auth"])
    assert status == 200 and fast["inner"].calls == []
    client = api_client(fast["secret"])

    def through_the_view() -> Any:
        return client.post(
            f"/api/v1/sandboxes/{sandbox_id}/exec",
            {**body, "operation_id": "op-headers-view"},
            format="json",
        )

    # in a thread, while the loop serves the fake agent the view's exec goes to (the
    # rows are committed: transactional_db)
    loop = asyncio.get_event_loop()
    via_django = loop.run_until_complete(asyncio.to_thread(through_the_view))
    assert via_django.status_code == 200, via_django.content
    theirs = {name.lower(): value for name, value in via_django.headers.items()}
    mine = {name.decode(): value.decode() for name, value in ours.items()}
    # per-response values: the length and the request id (the fast path's id is
    # tested above); everything else must be the same name with the same value
    per_response = {"content-length", "x-request-id"}
    assert {k: v for k, v in mine.items() if k not in per_response} == {
        k: v for k, v in theirs.items() if k not in per_response
    }
    assert per_response <= set(mine) and per_response <= set(theirs)
