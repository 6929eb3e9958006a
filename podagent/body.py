"""Request body reader: Content-Length or chunked transfer encoding, streamed."""

from __future__ import annotations

from typing import BinaryIO, List, Optional

from .errors import ApiError, bad_request

MAX_CHUNK_LINE = 1024


class BodyReader:
    def __init__(self, rfile: BinaryIO, length: Optional[int], chunked: bool) -> None:
        self._rfile = rfile
        self._chunked = chunked
        self._left = 0 if chunked else (length or 0)
        self.length = None if chunked else (length or 0)
        self.finished = not chunked and self._left == 0

    def _next_chunk(self) -> None:
        line = self._rfile.readline(MAX_CHUNK_LINE)
        if not line.endswith(b"\n"):
            raise bad_request("malformed chunked body")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise bad_request("malformed chunk size") from None
        if size < 0:
            raise bad_request("malformed chunk size")
        if size == 0:
            # Trailers end with an empty line.
            while True:
                trailer = self._rfile.readline(MAX_CHUNK_LINE)
                if trailer in (b"\r\n", b"\n", b""):
                    break
            self.finished = True
        self._left = size

    def read(self, n: int) -> bytes:
        if self.finished:
            return b""
        if self._chunked and self._left == 0:
            self._next_chunk()
            if self.finished:
                return b""
        data = self._rfile.read(min(n, self._left))
        if not data:
            raise ApiError(400, "bad_request", "request body ended early")
        self._left -= len(data)
        if self._left == 0:
            if self._chunked:
                if self._rfile.readline(MAX_CHUNK_LINE) not in (b"\r\n", b"\n"):
                    raise bad_request("malformed chunked body")
            else:
                self.finished = True
        return data

    def read_all(self, limit: int) -> bytes:
        if self.length is not None and self.length > limit:
            raise ApiError(413, "too_large", f"body exceeds {limit} bytes")
        parts: List[bytes] = []
        total = 0
        while True:
            chunk = self.read(65536)
            if not chunk:
                return b"".join(parts)
            total += len(chunk)
            if total > limit:
                raise ApiError(413, "too_large", f"body exceeds {limit} bytes")
            parts.append(chunk)
