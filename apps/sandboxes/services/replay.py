"""The bounded replay buffer of one streamed operation (a Redis stream).

Bounded three ways, in one atomic script so every writer (the web process's async
pump, the thread pump, recovery in another process) shares the accounting:
- bytes: at most HEDGEROW_STREAM_REPLAY_MAX_BYTES of frame data (a running total kept
  in a companion key); beyond it the oldest frames are dropped, keeping the tail;
- frames: at most HEDGEROW_STREAM_REPLAY_FRAMES;
- time: both keys expire HEDGEROW_STREAM_REPLAY_TTL_S after the last append (never
  longer), so Redis's ``volatile-lru`` policy may also evict them under pressure.
The newest frame is always kept (it carries the stream's last seq). A subscriber that
asks for dropped frames gets an ``exec.gap`` frame naming them (consumers/feeds.py):
dropping is never silent.

The script also stores with each entry the operation's output totals before it
(``b``) and after it (``a``): stdout bytes and lines, stderr bytes and lines,
``"ob ol eb el"``, carried on from the newest entry's ``a`` (always kept). A gap's size
is then exact without the dropped frames: the next kept frame's ``b`` minus the ``a``
of the last frame the subscriber got — so the gap frame says how many bytes and lines
of each stream it skipped.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings

# KEYS: stream, byte counter. ARGV: entry id, frame JSON, max bytes, max frames, ttl,
# output stream (0 none, 1 stdout, 2 stderr), its bytes, its lines.
# Returns {totals before, totals after} when appended, 0 when the id is at or below the
# top (already stored: the totals are not counted twice); any other error (Redis out of
# memory with nothing evictable) is raised, never swallowed. A stream that expired or
# was evicted starts its totals over (a gap across that is then sized "unknown").
_APPEND_LUA = """
local before = '0 0 0 0'
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
if top then
  local fields = top[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'a' then before = fields[i + 1] end
  end
end
local t = {}
for n in string.gmatch(before, '%d+') do t[#t + 1] = tonumber(n) end
local s = tonumber(ARGV[6])
if s > 0 then
  t[2 * s - 1] = t[2 * s - 1] + tonumber(ARGV[7])
  t[2 * s] = t[2 * s] + tonumber(ARGV[8])
end
local after = string.format('%d %d %d %d', t[1], t[2], t[3], t[4])
local ok = redis.pcall('XADD', KEYS[1], ARGV[1], 'f', ARGV[2], 'b', before, 'a', after)
if type(ok) == 'table' and ok.err then
  if string.find(ok.err, 'equal or smaller', 1, true) then return 0 end
  return redis.error_reply(ok.err)
end
local cap, frames = tonumber(ARGV[3]), tonumber(ARGV[4])
local count = redis.call('XLEN', KEYS[1])
local total
if count == 1 then
  -- a new (or expired, or evicted) stream: the count starts over with it
  total = string.len(ARGV[2])
  redis.call('SET', KEYS[2], total)
else
  total = redis.call('INCRBY', KEYS[2], string.len(ARGV[2]))
end
while (total > cap or count > frames) and count > 1 do
  local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
  redis.call('XDEL', KEYS[1], first[1])
  total = redis.call('DECRBY', KEYS[2], string.len(first[2][2]))
  count = count - 1
end
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return {before, after}
"""


def frames_key(operation_pk: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}opstream:{operation_pk}"


def bytes_key(operation_pk: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}opstreambytes:{operation_pk}"


STREAMS = ("stdout", "stderr")
ZERO = "0 0 0 0"
# What one append stored: (totals before the frame, totals after it), as the script
# spells them ("ob ol eb el"); None when the frame was already stored.
Totals = tuple[str, str]


def output_counts(frame: dict[str, Any]) -> tuple[int, int, int]:
    """(stream: 0 none, 1 stdout, 2 stderr; bytes; lines) of one client frame."""
    kind = str(frame.get("type", "")).removeprefix("exec.")
    if kind not in STREAMS:
        return 0, 0, 0
    try:
        raw = base64.b64decode(str(frame.get("data", "")), validate=True)
    except (binascii.Error, ValueError):
        return 0, 0, 0
    return STREAMS.index(kind) + 1, len(raw), raw.count(b"\n")


def skipped(last_after: str, next_before: str) -> dict[str, dict[str, int]] | None:
    """What a gap left out: per stream, bytes and lines between two totals; None when
    they do not follow each other (the totals started over with a lost stream)."""
    a = [int(n) for n in last_after.split()]
    b = [int(n) for n in next_before.split()]
    if len(a) != 4 or len(b) != 4 or any(y < x for x, y in zip(a, b, strict=True)):
        return None
    return {
        name: {"bytes": b[2 * i] - a[2 * i], "lines": b[2 * i + 1] - a[2 * i + 1]}
        for i, name in enumerate(STREAMS)
    }


def _args(operation_pk: str, frame: dict[str, Any], data: str) -> tuple[list[str], list[Any]]:
    keys = [frames_key(operation_pk), bytes_key(operation_pk)]
    args: list[Any] = [
        f"0-{int(frame['seq']) + 1}",
        data,
        settings.HEDGEROW_STREAM_REPLAY_MAX_BYTES,
        settings.HEDGEROW_STREAM_REPLAY_FRAMES,
        settings.HEDGEROW_STREAM_REPLAY_TTL_S,
        *output_counts(frame),
    ]
    return keys, args


def _totals(reply: Any) -> Totals | None:
    if not reply:
        return None
    before, after = (v.decode() if isinstance(v, bytes) else str(v) for v in reply)
    return before, after


def append(
    client: redis.Redis, operation_pk: str, frame: dict[str, Any], data: str
) -> Totals | None:
    """Appends a frame (``data``: its JSON) under id ``0-<seq+1>``; None when already
    stored, else the output totals before and after it."""
    keys, args = _args(operation_pk, frame, data)
    return _totals(client.register_script(_APPEND_LUA)(keys=keys, args=args))


async def append_async(
    client: aioredis.Redis, operation_pk: str, frame: dict[str, Any], data: str
) -> Totals | None:
    keys, args = _args(operation_pk, frame, data)
    return _totals(await client.register_script(_APPEND_LUA)(keys=keys, args=args))
