"""The replay buffer's bounds (services/replay.py) against the real Redis: bytes kept,
frames kept, TTL, duplicates refused, and the byte count starting over with a stream
that expired or was evicted."""

from __future__ import annotations

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


def _kept(pk: str) -> list[tuple[int, int]]:
    client: Any = redis_client()
    return [
        (json.loads(fields[b"f"])["seq"], len(fields[b"f"]))
        for _id, fields in client.xrange(replay.frames_key(pk))
    ]


def test_it_keeps_the_newest_frames_within_the_byte_bound(op: str) -> None:
    client: Any = redis_client()
    for seq in range(4):
        assert replay.append(client, op, seq, _frame(seq, 250))
    kept = _kept(op)
    assert [seq for seq, _ in kept] == [1, 2, 3]  # 4 x ~295 bytes > 1000: the oldest went
    assert int(client.get(replay.bytes_key(op))) == sum(size for _, size in kept) <= 1000
    for key in (replay.frames_key(op), replay.bytes_key(op)):
        assert 0 < client.ttl(key) <= 60


def test_it_keeps_at_most_the_frame_bound_and_refuses_duplicates(op: str) -> None:
    client: Any = redis_client()
    for seq in range(8):
        assert replay.append(client, op, seq, _frame(seq, 1))
    assert [seq for seq, _ in _kept(op)] == [3, 4, 5, 6, 7]
    assert not replay.append(client, op, 7, _frame(7, 1))  # already stored
    assert not replay.append(client, op, 2, _frame(2, 1))  # below the top
    assert [seq for seq, _ in _kept(op)] == [3, 4, 5, 6, 7]


def test_a_single_frame_over_the_bound_is_kept_alone(op: str) -> None:
    client: Any = redis_client()
    assert replay.append(client, op, 0, _frame(0, 10))
    assert replay.append(client, op, 1, _frame(1, 5000))
    assert [seq for seq, _ in _kept(op)] == [1]


def test_the_byte_count_starts_over_when_the_stream_is_gone(op: str) -> None:
    client: Any = redis_client()
    for seq in range(3):
        replay.append(client, op, seq, _frame(seq, 250))
    client.delete(replay.frames_key(op))  # expired or evicted without its counter
    assert replay.append(client, op, 3, _frame(3, 300))
    assert replay.append(client, op, 4, _frame(4, 300))
    assert [seq for seq, _ in _kept(op)] == [3, 4]  # not trimmed by a stale count
    assert int(client.get(replay.bytes_key(op))) == sum(size for _, size in _kept(op))
