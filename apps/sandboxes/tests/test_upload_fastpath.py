"""The upload fast path (apps/sandboxes/api/files_fastpath.py), in process against the
test database and Redis: an upload a limit or a check refuses is answered with its
typed error before one byte of its body is read (counted by the ``receive`` the server
would hand it), nothing is left held; and every request the path does not handle
exactly goes to Django with its body unread. The streaming itself, to a real agent,
is in test_upload_fastpath_live.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from django.conf import settings

from apps.billing.limits import in_flight, limits_cache_clear, transfer_admit, transfer_release
from apps.sandboxes.api.files_fastpath import FilesFastPath
from apps.sandboxes.models import Sandbox, State
from apps.sandboxes.tests.factories import make_sandbox
from apps.tenancy.auth import forget_cached_keys, principal_for_key

CHUNK = 64 * 1024


class Body:
    """An upload's body as the server hands it over, counting what was taken."""

    def __init__(self, size: int) -> None:
        self.size, self.read = size, 0

    async def receive(self) -> dict[str, Any]:
        piece = min(CHUNK, self.size - self.read)
        self.read += piece
        return {"type": "http.request", "body": b"x" * piece, "more_body": self.read < self.size}


class Inner:
    """Stands for Django: records what it was handed, reading the body whole."""

    def __init__(self) -> None:
        self.bodies: list[int] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        size = 0
        while True:
            message = await receive()
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.bodies.append(size)
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b"django"})


def _call(
    app: Any,
    sandbox_id: str,
    body: Body,
    headers: list[tuple[bytes, bytes]],
    query: bytes = b"path=/workspace/blob",
    method: str = "PUT",
) -> tuple[int, dict[bytes, bytes], bytes]:
    scope = {
        "type": "http",
        "method": method,
        "path": f"/api/v1/sandboxes/{sandbox_id}/files",
        "query_string": query,
        "headers": [(b"host", b"testserver"), *headers],
    }
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(app(scope, body.receive, send))
    finally:
        loop.close()
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


@pytest.fixture
def upload(transactional_db, make_tenant):
    """A tenant whose key this process has cached, a ready sandbox (on a port where
    nothing answers: nothing here may reach an agent), the fast path in front of a
    recording stand-in for Django."""
    tenant, secret = make_tenant()
    principal_for_key(secret)
    sandbox = make_sandbox(tenant)
    inner = Inner()
    auth = [(b"authorization", f"Bearer {secret}".encode())]
    yield {"tenant": tenant, "sandbox": sandbox, "inner": inner, "auth": auth}
    forget_cached_keys()
    limits_cache_clear()


def _length(size: int) -> tuple[bytes, bytes]:
    return (b"content-length", str(size).encode())


def test_an_upload_over_the_transfer_limit_is_refused_before_its_body_is_read(upload):
    tenant_id, key = str(upload["tenant"].pk), upload["sandbox"].external_id
    limit = settings.HEDGEROW_FILE_TRANSFERS_PER_SANDBOX
    held = [transfer_admit(tenant_id=tenant_id, sandbox_key=key, nbytes=0) for _ in range(limit)]
    try:
        body = Body(100 * 2**20)
        status, headers, payload = _call(
            FilesFastPath(upload["inner"]), key, body, [*upload["auth"], _length(body.size)]
        )
        assert status == 429 and body.read == 0
        error = json.loads(payload)["error"]
        assert (error["code"], error["limit"], error["value"]) == (
            "quota_exceeded",
            "file_transfers_per_sandbox",
            limit,
        )
        assert int(headers[b"retry-after"]) >= 1
        assert headers[b"content-type"] == b"application/json"
        assert upload["inner"].bodies == []
        assert in_flight("file", tenant_id, key) == limit  # nothing taken, nothing freed
    finally:
        for lease in held:
            transfer_release(tenant_id=tenant_id, sandbox_key=key, lease=lease)
    assert in_flight("file", tenant_id, key) == 0


@pytest.mark.parametrize(
    "case, status, code",
    [
        ("too_large", 413, "too_large"),
        ("other_tenant", 404, "sandbox_not_found"),
        ("terminating", 409, "sandbox_terminating"),
        ("relative_path", 400, "path_not_absolute"),
        ("no_path", 400, "path_required"),
    ],
)
def test_a_refused_upload_is_typed_before_its_body_is_read_and_holds_nothing(
    upload, make_tenant, case, status, code
):
    sandbox, tenant_id = upload["sandbox"], str(upload["tenant"].pk)
    target, size, query = sandbox.external_id, 4 * 2**20, b"path=/workspace/blob"
    if case == "too_large":
        size = int(settings.HEDGEROW_MAX_UPLOAD_BYTES) + 1
    elif case == "other_tenant":
        other, _ = make_tenant()
        target = make_sandbox(other, external_id="sb-theirs").external_id
    elif case == "terminating":
        Sandbox.objects.filter(pk=sandbox.pk).update(state=State.TERMINATING)
    elif case == "relative_path":
        query = b"path=workspace/blob"
    elif case == "no_path":
        query = b"mode=0644"
    body = Body(size)
    answered, _headers, payload = _call(
        FilesFastPath(upload["inner"]), target, body, [*upload["auth"], _length(size)], query
    )
    assert (answered, json.loads(payload)["error"]["code"]) == (status, code)
    assert body.read == 0 and upload["inner"].bodies == []
    assert in_flight("file", tenant_id, sandbox.external_id) == 0


