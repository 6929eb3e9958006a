"""Websocket routes (exec streams, PTY); filled by the data-path work."""

from __future__ import annotations

from typing import Any

websocket_urlpatterns: list[Any] = []
