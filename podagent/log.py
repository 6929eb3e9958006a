"""JSON-lines log file. Request lines never go to stderr: per-request stderr
writes are costly and nobody reads the agent's stderr inside a sandbox."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import IO, Any, Optional

# json.dumps with any non-default argument builds a new encoder on every call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)


class JsonLog:
    def __init__(self, path: Optional[str]) -> None:
        self._lock = threading.Lock()
        self._fh: Optional[IO[str]] = None
        if path == "/dev/stdout":
            # the inherited fd itself: reopening /dev/stdout would check the host-side
            # log file's owner (host root) against the agent's unprivileged uid
            self._fh = os.fdopen(os.dup(1), "a", buffering=1, encoding="utf-8")
        elif path:
            self._fh = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    @property
    def enabled(self) -> bool:
        return self._fh is not None

    def write(self, event: str, **fields: Any) -> None:
        if self._fh is None:
            return
        fields["ts"] = round(time.time(), 6)
        fields["event"] = event
        line = _ENCODER.encode(fields)
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._fh.write(line + "\n")
