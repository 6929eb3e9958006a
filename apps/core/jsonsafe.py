"""What Postgres can store: no NUL character in jsonb or text.

Postgres refuses ``\\u0000`` in ``jsonb`` and NUL in ``text``, so a value holding one
fails its INSERT/UPDATE (a 500 that used to leave an exec ``running``). Two rules:

* client input (argv, env, cwd, a step's action…) with a NUL is a typed 400
  (``nul_path`` names the first offending place; argv cannot carry NUL to execve anyway);
* command output is bytes and must survive exactly: a stream record whose text holds a
  NUL is stored base64 (``stream_record``), as invalid UTF-8 already is.
"""

from __future__ import annotations

import base64
from typing import Any

from apps.core.errors import ValidationFailed

NUL = "\x00"


def nul_path(value: Any, path: str = "") -> str | None:
    """The path (``command[1]``, ``env.KEY``, ``observation.text``) of the first string,
    dict key included, that holds a NUL; None when there is none. Iterative: a deeply
    nested value cannot exhaust the stack."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if NUL in item:
                return where
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                sub = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and NUL in key:
                    return where or sub.replace(NUL, "\\0")
                stack.append((child, sub))
        elif isinstance(item, list | tuple):
            for i in range(len(item) - 1, -1, -1):
                stack.append((item[i], f"{where}[{i}]"))
    return None


def require_no_nul(value: Any, field: str) -> None:
    """400 ``validation_error`` (reason ``null_characters_not_allowed``, as DRF's own
    CharField says it) naming where the NUL is."""
    where = nul_path(value, field)
    if where is not None:
        raise ValidationFailed(
            f"{where} contains a NUL character, which is not allowed",
            field=where,
            extra={"reason": "null_characters_not_allowed"},
        )


def stream_record(meta: Any) -> Any:
    """An exec stream record (``head``/``tail``/``encoding``…) that Postgres can store
    and that still holds exactly the bytes the command wrote: text with a NUL is
    re-encoded base64 (agents before this rule sent it as ``utf-8``)."""
    if not isinstance(meta, dict) or meta.get("encoding") == "base64":
        return meta
    head, tail = meta.get("head", ""), meta.get("tail", "")
    if not (isinstance(head, str) and isinstance(tail, str)) or NUL not in head + tail:
        return meta
    return {
        **meta,
        "head": base64.b64encode(head.encode("utf-8")).decode("ascii"),
        "tail": base64.b64encode(tail.encode("utf-8")).decode("ascii"),
        "encoding": "base64",
    }


def text(value: Any) -> Any:
    """A human-readable message (an error's ``message``) with NUL shown as ``\\0``."""
    return value.replace(NUL, "\\0") if isinstance(value, str) else value
