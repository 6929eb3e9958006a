"""Live exec output and interactive terminals over websockets (docs/realtime.md).

Needs the optional ``websockets`` package (``pip install hedgerow[stream]``). The key
travels in the handshake's ``Authorization`` header, never in the URL.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, Iterator, List, Optional, Union

from hedgerow.errors import HedgerowError, error_from_response
from hedgerow.results import ExecResult

MAX_RECONNECTS = 8
_STATUS = {4400: 400, 4401: 401, 4403: 403, 4404: 404, 4409: 409, 4429: 429, 4502: 502}


@dataclass
class Frame:
    """One frame of a streamed exec. ``type`` is start/stdout/stderr/gap/exit; ``data``
    is raw bytes (a chunk may split a UTF-8 character); ``result`` is set on exit."""

    type: str
    seq: Optional[int]
    data: bytes = b""
    pid: Optional[int] = None
    result: Optional[ExecResult] = None
    raw: Dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def _ws_module() -> Any:
    try:
        import websockets
    except ImportError:  # pragma: no cover - depends on the install
        raise HedgerowError(
            "streaming needs the websockets package: pip install 'hedgerow[stream]'",
            code="missing_dependency",
        ) from None
    return websockets


def available() -> bool:
    """Whether live streaming can be used (the optional websockets package is there)."""
    try:
        import websockets.sync.client  # noqa: F401
    except ImportError:
        return False
    return True


def ws_url(base_url: str, path: str) -> str:
    if base_url.startswith("https://"):
        return "wss://" + base_url[len("https://") :] + path
    return "ws://" + base_url[len("http://") :] + path if base_url.startswith("http://") else path


def connection_failed(base_url: str, exc: BaseException) -> HedgerowError:
    """A server that cannot be reached, as one line with the cause and the fix."""
    from hedgerow.errors import HedgerowConnectionError

    cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return HedgerowConnectionError(
        f"cannot reach Hedgerow at {base_url} ({cause}): check that the server is running "
        "and that HEDGEROW_URL (or --url) points at it",
        code="connection_error",
    )


def open_socket(base_url: str, api_key: str, path: str) -> Any:
    """Opens an authenticated websocket; a refused handshake (bad key, unknown
    sandbox) is the typed error the REST API would give, an unreachable server a
    ``HedgerowConnectionError``, never a websockets traceback."""
    websockets = _ws_module()
    from websockets.sync.client import connect

    try:
        return connect(
            ws_url(base_url, path),
            additional_headers={"Authorization": f"Bearer {api_key}"},
            max_size=None,
            open_timeout=30,
        )
    except websockets.exceptions.InvalidStatus as exc:
        response = exc.response
        try:
            body = json.loads(bytes(response.body or b"").decode() or "null")
        except ValueError:
            body = None
        raise error_from_response(
            response.status_code, body, bytes(response.body or b"").decode(errors="replace")
        ) from None
    except (OSError, websockets.exceptions.InvalidHandshake, TimeoutError) as exc:
        raise connection_failed(base_url, exc) from None


def first_message(ws: Any, init: Dict[str, Any]) -> Dict[str, Any]:
    """Sends ``init`` and returns the first JSON message; a socket the server closed
    instead (its close code says why: 4401 unauthenticated, 4404 not found, …) is the
    typed error."""
    from websockets.exceptions import ConnectionClosed

    try:
        ws.send(json.dumps(init))
        message: Dict[str, Any] = json.loads(ws.recv(timeout=30))
    except ConnectionClosed as exc:
        code = exc.rcvd.code if exc.rcvd is not None else None
        reason = exc.rcvd.reason if exc.rcvd is not None else ""
        _raise_error({"code": "socket_closed", "message": reason or f"closed ({code})"}, code)
        raise  # unreachable: _raise_error raises
    return message


def _raise_error(obj: Dict[str, Any], close_code: Optional[int] = None) -> None:
    status = _STATUS.get(close_code or 0, 400)
    if obj.get("code") in ("not_found", "sandbox_not_found", "operation_not_found"):
        status = 404
    elif obj.get("code") in ("not_authenticated", "invalid_api_key", "api_key_revoked"):
        status = 401
    raise error_from_response(status, {"error": obj})


def _frame(obj: Dict[str, Any]) -> Frame:
    kind = str(obj.get("type", "")).replace("exec.", "", 1)
    frame = Frame(type=kind, seq=obj.get("seq"), raw=obj)
    if kind in ("stdout", "stderr"):
        frame.data = base64.b64decode(obj.get("data") or "")
    elif kind == "start":
        frame.pid = obj.get("pid")
    elif kind == "exit" and obj.get("result"):
        frame.result = ExecResult.from_api(obj["result"])
    return frame


class _Cursor:
    """Reconnect bookkeeping shared by the sync and async readers: the last seq seen
    decides ``after_seq`` and drops anything already delivered."""

    def __init__(self, after_seq: int) -> None:
        self.last = after_seq
        self.failures = 0

    def accept(self, obj: Dict[str, Any]) -> Optional[Frame]:
        if obj.get("type") == "error":
            _raise_error(obj)
        frame = _frame(obj)
        if frame.type == "gap":
            self.last = max(self.last, int(obj.get("to_seq", self.last)))
            return frame
        if frame.seq is not None:
            if frame.seq <= self.last:
                return None
            self.last = frame.seq
        self.failures = 0
        return frame

    def failed(self, exc: BaseException) -> float:
        self.failures += 1
        if self.failures > MAX_RECONNECTS:
            raise HedgerowError(f"the output stream kept failing: {exc}", code="stream_lost")
        return float(min(0.1 * 2**self.failures, 3.0))


def stream_operation(
    base_url: str, api_key: str, sandbox_id: str, operation_id: str, *, after_seq: int = -1
) -> Iterator[Frame]:
    """Frames of one operation, reconnecting (with ``after_seq``) when the socket drops,
    ending after the exit frame. Nothing is yielded twice."""
    websockets = _ws_module()
    from websockets.sync.client import connect

    cursor = _Cursor(after_seq)
    path = f"/ws/v1/sandboxes/{sandbox_id}/operations/{operation_id}/stream"
    while True:
        try:
            with connect(
                ws_url(base_url, f"{path}?after_seq={cursor.last}"),
                additional_headers={"Authorization": f"Bearer {api_key}"},
                max_size=None,
                open_timeout=30,
            ) as ws:
                for message in ws:
                    frame = cursor.accept(json.loads(message))
                    if frame is None:
                        continue
                    yield frame
                    if frame.type == "exit":
                        return
        except (OSError, websockets.exceptions.WebSocketException) as exc:
            time.sleep(cursor.failed(exc))
            continue
        time.sleep(cursor.failed(HedgerowError("closed before the exit frame")))


async def astream_operation(
    base_url: str, api_key: str, sandbox_id: str, operation_id: str, *, after_seq: int = -1
) -> AsyncIterator[Frame]:
    """The async twin of ``stream_operation``."""
    websockets = _ws_module()
    from websockets.asyncio.client import connect

    cursor = _Cursor(after_seq)
    path = f"/ws/v1/sandboxes/{sandbox_id}/operations/{operation_id}/stream"
    while True:
        try:
            async with connect(
                ws_url(base_url, f"{path}?after_seq={cursor.last}"),
                additional_headers={"Authorization": f"Bearer {api_key}"},
                max_size=None,
                open_timeout=30,
            ) as ws:
                async for message in ws:
                    frame = cursor.accept(json.loads(message))
                    if frame is None:
                        continue
                    yield frame
                    if frame.type == "exit":
                        return
        except (OSError, websockets.exceptions.WebSocketException) as exc:
            await asyncio.sleep(cursor.failed(exc))
            continue
        await asyncio.sleep(cursor.failed(HedgerowError("closed before the exit frame")))


TextCallback = Callable[[str], None]


class _Collector:
    """Feeds live output to callbacks, decoded incrementally so a UTF-8 character split
    across chunks arrives whole, and keeps the exit frame's typed result."""

    def __init__(self, on_stdout: Optional[TextCallback], on_stderr: Optional[TextCallback]):
        self.callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        self.decoders = {
            name: codecs.getincrementaldecoder("utf-8")("replace") for name in self.callbacks
        }

    def feed(self, frame: Frame) -> Optional[ExecResult]:
        callback = self.callbacks.get(frame.type)
        if callback is not None:
            text = self.decoders[frame.type].decode(frame.data)
            if text:
                callback(text)
        if frame.type != "exit":
            return None
        for name, decoder in self.decoders.items():
            tail, cb = decoder.decode(b"", final=True), self.callbacks[name]
            if tail and cb is not None:
                cb(tail)
        if frame.result is None:
            raise HedgerowError("the stream ended without a result", code="stream_lost")
        return frame.result


