"""What the live-stack tests share to talk to the REST API: a client with a key, and a
ready sandbox."""

from __future__ import annotations

from typing import Any

import httpx


def api_client(live: Any, secret: str, prefix: str = "/api/v1") -> httpx.Client:
    """A client of the live stack under ``prefix`` (``/orchard`` takes X-API-Key)."""
    return httpx.Client(
        base_url=live.url + prefix,
        headers={"Authorization": f"Bearer {secret}", "X-API-Key": secret},
        timeout=90,
        trust_env=False,
    )


def ready_sandbox(http: httpx.Client, timeout: int = 60, **spec: Any) -> str:
    """Creates a ``host`` sandbox (``spec`` adds fields) and waits until it is ready."""
    created = http.post("/sandboxes", json={"image": "host", **spec})
    assert created.status_code in (200, 201), created.text
    sandbox_id = str(created.json()["id"])
    waited = http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": timeout})
    assert waited.status_code == 200, waited.text
    return sandbox_id
