"""The web process's Django handler (controlplane/asgi_handler.py) answers exactly what
Django's stock ASGIHandler answers — status, headers, body bytes — with the middleware
chain run in one thread hop instead of a dozen."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Any

import pytest
from asgiref import sync as asgiref_sync
from django.core.handlers.asgi import ASGIHandler

from apps.sandboxes.models import Sandbox, State
from apps.sandboxes.tests.factories import make_sandbox
from controlplane.asgi_handler import RequestThreads, SyncChainASGIHandler


def _call(
    app: Any, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b""
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode("utf-8", "surrogateescape"),
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"x-request-id", b"req-1"),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
    }
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = sent[0]
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], start["headers"], payload


_RANDOM = re.compile(rb"(csrftoken=|csrfmiddlewaretoken\" value=\")[A-Za-z0-9]+")
_DATE = re.compile(rb"\w{3}, \d\d \w{3} \d{4} \d\d:\d\d:\d\d GMT")


def _masked(
    answer: tuple[int, list[tuple[bytes, bytes]], bytes],
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The login page's CSRF token is random per response, its expiry dates the clock."""
    status, headers, body = answer
    mask = lambda b: _DATE.sub(b"DATE", _RANDOM.sub(rb"\1TOKEN", b))  # noqa: E731
    return status, [(k, mask(v)) for k, v in headers], mask(body)


@pytest.fixture
def handlers(transactional_db: Any, no_enqueue: Any) -> tuple[Any, Any]:
    return ASGIHandler(), SyncChainASGIHandler()


@pytest.fixture
def no_enqueue(monkeypatch: pytest.MonkeyPatch) -> None:
    from apps.sandboxes import tasks

    monkeypatch.setattr(tasks.provision_sandbox, "delay", lambda *a: None)
    monkeypatch.setattr(tasks.destroy_sandbox, "delay", lambda *a: None)


def test_it_answers_byte_for_byte_what_the_stock_handler_answers(handlers, make_tenant):
    stock, chained = handlers
    tenant, secret = make_tenant()
    _other, other_secret = make_tenant()
    ready = make_sandbox(tenant)
    auth = [(b"authorization", f"Bearer {secret}".encode())]
    as_json = [*auth, (b"content-type", b"application/json")]
    create = json.dumps({"image": "host", "labels": {"run": "1"}}).encode()
    requests: list[tuple[str, str, list[tuple[bytes, bytes]], bytes]] = [
        ("GET", "/healthz", [], b""),
        ("GET", f"/api/v1/sandboxes/{ready.external_id}", auth, b""),
        ("GET", f"/api/v1/sandboxes/{ready.external_id}/wait?timeout=1", auth, b""),
        ("GET", f"/api/v1/sandboxes/{ready.external_id}/wait?timeout=x", auth, b""),
        # another team's sandbox, no key, a bad key, an unknown endpoint
        (
            "GET",
            f"/api/v1/sandboxes/{ready.external_id}",
            [(b"authorization", f"Bearer {other_secret}".encode())],
            b"",
        ),
        ("GET", f"/api/v1/sandboxes/{ready.external_id}", [], b""),
        ("GET", "/api/v1/sandboxes", [(b"authorization", b"Bearer hr_nope")], b""),
        ("GET", "/api/v1/nothing-here", auth, b""),
        # validation, a malformed body, a create replayed by its key (200 both times)
        ("POST", "/api/v1/sandboxes", as_json, json.dumps({"ttl_seconds": 1}).encode()),
        ("POST", "/api/v1/sandboxes", as_json, b"{not json"),
        ("POST", "/api/v1/sandboxes", [*as_json, (b"idempotency-key", b"k1")], create),
        # the dashboard: a redirect to the login page, and the page itself
        ("GET", "/", [], b""),
        ("GET", "/login/", [], b""),
    ]
    # The replay's first create, so both handlers answer the replay (200).
    status, _, _ = _call(stock, "POST", "/api/v1/sandboxes", requests[10][2], create)
    assert status == 201
    for method, path, headers, body in requests:
        expected = _masked(_call(stock, method, path, headers, body))
        got = _masked(_call(chained, method, path, headers, body))
        assert got == expected, (method, path)
    # DELETE: the first answers 202 terminating; deleting again is the same 202.
    path = f"/api/v1/sandboxes/{ready.external_id}"
    first = _call(chained, "DELETE", path, auth)
    assert first[0] == 202 and json.loads(first[2])["state"] == "terminating"
    assert _call(chained, "DELETE", path, auth) == _call(stock, "DELETE", path, auth)
    assert Sandbox.objects.get(pk=ready.pk).state == State.TERMINATING