def collect(
    frames: Iterator[Frame],
    on_stdout: Optional[TextCallback] = None,
    on_stderr: Optional[TextCallback] = None,
) -> ExecResult:
    """Runs the stream to its end, calling back with live text; returns the result."""
    collector = _Collector(on_stdout, on_stderr)
    for frame in frames:
        result = collector.feed(frame)
        if result is not None:
            return result
    raise HedgerowError("the stream ended without an exit frame", code="stream_lost")


async def acollect(
    frames: AsyncIterator[Frame],
    on_stdout: Optional[TextCallback] = None,
    on_stderr: Optional[TextCallback] = None,
) -> ExecResult:
    """The async twin of ``collect``."""
    collector = _Collector(on_stdout, on_stderr)
    async for frame in frames:
        result = collector.feed(frame)
        if result is not None:
            return result
    raise HedgerowError("the stream ended without an exit frame", code="stream_lost")


class Terminal:
    """An interactive PTY session (sync). ``read()`` returns output bytes as they come;
    ``exit_code`` is set when the process ends. Closing kills the session's processes."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        sandbox_id: str,
        *,
        cmd: Union[None, str, List[str]] = None,
        rows: int = 24,
        cols: int = 80,
        env: Optional[Dict[str, str]] = None,
        cwd: Optional[str] = None,
    ) -> None:
        self._ws = open_socket(base_url, api_key, f"/ws/v1/sandboxes/{sandbox_id}/pty")
        self.exit_code: Optional[int] = None
        init = {"type": "pty.init", "cmd": cmd, "rows": rows, "cols": cols, "env": env or {}}
        init["cwd"] = cwd
        ready = first_message(self._ws, init)
        if ready.get("type") != "pty.ready":
            self._ws.close()
            _raise_error(ready)
        self.pid: int = int(ready["pid"])

    def write(self, data: Union[bytes, str]) -> None:
        self._ws.send(data.encode() if isinstance(data, str) else data)

    def resize(self, rows: int, cols: int) -> None:
        self._ws.send(json.dumps({"type": "pty.resize", "rows": rows, "cols": cols}))

    def signal(self, name: str) -> None:
        self._ws.send(json.dumps({"type": "pty.signal", "signal": name}))

    def read(self, timeout: Optional[float] = None) -> bytes:
        """Output bytes; b"" once the session has ended (``exit_code`` is then set)."""
        from websockets.exceptions import ConnectionClosed

        while self.exit_code is None:
            try:
                message = self._ws.recv(timeout=timeout)
            except ConnectionClosed:
                return b""
            if isinstance(message, bytes):
                return message
            obj = json.loads(message)
            if obj.get("type") == "pty.exit":
                self.exit_code = int(obj["code"])
            elif obj.get("type") == "error":
                _raise_error(obj)
        return b""

    def close(self) -> None:
        self._ws.close()

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
