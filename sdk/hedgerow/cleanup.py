"""Deletes the sandboxes a program created when it exits, is interrupted (SIGINT) or
is told to stop (SIGTERM), so a crashed or killed rollout leaves nothing running.

Clients register a sandbox *before* its create request is sent (the SDK chooses the
sandbox id itself), and an httpcore trace callback marks it *sent* (``mark_sent``)
just before its request is written to the socket, under the registry lock. A create
that is in flight when Ctrl-C arrives is cleaned up too: its DELETE is retried while
the server has not yet recorded the create (a 404 for a create that was sent), for at
most ``PENDING_GRACE_S`` seconds. A create registered but never sent is simply dropped
(no DELETE, no retries), and once a cleanup has started ``mark_sent`` refuses
(``Interrupted``), so no create can slip out after it. Deletes run in parallel.

The signal handler does no blocking work: it sets the flag, starts the cleanup in a
fresh thread and chains to the previous handler (by default ``KeyboardInterrupt``),
so the main thread unwinds and releases the locks it held; ``atexit`` then waits for
that thread (bounded) and deletes anything left. Signal handlers are installed once,
from the main thread, and can be turned off with ``Client(handle_signals=False)``.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

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
    sent: bool = False  # its create request was handed to the transport


class CleanupRegistry:
    def __init__(self) -> None:
        self._lock = threading.RLock()  # a signal handler may run inside add()
        self._live: Dict[_Key, _Entry] = {}
        self._atexit = False
        self._signals_installed = False
        self._previous: Dict[int, Any] = {}
        self.interrupted = False
        self._cleanup_thread: Optional[threading.Thread] = None
        # Keys whose create was never sent when a cleanup dropped them (for tests and
        # diagnostics: they needed no DELETE).
        self.dropped_unsent: List[_Key] = []

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

    def mark_sent(self, url: str, sandbox_id: str) -> None:
        """Called (from the httpx request hook) just before a create is sent. Raises
        ``Interrupted`` once a cleanup has started, so the request is never sent."""
        with self._lock:
            if self.interrupted:
                raise Interrupted("interrupted: not creating more sandboxes", code="interrupted")
            entry = self._live.get((url, sandbox_id))
            if entry is not None:
                entry.sent = True

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
        accepted (or already had gone). Sandboxes whose create was never sent are
        dropped without a DELETE; from here on no create is sent."""
        running = self._cleanup_thread
        if running is not None and running is not threading.current_thread():
            running.join(PENDING_GRACE_S + 15.0)  # the signal's cleanup, bounded
        with self._lock:
            self.interrupted = True
            everything, self._live = list(self._live.items()), {}
            items = [(k, e) for k, e in everything if e.sent or e.confirmed]
            self.dropped_unsent.extend(k for k, e in everything if not (e.sent or e.confirmed))
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
        # No blocking cleanup here: the interrupted main thread may hold locks (the
        # import lock, a connection pool's) that the delete threads need, which once
        # hung a child forever. The flag is set without waiting (RLock: the main
        # thread may be inside add(); another thread holds it only for a moment).
        self.interrupted = True
        if self._cleanup_thread is None:
            thread = threading.Thread(target=self.cleanup_all, name="hedgerow-cleanup")
            thread.daemon = True
            self._cleanup_thread = thread
            thread.start()
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)  # default SIGINT: KeyboardInterrupt, main unwinds
            return
        if previous == signal.SIG_IGN:
            return
        # The default action (SIGTERM): die of the same signal, so the exit status
        # tells the truth -- after the cleanup, which is bounded.
        self._cleanup_thread.join(PENDING_GRACE_S + 15.0)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


registry = CleanupRegistry()

# A create passes ``extensions=sent_trace(url, id)`` (or ``asent_trace``): httpcore's
# trace callback marks it sent just before its request headers are written to the
# socket -- not while it waits for a pooled connection -- and refuses it once a
# cleanup has started (the callback's exception means nothing is written).
_SENDING = "send_request_headers.started"


def sent_trace(url: str, sandbox_id: str) -> Dict[str, Any]:
    def trace(name: str, info: Dict[str, Any]) -> None:
        if name.endswith(_SENDING):
            registry.mark_sent(url, sandbox_id)

    return {"trace": trace}


def asent_trace(url: str, sandbox_id: str) -> Dict[str, Any]:
    async def trace(name: str, info: Dict[str, Any]) -> None:
        if name.endswith(_SENDING):
            registry.mark_sent(url, sandbox_id)

    return {"trace": trace}
