"""Typed exceptions for every error code, and the retry policy, against a scripted server."""

from __future__ import annotations

import asyncio

import hedgerow
import httpx
import pytest
from hedgerow import AsyncClient, Client


def _scripted(responses: list[httpx.Response], seen: list[httpx.Request]):
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return responses.pop(0)

    return handler


def _client(responses, seen) -> Client:
    client = Client("http://hedgerow.test", "hr_x", max_retries=3, cleanup=False)
    client._http = httpx.Client(
        base_url="http://hedgerow.test/api/v1",
        transport=httpx.MockTransport(_scripted(responses, seen)),
    )
    return client


def _error(status: int, code: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"error": {"code": code, "message": f"{code} happened", "field": None}}
    return httpx.Response(status, json=body, headers=headers)


@pytest.mark.parametrize(
    ("status", "code", "cls"),
    [
        (401, "invalid_api_key", hedgerow.AuthError),
        (403, "permission_denied", hedgerow.AuthError),
        (404, "sandbox_not_found", hedgerow.NotFound),
        (409, "sandbox_exists", hedgerow.Conflict),
        (409, "sandbox_not_ready", hedgerow.SandboxNotReady),
        (409, "sandbox_terminating", hedgerow.SandboxTerminating),
        (409, "sandbox_lost", hedgerow.SandboxLost),
        (429, "quota_exceeded", hedgerow.QuotaExceeded),
        (402, "budget_exhausted", hedgerow.BudgetExhausted),
        (400, "validation_error", hedgerow.ValidationError),
        (502, "agent_unreachable", hedgerow.AgentUnreachable),
        (408, "wait_timeout", hedgerow.WaitTimeout),
    ],
)
def test_it_raises_a_typed_exception_carrying_the_code_and_message(status, code, cls):
    seen: list[httpx.Request] = []
    client = _client([_error(status, code)], seen)
    with pytest.raises(cls) as raised:
        client.get("sb-1")
    assert raised.value.code == code
    assert raised.value.status == status
    assert raised.value.message == f"{code} happened"
    assert len(seen) == 1  # none of these is retried


def test_it_retries_429_and_503_with_retry_after_then_succeeds(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr("hedgerow.client.time.sleep", sleeps.append)
    seen: list[httpx.Request] = []
    ok = httpx.Response(200, json={"id": "sb-1", "state": "ready"})
    client = _client(
        [
            _error(503, "unavailable", {"Retry-After": "2"}),
            _error(429, "quota_exceeded", {"Retry-After": "1"}),
            ok,
        ],
        seen,
    )
    assert client.get("sb-1").id == "sb-1"
    assert len(seen) == 3
    assert sleeps[0] >= 2 and sleeps[1] >= 1  # never sooner than the server asked


def test_it_does_not_retry_a_429_without_retry_after(monkeypatch):
    monkeypatch.setattr("hedgerow.client.time.sleep", lambda s: None)
    seen: list[httpx.Request] = []
    client = _client([_error(429, "quota_exceeded")], seen)
    with pytest.raises(hedgerow.QuotaExceeded):
        client.get("sb-1")
    assert len(seen) == 1


def test_it_gives_up_after_max_retries(monkeypatch):
    monkeypatch.setattr("hedgerow.client.time.sleep", lambda s: None)
    seen: list[httpx.Request] = []
    client = _client([_error(503, "unavailable", {"Retry-After": "0"}) for _ in range(4)], seen)
    with pytest.raises(hedgerow.HedgerowError) as raised:
        client.get("sb-1")
    assert raised.value.status == 503
    assert len(seen) == 4


def test_it_keeps_one_idempotency_key_across_create_retries(monkeypatch):
    monkeypatch.setattr("hedgerow.client.time.sleep", lambda s: None)
    seen: list[httpx.Request] = []
    client = _client(
        [
            _error(503, "unavailable", {"Retry-After": "0"}),
            httpx.Response(201, json={"id": "sb-1", "state": "requested"}),
        ],
        seen,
    )
    client.create_sandbox(wait=False)
    keys = {r.headers["Idempotency-Key"] for r in seen}
    assert len(seen) == 2 and len(keys) == 1


def test_the_async_client_retries_and_types_errors_the_same_way(monkeypatch):
    async def no_sleep(_: float) -> None:
        return None

    monkeypatch.setattr("hedgerow.aio.asyncio.sleep", no_sleep)
    seen: list[httpx.Request] = []
    responses = [
        _error(503, "unavailable", {"Retry-After": "0"}),
        _error(409, "sandbox_lost"),
    ]

    async def scenario() -> None:
        client = AsyncClient("http://hedgerow.test", "hr_x", cleanup=False)
        client._http = httpx.AsyncClient(
            base_url="http://hedgerow.test/api/v1",
            transport=httpx.MockTransport(_scripted(responses, seen)),
        )
        with pytest.raises(hedgerow.SandboxLost):
            await client.get("sb-1")

    asyncio.run(scenario())
    assert len(seen) == 2


def test_it_refuses_to_start_without_a_key(monkeypatch, tmp_path):
    monkeypatch.delenv("HEDGEROW_API_KEY", raising=False)
    monkeypatch.setenv("HEDGEROW_CONFIG", str(tmp_path / "none.json"))
    with pytest.raises(hedgerow.HedgerowError) as raised:
        Client("http://hedgerow.test")
    assert raised.value.code == "no_api_key"
