"""Transfers yield to short execs (apps/sandboxes/api/transfer_gate.py): a transfer's
next piece waits while a short exec is in flight in the process, never longer than
its bound, and not at all when none is (or only long execs are)."""

from __future__ import annotations

import asyncio

import pytest

from apps.sandboxes.api import transfer_gate
from apps.sandboxes.api.transfer_gate import MIB, Paced, short_in_flight, short_work, turn

pytestmark = pytest.mark.timeout(30)


async def test_a_transfer_piece_waits_for_the_short_exec_in_flight(settings):
    settings.HEDGEROW_TRANSFER_YIELD_MS = 10**7  # a bound that never ends this test
    order: list[str] = []
    answered = asyncio.Event()

    async def short_exec() -> None:
        with short_work():
            await answered.wait()
            order.append("short exec answered")

    async def transfer() -> None:
        await turn(MIB)
        order.append("transfer piece")

    execs = asyncio.create_task(short_exec())
    await asyncio.sleep(0)  # the exec is in flight (its task ran to its wait)
    assert short_in_flight() == 1
    piece = asyncio.create_task(transfer())
    for _ in range(5):  # the transfer is scheduled again and again: it must not pass
        await asyncio.sleep(0)
    assert order == [] and not piece.done()
    answered.set()
    await asyncio.gather(execs, piece)
    assert order == ["short exec answered", "transfer piece"]
    assert short_in_flight() == 0


async def test_the_wait_is_bounded_so_a_transfer_is_never_starved(settings):
    settings.HEDGEROW_TRANSFER_YIELD_MS = 1.0  # 1 ms per MiB
    with short_work():
        paced = Paced()
        for _ in range(64):  # 64 pieces of 64 KiB: four turns of 1 MiB, each bounded
            await paced.moved(64 * 1024)
        assert short_in_flight() == 1  # the short exec never ended: the bound did
    assert short_in_flight() == 0


async def test_no_wait_without_short_work_or_with_the_gate_off(settings):
    settings.HEDGEROW_TRANSFER_YIELD_MS = 10**7
    with short_work(False):  # a long exec does not hold transfers back
        assert short_in_flight() == 0
        await asyncio.wait_for(turn(MIB), timeout=10)
    settings.HEDGEROW_TRANSFER_YIELD_MS = 0
    with short_work():
        await asyncio.wait_for(turn(MIB), timeout=10)
    before = transfer_gate._gate.waited_s
    settings.HEDGEROW_TRANSFER_YIELD_MS = 10**7
    await asyncio.wait_for(turn(MIB), timeout=10)
    assert transfer_gate._gate.waited_s == before  # nothing in flight: not even a wait
