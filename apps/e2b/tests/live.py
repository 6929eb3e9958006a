"""Helpers for driving the real E2B SDK against the live stack."""

from __future__ import annotations

from typing import Any

from apps.sandboxes.tests.live_api import wait_all_deleted

__all__ = ["opts", "wait_all_deleted"]


def opts(live: Any, secret: str) -> dict[str, Any]:
    """The SDK's connection options for this stack: what E2B_API_URL, E2B_SANDBOX_URL
    and E2B_API_KEY set (docs/e2b.md)."""
    return {
        "api_key": secret,
        "api_url": live.url + "/e2b",
        "sandbox_url": live.url + "/e2b/envd",
        "request_timeout": 90,
    }