def test_it_runs_the_whole_chain_in_one_hop_to_a_thread(handlers, make_tenant, monkeypatch):
    stock, chained = handlers
    tenant, secret = make_tenant()
    sandbox = make_sandbox(tenant)
    auth = [(b"authorization", f"Bearer {secret}".encode())]
    hops: list[str] = []
    original = asgiref_sync.SyncToAsync.__call__

    async def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(self.func, "__qualname__", "?"))
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(asgiref_sync.SyncToAsync, "__call__", counting)
    path = f"/api/v1/sandboxes/{sandbox.external_id}"
    assert _call(stock, "GET", path, auth)[0] == 200
    stock_hops = len(hops)
    hops.clear()
    assert _call(chained, "GET", path, auth)[0] == 200
    # request_started's receivers + get_response in one, response.close() in the other.
    assert len(hops) == 2, hops
    assert stock_hops > 3


def test_it_sends_the_request_signals_once_each_around_the_view_in_its_thread(
    handlers, make_tenant, monkeypatch
):
    from django.core.signals import request_finished, request_started

    from apps.sandboxes.api import views

    stock, chained = handlers
    tenant, secret = make_tenant()
    path = f"/api/v1/sandboxes/{make_sandbox(tenant).external_id}"
    auth = [(b"authorization", f"Bearer {secret}".encode())]
    events: list[tuple[str, threading.Thread]] = []
    view = views.SandboxDetailView.get

    def viewing(self: Any, request: Any, sandbox_id: str) -> Any:
        events.append(("view", threading.current_thread()))
        return view(self, request, sandbox_id)

    def started(**_: Any) -> None:
        events.append(("started", threading.current_thread()))

    def finished(**_: Any) -> None:
        events.append(("finished", threading.current_thread()))

    monkeypatch.setattr(views.SandboxDetailView, "get", viewing)
    request_started.connect(started, weak=False, dispatch_uid="test-signals-started")
    request_finished.connect(finished, weak=False, dispatch_uid="test-signals-finished")
    unbuildable = []
    try:
        for app in (stock, chained):
            events.clear()
            assert _call(app, "GET", path, auth)[0] == 200
            assert [name for name, _ in events] == ["started", "view", "finished"], app
            assert len({thread for _, thread in events}) == 1, app
            # A query string that is not UTF-8: Django cannot build the request (400).
            events.clear()
            unbuildable.append(_call(app, "GET", "/healthz?\udcff", []))
            assert [name for name, _ in events] == ["started", "finished"], app
    finally:
        request_started.disconnect(dispatch_uid="test-signals-started")
        request_finished.disconnect(dispatch_uid="test-signals-finished")
    assert unbuildable[0][0] == 400
    assert unbuildable[1] == unbuildable[0]


def test_it_serves_one_request_after_another_from_the_same_thread(handlers):
    from django.core.signals import request_started

    stock, chained = handlers
    seen: list[threading.Thread] = []

    def record(**_: Any) -> None:
        seen.append(threading.current_thread())

    request_started.connect(record, weak=False, dispatch_uid="test-request-thread")
    try:
        for app in (chained, chained, stock, stock):
            assert _call(app, "GET", "/healthz", [])[0] == 200
    finally:
        request_started.disconnect(dispatch_uid="test-request-thread")
    assert seen[0] is seen[1] and seen[0].name.startswith("hedgerow-request")
    assert seen[0].is_alive()
    assert seen[2] is not seen[3]  # the stock handler starts a thread per request


def test_it_never_hands_out_a_thread_that_is_still_busy():
    pool = RequestThreads(max_idle=4)
    quick = pool.lease()
    assert quick.submit(lambda: 42).result(timeout=5) == 42
    pool.give_back(quick)
    assert pool.lease() is quick  # idle: taken again

    release = threading.Event()
    busy = pool.lease()
    running = busy.submit(release.wait, 10)
    pool.give_back(busy)  # its client went away while the view still runs
    other = pool.lease()
    assert other is not busy
    assert other.submit(lambda: "free").result(timeout=5) == "free"
    release.set()
    assert running.result(timeout=5) is True
    with pytest.raises(RuntimeError):  # it was shut down, not pooled
        busy.submit(lambda: None)
    pool.give_back(other)
    pool.give_back(quick)
    assert pool.lease() is quick and pool.lease() is other
