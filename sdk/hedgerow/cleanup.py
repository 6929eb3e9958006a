"""Deletes the sandboxes a program created when it exits, is interrupted (SIGINT) or
is told to stop (SIGTERM), so a crashed or killed rollout leaves nothing running.

Clients register a sandbox *before* its create request is sent (the SDK chooses the
sandbox id itself), so a create that is in flight when Ctrl-C arrives is cleaned up
too: its DELETE is retried while the server has not yet recorded the create (a 404
for a create that may have been sent), for at most ``PENDING_GRACE_S`` seconds. Once a
signal has started the cleanup, new creates are refused (``Interrupted``) instead of
being sent, so worker threads cannot leak sandboxes after the signal. Deletes run in
parallel. Signal handlers are installed once, from the main thread, chain to the
handlers that were there before, and can be turned off with
``Client(handle_signals=False)``; interpreter exit is covered by ``atexit``.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import httpx

from hedgerow._common import USER_AGENT
from hedgerow.errors import HedgerowError

_Key = Tuple[str, str]  # (base url, sandbox id)

# How long a cleanup keeps retrying the DELETE of a sandbox whose create request may
# be in flight (the server answers 404 until it has recorded the create).
PENDING_GRACE_S = 15.0


class Interrupted(HedgerowError):
    """A create refused because the program is being interrupted (its cleanup ran)."""


@dataclass
class _Entry:
    api_key: str
    confirmed: bool = False  # the server answered the create: it exists


class CleanupRegistry:
    def __init__(self) -> None:
        self._lock = threading.RLock()  # a signal handler may run inside add()
        self._live: Dict[_Key, _Entry] = {}
        self._atexit = False
        self._signals_installed = False
        self._previous: Dict[int, Any] = {}
        self.interrupted = False

    def add(
        self,
        url: str,
        api_key: str,
        sandbox_id: str,
        *,
        handle_signals: bool,
        confirmed: bool = True,
    ) -> bool:
        """Registers a sandbox (``confirmed=False``: its create is about to be sent);
        False if it was registered already. Raises ``Interrupted`` once a signal has
        started the cleanup."""
        if handle_signals:
            self.install_signal_handlers()
        with self._lock:
            if self.interrupted:
                raise Interrupted("interrupted: not creating more sandboxes", code="interrupted")
            if not self._atexit:
                atexit.register(self.cleanup_all)
                self._atexit = True
            if (url, sandbox_id) in self._live:
                return False
            self._live[(url, sandbox_id)] = _Entry(api_key, confirmed=confirmed)
            return True

    def confirm(self, url: str, sandbox_id: str) -> None:
        with self._lock:
            entry = self._live.get((url, sandbox_id))
            if entry is not None:
                entry.confirmed = True

    def discard(self, url: str, sandbox_id: str) -> None:
        with self._lock:
            self._live.pop((url, sandbox_id), None)

    def has(self, url: str, sandbox_id: str) -> bool:
        with self._lock:
            return (url, sandbox_id) in self._live

    def pending(self) -> Dict[_Key, str]:
        with self._lock:
            return {key: entry.api_key for key, entry in self._live.items()}

    def cleanup_all(self) -> int:
        """Deletes every registered sandbox, in parallel; returns how many the server
        accepted (or already had gone)."""
        with self._lock:
            items, self._live = list(self._live.items()), {}
        if not items:
            return 0
        deadline = time.monotonic() + PENDING_GRACE_S
        clients: Dict[str, httpx.Client] = {}
        for (url, _), _entry in items:
            if url not in clients:
                clients[url] = httpx.Client(
                    timeout=10.0, trust_env=False, headers={"User-Agent": USER_AGENT}
                )

        def delete(item: Tuple[_Key, _Entry]) -> bool:
            (url, sandbox_id), entry = item
            while True:
                try:
                    response = clients[url].delete(
                        f"{url}/api/v1/sandboxes/{sandbox_id}",
                        headers={"Authorization": f"Bearer {entry.api_key}"},
                    )
                except httpx.HTTPError:
                    if time.monotonic() >= deadline:
                        return False
                    time.sleep(0.2)
                    continue
                if response.status_code < 300:
                    return True
                if response.status_code != 404:
                    return False
                # 404: gone — or its create is still on the way to the server.
                if entry.confirmed or time.monotonic() >= deadline:
                    return entry.confirmed
                time.sleep(0.2)

        # Plain threads, not an executor: at interpreter exit (the atexit path)
        # concurrent.futures refuses new work ("cannot schedule new futures after
        # interpreter shutdown"), which left every sandbox running. Where even a thread
        # cannot start any more, the delete runs here, one after another.
        results: List[bool] = [False] * len(items)

        def run(index: int) -> None:
            results[index] = delete(items[index])

        try:
            for start in range(0, len(items), 32):
                threads = []
                for index in range(start, min(start + 32, len(items))):
                    thread = threading.Thread(target=run, args=(index,), daemon=True)
                    try:
                        thread.start()
                    except RuntimeError:
                        run(index)
                        continue
                    threads.append(thread)
                for thread in threads:
                    thread.join()
        finally:
            for client in clients.values():
                client.close()
        return sum(results)

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
        with self._lock:
            self.interrupted = True
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
