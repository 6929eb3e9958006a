"""What every dashboard page needs to know about the websocket routes this server
has: the realtime feed's path (pages poll when there is none) and whether a sandbox
terminal can be opened. Here, beside the routing, because the pages live in apps
below the project's wiring and must not import it."""

from __future__ import annotations

from django.http import HttpRequest

from controlplane.routing import websocket_urlpatterns


def websocket_routes(request: HttpRequest) -> dict[str, object]:
    paths = [str(getattr(p, "pattern", "")) for p in websocket_urlpatterns]
    return {
        "realtime_url": "/ws/realtime" if any("ws/realtime" in p for p in paths) else "",
        "pty_available": any("pty" in p for p in paths),
    }
