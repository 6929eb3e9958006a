"""Deletes the sandboxes a program created when it exits, is interrupted (SIGINT) or
is told to stop (SIGTERM), so a crashed or killed rollout leaves nothing running.

Clients register what they create (``Client(cleanup=True)``, the default) and
unregister what they delete. Signal handlers are installed once, from the main
thread, chain to the handlers that were there before, and can be turned off with
``Client(handle_signals=False)``; interpreter exit is covered by ``atexit``.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from typing import Any, Dict, Tuple

import httpx

from hedgerow._common import USER_AGENT

_Key = Tuple[str, str]  # (base url, sandbox id)


class CleanupRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: Dict[_Key, str] = {}  # -> api key
        self._atexit = False
        self._signals_installed = False
        self._previous: Dict[int, Any] = {}

    def add(self, url: str, api_key: str, sandbox_id: str, *, handle_signals: bool) -> None:
        with self._lock:
            self._live[(url, sandbox_id)] = api_key
            if not self._atexit:
                atexit.register(self.cleanup_all)
                self._atexit = True
        if handle_signals:
            self.install_signal_handlers()

    def discard(self, url: str, sandbox_id: str) -> None:
        with self._lock:
            self._live.pop((url, sandbox_id), None)

    def pending(self) -> Dict[_Key, str]:
        with self._lock:
            return dict(self._live)

    def cleanup_all(self) -> int:
        """Deletes every registered sandbox (best effort, a few seconds at most each);
        returns how many deletes the server accepted."""
        with self._lock:
            items, self._live = list(self._live.items()), {}
        deleted = 0
        for (url, sandbox_id), api_key in items:
            try:
                response = httpx.delete(
                    f"{url}/api/v1/sandboxes/{sandbox_id}",
                    headers={"Authorization": f"Bearer {api_key}", "User-Agent": USER_AGENT},
                    timeout=10.0,
                    trust_env=False,
                )
                deleted += int(response.status_code < 300 or response.status_code == 404)
            except httpx.HTTPError:
                continue
        return deleted

    def install_signal_handlers(self) -> None:
        if self._signals_installed or threading.current_thread() is not threading.main_thread():
            return
        self._signals_installed = True
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._on_signal)
            except (ValueError, OSError):
                continue

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.cleanup_all()
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
            return
        if previous == signal.SIG_IGN:
            return
        # The default action: die of the same signal, so the exit status tells the truth.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


registry = CleanupRegistry()
