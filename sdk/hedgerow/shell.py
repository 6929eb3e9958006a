"""``hedgerow sandbox shell``: a real terminal on a sandbox over the PTY websocket
(docs/realtime.md): raw mode, window resizes (SIGWINCH), Ctrl-C passed through.
Needs the ``websockets`` package (``pip install 'hedgerow[stream]'``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
from typing import Any, List, Optional


def run_shell(url: str, api_key: str, sandbox_id: str, *, cmd: Optional[List[str]] = None) -> int:
    """Runs an interactive session; returns the remote process's exit status."""
    from hedgerow.streaming import _raise_error as raise_error
    from hedgerow.streaming import first_message, open_socket

    size = shutil.get_terminal_size((80, 24))
    interactive = sys.stdin.isatty()
    with open_socket(url, api_key, f"/ws/v1/sandboxes/{sandbox_id}/pty") as ws:
        init = {
            "type": "pty.init",
            "rows": size.lines,
            "cols": size.columns,
            "cmd": cmd or None,
            "env": {"TERM": os.environ.get("TERM", "xterm-256color")},
        }
        ready = first_message(ws, init)
        if ready.get("type") != "pty.ready":
            raise_error(ready)  # typed (AuthError, NotFound, …): the CLI prints one line
        saved = _raw_mode() if interactive else None
        previous_winch = _on_resize(ws) if interactive else None
        threading.Thread(target=_pump_stdin, args=(ws,), daemon=True).start()
        try:
            return _pump_output(ws)
        finally:
            if saved is not None:
                import termios

                termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)
            if previous_winch is not None:
                signal.signal(signal.SIGWINCH, previous_winch)


def _raw_mode() -> Any:
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setraw(fd)
    return saved


def _on_resize(ws: Any) -> Any:
    def resized(signum: int, frame: Any) -> None:
        size = shutil.get_terminal_size((80, 24))
        try:
            ws.send(json.dumps({"type": "pty.resize", "rows": size.lines, "cols": size.columns}))
        except Exception:  # noqa: BLE001 - the session is ending
            return

    return signal.signal(signal.SIGWINCH, resized)


def _pump_stdin(ws: Any) -> None:
    fd = sys.stdin.fileno()
    try:
        while True:
            data = os.read(fd, 4096)
            if not data:
                # End of input (a pipe): the remote shell sees EOF as on a terminal.
                ws.send(b"\x04")
                return
            ws.send(data)
    except Exception:  # noqa: BLE001 - the socket closed under us: the session ended
        return


def _pump_output(ws: Any) -> int:
    from websockets.exceptions import ConnectionClosed

    out = sys.stdout.buffer
    try:
        for message in ws:
            if isinstance(message, bytes):
                out.write(message)
                out.flush()
                continue
            frame = json.loads(message)
            if frame.get("type") == "pty.exit":
                code = int(frame.get("code", 1))
                return code if code >= 0 else 128 - code
            if frame.get("type") == "error":
                sys.stderr.write(f"\r\nhedgerow: {frame.get('message')}\r\n")
                return 1
    except ConnectionClosed:
        pass
    return 1
