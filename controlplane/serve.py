"""The web process: ``python -m controlplane.serve`` takes uvicorn's own command line
(``controlplane.asgi:application --host … --port … --workers N --http httptools …``)
and runs it with the request head (request line + headers) bounded.

Why: uvicorn's httptools protocol has no limit on a request head. The parser keeps a
header that never ends in memory, so four clients each sending 50 MB of one unterminated
header grew the web process by ~210 MB (issue 14). uvicorn bounds the head only on its
h11 protocol (``--h11-max-incomplete-event-size``, 16 KiB by default), which is slower.
``BoundedHttpToolsProtocol`` counts the bytes of a head that has not ended and, past
``HEDGEROW_MAX_REQUEST_HEAD_BYTES`` (64 KiB), answers ``431`` and closes the connection.
The class is passed to uvicorn by reference, so ``--workers`` processes use it too.

Idle keep-alive: uvicorn closes an idle connection after 5 s by default, while HTTP
clients keep pooled connections far longer (httpx 5 s, reqwest 90 s, Go 90 s). A client
that reuses a connection the server is closing at that moment gets "connection closed
before message completed" (a flaky E2B resume test). Unless the command line gives
``--timeout-keep-alive``, the server keeps idle connections ``HEDGEROW_KEEP_ALIVE_S``
(default 120 s, longer than common clients' pool idle), so the client always lets go
first (docs/operations.md "Idle keep-alive").
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = int(os.environ.get("HEDGEROW_MAX_REQUEST_HEAD_BYTES", str(64 * 1024)))
KEEP_ALIVE_S = int(os.environ.get("HEDGEROW_KEEP_ALIVE_S", "120"))


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    _in_head = False
    _head_bytes = 0

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._in_head or self.transport.is_closing():
            return
        # Counted after parsing: a chunk that completes the head is not held against it.
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._in_head = False
            self.logger.warning("request head over %d bytes: 431, closed", MAX_HEAD_BYTES)
            message = b"request header fields too large"
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: text/plain; charset=utf-8\r\n"
                b"content-length: " + str(len(message)).encode() + b"\r\n"
                b"connection: close\r\n\r\n" + message
            )
            self.transport.close()


def _run(app: Any, **kwargs: Any) -> None:
    if kwargs.get("http") in ("auto", "httptools"):
        http: type[asyncio.Protocol] = BoundedHttpToolsProtocol
        kwargs["http"] = http
    # Said once at start (uvicorn configures logging only inside run), so an operator
    # and a test can read what the server uses.
    print(
        f"INFO:     idle keep-alive connections close after {kwargs.get('timeout_keep_alive')} s",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, **kwargs)


def with_defaults(argv: list[str]) -> list[str]:
    """The command line with this project's defaults for what it does not say."""
    given = any(arg.split("=", 1)[0] == "--timeout-keep-alive" for arg in argv)
    return argv if given else [*argv, "--timeout-keep-alive", str(KEEP_ALIVE_S)]


def main(argv: list[str]) -> None:
    # uvicorn's CLI, unchanged, except that it runs the bounded protocol (h11 is bounded
    # by uvicorn itself) and keeps idle connections longer than clients' pools do.
    cli = importlib.import_module("uvicorn.main")  # the module; uvicorn.main is the command
    cli.run = _run  # type: ignore[attr-defined]
    cli.main(with_defaults(argv), prog_name="controlplane.serve")


if __name__ == "__main__":
    main(sys.argv[1:])
