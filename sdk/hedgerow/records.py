"""Typed records for what file and key calls return. Each keeps the server's JSON in
``raw``; ``record["field"]`` and ``record.get("field")`` still read it, so code written
against the dicts earlier releases returned keeps working (docs/sdk.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


class _Raw:
    raw: Dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)


@dataclass(frozen=True)
class FileInfo(_Raw):
    """One file system entry (``stat``, ``list_files``). ``type``: file, directory,
    symlink or other; ``size`` in bytes (a symlink's: its text's); ``mode`` octal text
    (``"0755"``); ``modified``: seconds since the epoch; ``target``: a symlink's text.
    Symlinks are not followed."""

    name: str
    path: str
    type: str
    size: int
    mode: str
    modified: float
    target: Optional[str]
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_api(cls, body: Dict[str, Any]) -> FileInfo:
        return cls(
            name=str(body.get("name", "")),
            path=str(body.get("path", "")),
            type=str(body.get("type", "")),
            size=int(body.get("size") or 0),
            mode=str(body.get("mode", "")),
            modified=float(body.get("modified") or 0.0),
            target=body.get("target"),
            raw=body,
        )


@dataclass(frozen=True)
class FilePage(_Raw):
    """One page of a directory listing, sorted by name; ``next_cursor`` is None on the
    last page."""

    path: str
    entries: List[FileInfo]
    next_cursor: Optional[str]
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_api(cls, body: Dict[str, Any]) -> FilePage:
        return cls(
            path=str(body.get("path", "")),
            entries=[FileInfo.from_api(e) for e in body.get("entries") or []],
            next_cursor=body.get("next_cursor"),
            raw=body,
        )


@dataclass(frozen=True)
class WrittenFile(_Raw):
    """What ``write_file`` wrote: ``size`` in bytes and the content's ``sha256`` (hex)."""

    path: str
    size: int
    sha256: str
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_api(cls, body: Dict[str, Any]) -> WrittenFile:
        return cls(
            path=str(body.get("path", "")),
            size=int(body.get("size") or 0),
            sha256=str(body.get("sha256", "")),
            raw=body,
        )


@dataclass(frozen=True)
class ApiKeyInfo(_Raw):
    """An API key. ``secret`` is set only on the record ``create_key`` returns (it is
    shown once, never stored in clear); times are ISO 8601 text (UTC) or None."""

    id: str
    name: str
    prefix: str
    scopes: List[str]
    created_at: Optional[str]
    expires_at: Optional[str]
    revoked_at: Optional[str]
    last_used_at: Optional[str]
    secret: Optional[str] = field(default=None, repr=False)
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @classmethod
    def from_api(cls, body: Dict[str, Any]) -> ApiKeyInfo:
        return cls(
            id=str(body.get("id", "")),
            name=str(body.get("name", "")),
            prefix=str(body.get("prefix", "")),
            scopes=[str(s) for s in body.get("scopes") or []],
            created_at=body.get("created_at"),
            expires_at=body.get("expires_at"),
            revoked_at=body.get("revoked_at"),
            last_used_at=body.get("last_used_at"),
            secret=body.get("secret"),
            raw=body,
        )
