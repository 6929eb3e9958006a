"""``AsyncTerminal``: the asyncio twin of ``streaming.Terminal`` (``await
sandbox.pty()`` in the async client)."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Union

from hedgerow.errors import error_from_response
from hedgerow.streaming import _raise_error, _ws_module, connection_failed, ws_url


async def _open(base_url: str, api_key: str, path: str) -> Any:
    websockets = _ws_module()
    from websockets.asyncio.client import connect

    try:
        return await connect(
            ws_url(base_url, path),
            additional_headers={"Authorization": f"Bearer {api_key}"},
            max_size=None,
            open_timeout=30,
        )
    except websockets.exceptions.InvalidStatus as exc:
        raw = bytes(exc.response.body or b"").decode(errors="replace")
        try:
            body = json.loads(raw or "null")
        except ValueError:
            body = None
        raise error_from_response(exc.response.status_code, body, raw) from None
    except (OSError, websockets.exceptions.InvalidHandshake, TimeoutError) as exc:
        raise connection_failed(base_url, exc) from None


class AsyncTerminal:
    """An interactive PTY session (asyncio): ``await term.read()`` returns output bytes
    as they come; ``exit_code`` is set when the process ends. Closing kills the
    session's processes. Made by ``await AsyncSandbox.pty()``, already started."""

    def __init__(self, ws: Any, pid: int) -> None:
        self._ws = ws
        self.pid = pid
        self.exit_code: Optional[int] = None

    @classmethod
    async def open(
        cls,
        base_url: str,
        api_key: str,
        sandbox_id: str,
        *,
        cmd: Union[None, str, List[str]] = None,
        rows: int = 24,
        cols: int = 80,
        env: Optional[Dict[str, str]] = None,
        cwd: Optional[str] = None,
    ) -> AsyncTerminal:
        from websockets.exceptions import ConnectionClosed

        ws = await _open(base_url, api_key, f"/ws/v1/sandboxes/{sandbox_id}/pty")
        init = {"type": "pty.init", "cmd": cmd, "rows": rows, "cols": cols, "env": env or {}}
        init["cwd"] = cwd
        try:
            await ws.send(json.dumps(init))
            ready = json.loads(await ws.recv())
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
            reason = exc.rcvd.reason if exc.rcvd is not None else ""
            _raise_error({"code": "socket_closed", "message": reason or f"closed ({code})"}, code)
            raise
        if ready.get("type") != "pty.ready":
            await ws.close()
            _raise_error(ready)
        return cls(ws, int(ready["pid"]))

    async def write(self, data: Union[bytes, str]) -> None:
        await self._ws.send(data.encode() if isinstance(data, str) else data)

    async def resize(self, rows: int, cols: int) -> None:
        await self._ws.send(json.dumps({"type": "pty.resize", "rows": rows, "cols": cols}))

    async def signal(self, name: str) -> None:
        await self._ws.send(json.dumps({"type": "pty.signal", "signal": name}))

    async def read(self, timeout: Optional[float] = None) -> bytes:
        """Output bytes; b"" once the session has ended (``exit_code`` is then set).
        ``timeout`` (seconds, default none) raises ``TimeoutError`` when nothing came."""
        import asyncio

        from websockets.exceptions import ConnectionClosed

        while self.exit_code is None:
            try:
                message = await asyncio.wait_for(self._ws.recv(), timeout)
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

    async def close(self) -> None:
        await self._ws.close()

    async def __aenter__(self) -> AsyncTerminal:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