@pytest.mark.parametrize(
    "case",
    ["chunked", "uncached_key", "read_only", "other_param", "nul", "accept_html", "get", "off"],
)
def test_it_hands_everything_else_to_django_with_the_body_unread(
    upload, make_tenant, settings, case
):
    headers = [*upload["auth"], _length(300_000)]
    query, method = b"path=/workspace/blob", "PUT"
    if case == "chunked":
        headers = [*upload["auth"], (b"transfer-encoding", b"chunked")]
    elif case == "uncached_key":
        forget_cached_keys()
    elif case == "read_only":
        _, secret = make_tenant(scopes=["read"])
        principal_for_key(secret)
        headers = [(b"authorization", f"Bearer {secret}".encode()), _length(300_000)]
    elif case == "other_param":
        query += b"&recursive=1"
    elif case == "nul":
        query = b"path=/workspace/a%00b"
    elif case == "accept_html":
        headers.append((b"accept", b"text/html"))
    elif case == "get":
        method = "GET"
    elif case == "off":
        settings.HEDGEROW_FILES_FAST_PATH = False
    body = Body(300_000)
    status, _headers, payload = _call(
        FilesFastPath(upload["inner"]),
        upload["sandbox"].external_id,
        body,
        headers,
        query,
        method,
    )
    assert (status, payload) == (299, b"django")
    assert upload["inner"].bodies == [300_000]  # Django read it all, from the first byte
    assert in_flight("file", str(upload["tenant"].pk), upload["sandbox"].external_id) == 0


def test_post_is_an_upload_too_and_an_unreachable_agent_is_typed_and_gives_the_slot_back(upload):
    """The sandbox's agent does not answer (port 9): 502 ``agent_unreachable``, the
    transfer's slot released."""
    sandbox, tenant_id = upload["sandbox"], str(upload["tenant"].pk)
    body = Body(10)
    status, _headers, payload = _call(
        FilesFastPath(upload["inner"]),
        sandbox.external_id,
        body,
        [*upload["auth"], _length(10)],
        method="POST",
    )
    assert (status, json.loads(payload)["error"]["code"]) == (502, "agent_unreachable")
    assert upload["inner"].bodies == []
    assert in_flight("file", tenant_id, sandbox.external_id) == 0


@pytest.mark.parametrize(
    "case, status, code",
    [
        ("other_tenant", 404, "sandbox_not_found"),
        ("terminating", 409, "sandbox_terminating"),
        ("relative_path", 400, "path_not_absolute"),
        ("unreachable", 502, "agent_unreachable"),
    ],
)
def test_a_download_is_typed_before_a_header_goes_out_and_holds_nothing(
    upload, make_tenant, case, status, code
):
    sandbox, tenant_id = upload["sandbox"], str(upload["tenant"].pk)
    target, query = sandbox.external_id, b"path=/workspace/blob"
    if case == "other_tenant":
        other, _ = make_tenant()
        target = make_sandbox(other, external_id="sb-theirs").external_id
    elif case == "terminating":
        Sandbox.objects.filter(pk=sandbox.pk).update(state=State.TERMINATING)
    elif case == "relative_path":
        query = b"path=workspace/blob"
    answered, headers, payload = _call(
        FilesFastPath(upload["inner"]), target, Body(0), upload["auth"], query, "GET"
    )
    assert (answered, json.loads(payload)["error"]["code"]) == (status, code)
    assert headers[b"content-type"] == b"application/json"
    assert upload["inner"].bodies == []
    assert in_flight("file", tenant_id, sandbox.external_id) == 0


@pytest.mark.parametrize("case", ["mode_param", "with_body", "uncached_key"])
def test_a_download_it_does_not_handle_goes_to_django(upload, case):
    headers, query = upload["auth"], b"path=/workspace/blob"
    if case == "mode_param":
        query += b"&mode=0644"
    elif case == "with_body":
        headers = [*headers, _length(5)]
    elif case == "uncached_key":
        forget_cached_keys()
    status, _headers, payload = _call(
        FilesFastPath(upload["inner"]),
        upload["sandbox"].external_id,
        Body(5 if case == "with_body" else 0),
        headers,
        query,
        "GET",
    )
    assert (status, payload) == (299, b"django")
    assert upload["inner"].bodies == [5 if case == "with_body" else 0]
