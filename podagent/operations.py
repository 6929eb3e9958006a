"""Operation registry: an operation id runs its command at most once.

A replay of a finished operation gets the stored result; a replay of a running
one attaches to it. While an operation runs, its frames are kept in a bounded
buffer so a streamed attach can start from seq 0 (or from the oldest frame
still held, when the command printed more than the buffer holds).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

from .runner import Control

MAX_OPERATIONS = 2000
MAX_AGE_S = 30 * 60
FRAME_BUFFER_BYTES = 4 * 1024 * 1024
# Per-frame bookkeeping counted against the buffer, so a command printing one
# byte per write cannot grow the buffer by millions of tiny frames.
FRAME_OVERHEAD = 128

# (seq, type, payload): payload is bytes for output, a dict for start/exit.
Frame = Tuple[int, str, Any]


class Operation:
    def __init__(self, op_id: str, fingerprint: str, kill_grace: float) -> None:
        self.op_id = op_id
        self.fingerprint = fingerprint
        self.kill_grace = kill_grace
        self.control = Control()
        self.cond = threading.Condition()
        self.done = threading.Event()
        self.frames: Deque[Frame] = collections.deque()
        self._frame_bytes = 0
        self.next_seq = 0
        self.result: Optional[Dict[str, Any]] = None
        self.finished_mono: Optional[float] = None
        self.created_mono = time.monotonic()
        self.attachers = 0

    def record(self, kind: str, payload: Any) -> Frame:
        with self.cond:
            frame = (self.next_seq, kind, payload)
            self.next_seq += 1
            self.frames.append(frame)
            self._frame_bytes += _cost(payload)
            while self._frame_bytes > FRAME_BUFFER_BYTES and len(self.frames) > 1:
                self._frame_bytes -= _cost(self.frames.popleft()[2])
            self.cond.notify_all()
        return frame

    def finish(self, result: Dict[str, Any]) -> Frame:
        with self.cond:
            self.result = result
            frame = (self.next_seq, "exit", result)
            self.next_seq += 1
            self.frames.append(frame)
            if not self.attachers:
                self._drop_frames()
            self.finished_mono = time.monotonic()
            self.done.set()
            self.cond.notify_all()
        return frame

    def _drop_frames(self) -> None:
        # Finished operations keep only their result; memory stays bounded by
        # MAX_OPERATIONS results, not by their output.
        self.frames.clear()
        self._frame_bytes = 0

    def attach(self) -> bool:
        """Register a streaming attacher; False when the op already finished."""
        with self.cond:
            if self.result is not None:
                return False
            self.attachers += 1
            return True

    def detach(self) -> None:
        with self.cond:
            self.attachers -= 1
            if not self.attachers and self.result is not None:
                self._drop_frames()

    def wait(self, timeout: Optional[float]) -> Optional[Dict[str, Any]]:
        self.done.wait(timeout)
        return self.result

    def frames_after(self, seq: int, timeout: float) -> Tuple[List[Frame], bool]:
        """Frames with seq >= `seq` (blocking until there is one or the op ends)."""
        with self.cond:
            while True:
                skip = max(0, seq - self.frames[0][0]) if self.frames else 0
                ready = list(itertools.islice(self.frames, skip, None))
                if ready:
                    return ready, ready[-1][1] == "exit"
                if self.result is not None:
                    return [], True
                if not self.cond.wait(timeout):
                    return [], False


def _cost(payload: Any) -> int:
    return FRAME_OVERHEAD + (len(payload) if isinstance(payload, bytes) else 0)


class Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: "collections.OrderedDict[str, Operation]" = collections.OrderedDict()

    def claim(self, op_id: str, fingerprint: str, kill_grace: float) -> Tuple[Operation, bool]:
        """Return (operation, created). Exactly one caller creates a given id."""
        with self._lock:
            op = self._ops.get(op_id)
            if op is not None:
                return op, False
            self._evict()
            op = Operation(op_id, fingerprint, kill_grace)
            self._ops[op_id] = op
            return op, True

    def get(self, op_id: str) -> Optional[Operation]:
        with self._lock:
            return self._ops.get(op_id)

    def running(self) -> int:
        with self._lock:
            return sum(1 for op in self._ops.values() if op.result is None)

    def _evict(self) -> None:
        # Insertion order is creation order, so expired entries sit at the front;
        # stop at the first one created less than MAX_AGE_S ago.
        now = time.monotonic()
        expired = []
        for op_id, op in self._ops.items():
            if now - op.created_mono <= MAX_AGE_S:
                break
            if op.finished_mono is not None and now - op.finished_mono > MAX_AGE_S:
                expired.append(op_id)
        for op_id in expired:
            del self._ops[op_id]
        need = len(self._ops) - MAX_OPERATIONS + 1
        if need <= 0:
            return
        # The oldest finished ones, found from the front: at capacity this runs on every
        # exec, and listing all 2000 entries each time cost ~0.1 ms of agent CPU.
        victims: List[str] = []
        for op_id, op in self._ops.items():
            if op.result is not None:
                victims.append(op_id)
                if len(victims) >= need:
                    break
        for op_id in victims:
            del self._ops[op_id]
