"""Input checks at the edge, shared by every endpoint (docs/security.md "Input limits").

Two kinds of input can never be stored or passed on and used to surface as 500s deep
inside a view: text that is not valid Unicode scalar values (a lone surrogate such as
``"\\ud800"`` in JSON cannot be encoded as UTF-8 for Postgres or a sandbox's argv), and
JSON nested so deeply that the parser, or any recursive code after it, runs out of
stack. Every JSON body is parsed by ``json_loads`` below (DRF's parser, the Orchard
views, the exec fast path, JSONL import), and every query string and URL path is
checked for NUL by ``controlplane.middleware.InputGuardMiddleware``.

NUL *inside* JSON strings is not refused here: it is valid JSON, and command output and
steps carry it (they store it escaped); a NUL where it cannot go (argv, env) is refused
by the exec validation.
"""

from __future__ import annotations

import json
import re
from typing import Any

from apps.core.errors import ApiError

# Deeper than any real request (a step's observation or a label map is a few levels):
# recursive validation and jsonb both stay far from their limits.
MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


class InvalidText(ApiError):
    """Text that cannot be stored: a lone surrogate, or NUL where no NUL can go."""

    code = "invalid_text"


class JsonTooDeep(ApiError):
    code = "json_too_deep"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")  # NaN/Infinity, as DRF's strict parser


def json_loads(raw: bytes | str) -> Any:
    """Strict JSON (no NaN/Infinity), at most MAX_JSON_DEPTH levels, no lone surrogates.

    Raises ``ApiError`` ``malformed_request`` (not JSON), ``json_too_deep`` or
    ``invalid_text`` (with the field's dotted path), all 400s."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise JsonTooDeep(f"JSON is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(f"not valid JSON: {exc}", code="malformed_request") from None
    check_json(data)
    return data


def check_json(data: Any) -> None:
    """Walks parsed JSON iteratively (no recursion of its own): depth and strings."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            check_text(value, where)
        elif isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise JsonTooDeep(f"JSON is nested deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(value, dict):
                for key, item in value.items():
                    name = f"{where}.{key}" if where else str(key)
                    check_text(key, name)
                    stack.append((item, depth + 1, name))
            else:
                for i, item in enumerate(value):
                    stack.append((item, depth + 1, f"{where}[{i}]" if where else f"[{i}]"))


def check_text(value: str, field: str | None, *, nul: bool = False) -> None:
    """Lone surrogates are never valid; with ``nul``, NUL is refused too."""
    field = _SURROGATE.sub("\ufffd", field) if field else field  # it is echoed back
    if _SURROGATE.search(value):
        raise InvalidText(
            f"{field or 'text'} contains a lone UTF-16 surrogate (not valid Unicode)",
            field=field or None,
        )
    if nul and "\x00" in value:
        raise InvalidText(f"{field or 'text'} contains a NUL byte", field=field or None)
