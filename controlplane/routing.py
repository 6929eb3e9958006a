"""Websocket routes (docs/realtime.md)."""

from __future__ import annotations

from typing import Any

from django.urls import path

from apps.orchard.consumers import OrchardPtyConsumer
from apps.sandboxes.consumers.operations import OperationStreamConsumer, RealtimeConsumer
from apps.sandboxes.consumers.pty import PtyConsumer

websocket_urlpatterns: list[Any] = [
    path("ws/realtime", RealtimeConsumer.as_asgi()),
    path(
        "ws/v1/sandboxes/<str:sandbox_id>/operations/<str:operation_id>/stream",
        OperationStreamConsumer.as_asgi(),
    ),
    path("ws/v1/sandboxes/<str:sandbox_id>/pty", PtyConsumer.as_asgi()),
    path("orchard/sandboxes/<str:sandbox_id>/exec/pty", OrchardPtyConsumer.as_asgi()),
]
