"""Helpers for tests against the live stack."""

from __future__ import annotations

from apps.sandboxes.tests.live_api import wait_all_deleted

__all__ = ["wait_all_deleted"]
