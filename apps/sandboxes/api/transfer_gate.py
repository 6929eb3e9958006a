"""Transfers yield to short execs in the web process (issue 17 goal 4): a file
transfer's next piece waits while a short exec is in flight on this process's event
loop, for at most ``HEDGEROW_TRANSFER_YIELD_MS`` per MiB moved (50 by default, 0: off;
docs/benchmarks.md has the A/Bs), so a transfer is never starved: with short execs
always in flight it still moves 1 MiB per that many milliseconds (plus its own time),
and with none it is not slowed at all.

Why: on 2 cores the bytes of a 200 MiB transfer are copied by the web worker's loop,
the agent and the client at the same CPU priority as everything a short exec needs.
Pausing a transfer's piece pauses the whole chain by backpressure (the server stops
reading the client's upload, the agent's download waits in its socket), which gives
those cores to the short execs while they run.

Per process and loop-local: uvicorn runs one event loop per worker process. The
short-exec side is a counter (``short_work``) the exec fast path holds around a short
exec (``exec_kind`` "exec"); the transfer side awaits ``turn``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from django.conf import settings

MIB = 1 << 20


class _Gate:
    def __init__(self) -> None:
        self.short = 0
        self.clear: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.waited_s = 0.0  # what transfers waited in all (a figure for the lab notes)

    def event(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self.clear is None or self.loop is not loop:  # an Event is bound to one loop
            self.clear, self.loop = asyncio.Event(), loop
            if self.short == 0:
                self.clear.set()
        return self.clear


_gate = _Gate()


@contextlib.contextmanager
def short_work(short: bool = True) -> Iterator[None]:
    """Held (on the event loop) while a short exec is in flight; ``short`` False: a
    no-op (a long exec does not hold transfers back)."""
    if not short:
        yield
        return
    _gate.short += 1
    if _gate.clear is not None:
        _gate.clear.clear()
    try:
        yield
    finally:
        _gate.short -= 1
        if _gate.short == 0 and _gate.clear is not None:
            _gate.clear.set()


def short_in_flight() -> int:
    return _gate.short


async def turn(nbytes: int) -> None:
    """Before a transfer moves its next ``nbytes``: waits while short execs are in
    flight, at most ``HEDGEROW_TRANSFER_YIELD_MS`` per MiB of ``nbytes`` (0: never)."""
    per_mib_ms = float(settings.HEDGEROW_TRANSFER_YIELD_MS)
    if _gate.short == 0 or per_mib_ms <= 0 or nbytes <= 0:
        return
    bound = per_mib_ms / 1000 * nbytes / MIB
    loop = asyncio.get_running_loop()
    started = loop.time()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(bound):
            await _gate.event().wait()
    _gate.waited_s += loop.time() - started


class Paced:
    """A transfer's byte count between turns: ``await paced.moved(n)`` after each
    piece takes a turn once a MiB or more has gone since the last one (an upload's
    pieces are as small as the server hands them over, ~64 KiB)."""

    def __init__(self) -> None:
        self.pending = 0

    async def moved(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= MIB:
            pending, self.pending = self.pending, 0
            await turn(pending)
