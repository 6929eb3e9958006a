"""The replay buffer's bounds (services/replay.py) against the real Redis: bytes kept,
frames kept, TTL, duplicates refused, the byte count starting over with a stream
that expired or was evicted, and the output totals stored with each frame (what a gap
frame counts its size from)."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from apps.core.redis_sync import redis_client
from apps.sandboxes.services import replay


@pytest.fixture
def op(settings: Any) -> Iterator[str]:
    settings.HEDGEROW_STREAM_REPLAY_MAX_BYTES = 1000
    settings.HEDGEROW_STREAM_REPLAY_FRAMES = 5
    settings.HEDGEROW_STREAM_REPLAY_TTL_S = 60
    pk = str(uuid.uuid4())
    yield pk
    redis_client().delete(replay.frames_key(pk), replay.bytes_key(pk))


def _frame(seq: int, size: int) -> str:
    return json.dumps({"type": "exec.stdout", "seq": seq, "data": "x" * size})


def _add(client: Any, op: str, seq: int, size: int) -> replay.Totals | None:
    return replay.append(client, op, json.loads(_frame(seq, size)), _frame(seq, size))


def _kept(pk: str) -> list[tuple[int, int]]:
    client: Any = redis_client()
    return [
        (json.loads(fields[b"f"])["seq"], len(fields[b"f"]))
        for _id, fields in client.xrange(replay.frames_key(pk))
    ]


def test_it_keeps_the_newest_frames_within_the_byte_bound(op: str) -> None:
    client: Any = redis_client()
    for seq in range(4):
        assert _add(client, op, seq, 250)
    kept = _kept(op)
    assert [seq for seq, _ in kept] == [1, 2, 3]  # 4 x ~295 bytes > 1000: the oldest went
    assert int(client.get(replay.bytes_key(op))) == sum(size for _, size in kept) <= 1000
    for key in (replay.frames_key(op), replay.bytes_key(op)):
        assert 0 < client.ttl(key) <= 60


def test_it_keeps_at_most_the_frame_bound_and_refuses_duplicates(op: str) -> None:
    client: Any = redis_client()
    for seq in range(8):
        assert _add(client, op, seq, 1)
    assert [seq for seq, _ in _kept(op)] == [3, 4, 5, 6, 7]
    assert not _add(client, op, 7, 1)  # already stored
    assert not _add(client, op, 2, 1)  # below the top
    assert [seq for seq, _ in _kept(op)] == [3, 4, 5, 6, 7]


def test_a_single_frame_over_the_bound_is_kept_alone(op: str) -> None:
    client: Any = redis_client()
    assert _add(client, op, 0, 10)
    assert _add(client, op, 1, 5000)
    assert [seq for seq, _ in _kept(op)] == [1]


def test_the_byte_count_starts_over_when_the_stream_is_gone(op: str) -> None:
    client: Any = redis_client()
    for seq in range(3):
        _add(client, op, seq, 250)
    client.delete(replay.frames_key(op))  # expired or evicted without its counter
    assert _add(client, op, 3, 300)
    assert _add(client, op, 4, 300)
    assert [seq for seq, _ in _kept(op)] == [3, 4]  # not trimmed by a stale count
    assert int(client.get(replay.bytes_key(op))) == sum(size for _, size in _kept(op))


def _output(seq: int, kind: str, text: bytes) -> tuple[dict[str, Any], str]:
    frame = {"type": f"exec.{kind}", "seq": seq, "data": base64.b64encode(text).decode()}
    return frame, json.dumps(frame)


def test_each_frame_carries_the_output_totals_before_and_after_it(op: str) -> None:
    client: Any = redis_client()
    start = {"type": "exec.start", "seq": 0, "pid": 7}
    assert replay.append(client, op, start, json.dumps(start)) == ("0 0 0 0", "0 0 0 0")
    assert replay.append(client, op, *_output(1, "stdout", b"a\nbb\n")) == (
        "0 0 0 0",
        "5 2 0 0",
    )
    assert replay.append(client, op, *_output(2, "stderr", b"oops")) == ("5 2 0 0", "5 2 4 0")
    assert replay.append(client, op, *_output(1, "stdout", b"a\nbb\n")) is None  # counted once
    assert replay.append(client, op, *_output(3, "stdout", b"\n")) == ("5 2 4 0", "6 3 4 0")
    stored = [
        (fields[b"b"].decode(), fields[b"a"].decode())
        for _id, fields in client.xrange(replay.frames_key(op))
    ]
    assert stored[-1] == ("5 2 4 0", "6 3 4 0")
    assert replay.skipped("5 2 0 0", "6 3 4 0") == {
        "stdout": {"bytes": 1, "lines": 1},
        "stderr": {"bytes": 4, "lines": 0},
    }
    assert replay.skipped("6 3 4 0", "0 0 0 0") is None  # started over: size unknown


def test_a_frame_that_is_not_output_counts_nothing() -> None:
    assert replay.output_counts({"type": "exec.start", "seq": 0}) == (0, 0, 0)
    assert replay.output_counts({"type": "exec.stdout", "seq": 1, "data": "!!"}) == (0, 0, 0)
    data = base64.b64encode(b"x\ny\n").decode()
    assert replay.output_counts({"type": "exec.stderr", "seq": 1, "data": data}) == (2, 4, 2)


def test_the_totals_start_over_with_a_stream_that_is_gone(op: str) -> None:
    client: Any = redis_client()
    assert replay.append(client, op, *_output(0, "stdout", b"a\n")) == ("0 0 0 0", "2 1 0 0")
    client.delete(replay.frames_key(op))  # expired or evicted
    assert replay.append(client, op, *_output(1, "stdout", b"b\n")) == ("0 0 0 0", "2 1 0 0")
