import os
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django.setup(set_prefix=False)  # what django.core.asgi.get_asgi_application does

from controlplane.asgi_handler import SyncChainASGIHandler  # noqa: E402

# Django's middleware chain in one thread hop per request (controlplane/asgi_handler.py).
django_asgi_app = SyncChainASGIHandler()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from apps.core.logging import redact_server_logs  # noqa: E402
from apps.e2b.fastpath import EnvdStartFastPath  # noqa: E402
from apps.sandboxes.api.exec_fastpath import ExecFastPath  # noqa: E402
from apps.sandboxes.api.files_fastpath import FilesFastPath  # noqa: E402
from apps.sandboxes.services.stream_pump import remember_loop  # noqa: E402
from controlplane.routing import websocket_urlpatterns  # noqa: E402
from controlplane.webgc import web_gc_tune  # noqa: E402
from controlplane.ws_auth import WebsocketAuthStack  # noqa: E402

# The server logs each websocket's URL, query string included: the Orchard PTY's key.
redact_server_logs()

router = ProtocolTypeRouter(
    {
        # Plain REST execs and E2B command starts skip Django's thread hop
        # (docs/benchmarks.md); uploads skip Django's reading of the whole body first.
        "http": ExecFastPath(EnvdStartFastPath(FilesFastPath(django_asgi_app))),
        "websocket": WebsocketAuthStack(URLRouter(websocket_urlpatterns)),
    }
)


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    # Streamed-exec pumps run on this loop (apps/sandboxes/services/stream_pump.py).
    remember_loop()
    await router(scope, receive, send)


# Last: everything start-up loaded is in the heap now (controlplane/webgc.py).
web_gc_tune()
