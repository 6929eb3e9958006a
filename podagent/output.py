"""Bounded capture of one output stream.

Memory is bounded by the window whatever the command prints: the first half
of the window is kept as `head`, a rolling last half as `tail`, and only the
byte count and a running sha256 cover the whole stream.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any, Dict


class StreamCapture:
    __slots__ = ("_half", "_hash", "_head", "_tail", "total")

    def __init__(self, window: int) -> None:
        self._half = max(window // 2, 1)
        self._head = bytearray()
        self._tail = bytearray()
        self._hash = hashlib.sha256()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        self._hash.update(data)
        room = self._half - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
            if not data:
                return
        if len(data) >= self._half:
            self._tail = bytearray(data[-self._half :])
        else:
            self._tail += data
            excess = len(self._tail) - self._half
            if excess > 0:
                # CPython trims a bytearray's front in O(1) (it moves ob_start).
                del self._tail[:excess]

    def result(self) -> Dict[str, Any]:
        head = bytes(self._head)
        tail = bytes(self._tail)
        truncated = self.total > len(head) + len(tail)
        if not truncated and tail:
            # Everything fits in the window: head holds the whole stream.
            head, tail = head + tail, b""
        # A NUL is valid UTF-8 but cannot be stored in the control plane's jsonb:
        # base64 keeps those bytes exact, like any other output that is not text.
        head_s = tail_s = None
        if b"\x00" not in head and b"\x00" not in tail:
            try:
                head_s, tail_s = head.decode("utf-8"), tail.decode("utf-8")
            except UnicodeDecodeError:
                pass
        encoding = "utf-8"
        if head_s is None or tail_s is None:
            head_s = base64.b64encode(head).decode("ascii")
            tail_s = base64.b64encode(tail).decode("ascii")
            encoding = "base64"
        return {
            "head": head_s,
            "tail": tail_s,
            "encoding": encoding,
            "total_bytes": self.total,
            "sha256": self._hash.hexdigest(),
            "truncated": truncated,
        }
