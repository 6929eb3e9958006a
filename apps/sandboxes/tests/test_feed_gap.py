"""A subscriber that falls behind the replay window (services/replay.py) gets one
``exec.gap`` frame saying exactly what it skipped, per stream, in bytes and lines
(consumers/feeds.py): the browser's "N lines omitted" was short by the frames a slow
websocket never got (issue 18). Real Redis; the feed is driven frame by frame, so
"slow" is deterministic: its group messages stop arriving while frames are stored."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from apps.core.redis_sync import redis_client
from apps.sandboxes.consumers.feeds import OperationFeed, OperationRef, new_redis
from apps.sandboxes.services import replay

WINDOW = 8


@pytest.fixture
def pk(settings: Any) -> Iterator[str]:
    settings.HEDGEROW_STREAM_REPLAY_FRAMES = WINDOW
    settings.HEDGEROW_STREAM_REPLAY_MAX_BYTES = 1024 * 1024
    settings.HEDGEROW_STREAM_REPLAY_TTL_S = 60
    key = str(uuid.uuid4())
    yield key
    redis_client().delete(replay.frames_key(key), replay.bytes_key(key))


def _frames(count: int) -> list[dict[str, Any]]:
    """A start frame, then output frames of both streams, of several lines each, some
    ending mid-line (a line split across frames counts once, at its newline)."""
    frames: list[dict[str, Any]] = [{"type": "exec.start", "seq": 0, "pid": 42}]
    for seq in range(1, count):
        kind = "stderr" if seq % 3 == 0 else "stdout"
        text = "".join(f"line {seq}.{i}\n" for i in range(seq % 5)) + ("tail-" if seq % 2 else "")
        frames.append(
            {"type": f"exec.{kind}", "seq": seq, "data": base64.b64encode(text.encode()).decode()}
        )
    return frames


def _store(pk: str, frame: dict[str, Any]) -> tuple[str, str, str]:
    data = json.dumps(frame)
    totals = replay.append(redis_client(), pk, frame, data)
    assert totals is not None
    return data, *totals


def _count(frames: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    counts = {name: {"bytes": 0, "lines": 0} for name in replay.STREAMS}
    for frame in frames:
        if frame["type"] in ("exec.stdout", "exec.stderr"):
            raw = base64.b64decode(frame["data"])
            counts[frame["type"][5:]]["bytes"] += len(raw)
            counts[frame["type"][5:]]["lines"] += raw.count(b"\n")
    return counts


async def _feed(pk: str, after_seq: int, sent: list[dict[str, Any]]) -> OperationFeed:
    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def on_done(_feed: OperationFeed) -> None:
        raise AssertionError("no exit frame was stored")

    return OperationFeed(
        ref=OperationRef(pk, "sb-gap", "op-gap"),
        after_seq=after_seq,
        send=send,
        redis=new_redis(),
        on_done=on_done,
    )


async def test_a_subscriber_that_falls_behind_is_told_exactly_what_it_skipped(pk: str) -> None:
    frames = _frames(30)
    sent: list[dict[str, Any]] = []
    feed = await _feed(pk, -1, sent)
    try:
        for frame in frames[:4]:  # live: each stored frame's group message arrives
            await feed.on_group_frame(*_store(pk, frame))
        for frame in frames[4:29]:  # behind: stored, their group messages lost
            _store(pk, frame)
        await feed.on_group_frame(*_store(pk, frames[29]))  # the next one arrives
    finally:
        await feed.redis.aclose()
    kept_from = 30 - WINDOW
    assert [m["seq"] for m in sent[:4]] == [0, 1, 2, 3]
    gap = sent[4]
    assert gap == {
        "type": "exec.gap",
        "sandbox_id": "sb-gap",
        "operation_id": "op-gap",
        "from_seq": 4,
        "to_seq": kept_from - 1,
        "skipped": _count(frames[4:kept_from]),
    }
    assert gap["skipped"]["stdout"]["lines"] > 0 and gap["skipped"]["stderr"]["bytes"] > 0
    assert [m["seq"] for m in sent[5:]] == list(range(kept_from, 30))
    # what was sent plus what was skipped is the whole output, to the line
    received = [m for m in sent if m["type"] != "exec.gap"]
    whole, got = _count(frames), _count(received)
    for name in replay.STREAMS:
        for unit in ("bytes", "lines"):
            assert got[name][unit] + gap["skipped"][name][unit] == whole[name][unit]


async def test_a_subscriber_from_the_start_is_told_the_dropped_head(pk: str) -> None:
    frames = _frames(20)
    for frame in frames:
        _store(pk, frame)
    sent: list[dict[str, Any]] = []
    feed = await _feed(pk, -1, sent)
    try:
        await feed.catch_up()
    finally:
        await feed.redis.aclose()
    assert sent[0]["from_seq"] == 0 and sent[0]["to_seq"] == 20 - WINDOW - 1
    assert sent[0]["skipped"] == _count(frames[: 20 - WINDOW])
    assert [m["seq"] for m in sent[1:]] == list(range(20 - WINDOW, 20))


async def test_a_resubscribe_counts_from_its_last_frame_when_the_buffer_has_it(pk: str) -> None:
    frames = _frames(30)
    for frame in frames[:14]:
        _store(pk, frame)
    sent: list[dict[str, Any]] = []
    # came back after seq 9 (kept: 6..13): its totals are read from the buffer
    feed = await _feed(pk, 9, sent)
    try:
        await feed.catch_up()
        assert [m["seq"] for m in sent] == [10, 11, 12, 13]
        for frame in frames[14:]:  # then 16 frames go by unseen: 22..29 are kept
            _store(pk, frame)
        sent.clear()
        await feed.catch_up()
    finally:
        await feed.redis.aclose()
    assert sent[0]["type"] == "exec.gap" and (sent[0]["from_seq"], sent[0]["to_seq"]) == (14, 21)
    assert sent[0]["skipped"] == _count(frames[14:22])
    assert [m["seq"] for m in sent[1:]] == list(range(22, 30))


async def test_a_resubscribe_whose_last_frame_is_gone_names_the_gap_without_a_size(
    pk: str,
) -> None:
    frames = _frames(20)
    for frame in frames:
        _store(pk, frame)
    sent: list[dict[str, Any]] = []
    feed = await _feed(pk, 3, sent)  # 3 is long gone (kept: 12..19): its totals unknown
    try:
        await feed.catch_up()
    finally:
        await feed.redis.aclose()
    assert sent[0] == {
        "type": "exec.gap",
        "sandbox_id": "sb-gap",
        "operation_id": "op-gap",
        "from_seq": 4,
        "to_seq": 11,
    }
    assert [m["seq"] for m in sent[1:]] == list(range(12, 20))
