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
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings

# KEYS: stream, byte counter. ARGV: entry id, frame JSON, max bytes, max frames, ttl.
# Returns 1 when appended, 0 when the id is at or below the top (already stored); any
# other error (Redis out of memory with nothing evictable) is raised, never swallowed.
_APPEND_LUA = """
local ok = redis.pcall('XADD', KEYS[1], ARGV[1], 'f', ARGV[2])
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
return 1
"""


def frames_key(operation_pk: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}opstream:{operation_pk}"


def bytes_key(operation_pk: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}opstreambytes:{operation_pk}"


def _args(operation_pk: str, seq: int, data: str) -> tuple[list[str], list[Any]]:
    keys = [frames_key(operation_pk), bytes_key(operation_pk)]
    args: list[Any] = [
        f"0-{seq + 1}",
        data,
        settings.HEDGEROW_STREAM_REPLAY_MAX_BYTES,
        settings.HEDGEROW_STREAM_REPLAY_FRAMES,
        settings.HEDGEROW_STREAM_REPLAY_TTL_S,
    ]
    return keys, args


def append(client: redis.Redis, operation_pk: str, seq: int, data: str) -> bool:
    """Appends a frame's JSON under id ``0-<seq+1>``; False when already stored."""
    keys, args = _args(operation_pk, seq, data)
    return bool(client.register_script(_APPEND_LUA)(keys=keys, args=args))


async def append_async(client: aioredis.Redis, operation_pk: str, seq: int, data: str) -> bool:
    keys, args = _args(operation_pk, seq, data)
    return bool(await client.register_script(_APPEND_LUA)(keys=keys, args=args))
