"""The shape of a stored step that closing, exporting and the pages rely on.

A step's ``observation`` and ``model_call`` are client JSON, but the close (resource
totals), the export and the episode page read some keys of them as numbers and stream
records. One malformed step (``{"observation": {"stdout": "str"}}``) used to make its
episode impossible to close, so every step is checked on append and on import against
exactly what those readers need; everything else in the JSON stays free-form. Steps
stored before the check are tolerated by the readers (``step_problem`` on read).
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

from apps.core import jsonsafe

STREAMS = ("stdout", "stderr")
ENCODINGS = ("utf-8", "base64")
USAGE_NUMBERS = ("wall_s", "user_cpu_s", "sys_cpu_s", "started_at", "ended_at")
USAGE_COUNTS = ("max_rss_kb",)
MODEL_CALL_COUNTS = ("tokens_in", "tokens_out")
MODEL_CALL_NUMBERS = ("latency_s",)
# Client fields stored as JSON or text: a NUL in any of them cannot be stored.
JSON_FIELDS = ("action", "request", "observation", "shown", "model_call", "diff")

Problem = tuple[str, str]  # (field path, message)


def _number(value: Any) -> bool:
    """A finite JSON number (not a bool): what float() and jsonb both take."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _numbers(
    data: dict[str, Any], where: str, names: tuple[str, ...], check: Any
) -> Problem | None:
    for name in names:
        value = data.get(name)
        if value is not None and not check(value):
            kind = "a whole number ≥ 0" if check is _count else "a finite number"
            return f"{where}.{name}", f"must be {kind} or null"
    return None


def stream_problem(meta: Any, where: str) -> Problem | None:
    """A stdout/stderr record as the agent writes it (``head``, ``tail``,
    ``encoding``, ``total_bytes``, ``sha256``, ``truncated``); each key optional."""
    if not isinstance(meta, dict):
        return where, "must be a stream record object ({head, tail, encoding, total_bytes…})"
    for name in ("head", "tail", "sha256"):
        if name in meta and not isinstance(meta[name], str):
            return f"{where}.{name}", "must be a string"
    encoding = meta.get("encoding", "utf-8")
    if encoding not in ENCODINGS:
        return f"{where}.encoding", f"must be one of {', '.join(ENCODINGS)}"
    if encoding == "base64":
        for name in ("head", "tail"):
            try:
                base64.b64decode(meta.get(name, ""), validate=True)
            except (binascii.Error, ValueError):
                return f"{where}.{name}", "must be base64 (encoding is base64)"
    if "total_bytes" in meta and not _count(meta["total_bytes"]):
        return f"{where}.total_bytes", "must be a whole number ≥ 0"
    if "truncated" in meta and not isinstance(meta["truncated"], bool):
        return f"{where}.truncated", "must be true or false"
    return None


def observation_problem(observation: Any, where: str = "observation") -> Problem | None:
    if observation is None:
        return None
    if not isinstance(observation, dict):
        return where, "must be an object"
    for name in STREAMS:
        if observation.get(name) is not None:
            problem = stream_problem(observation[name], f"{where}.{name}")
            if problem:
                return problem
    usage = observation.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            return f"{where}.usage", "must be an object"
        problem = _numbers(usage, f"{where}.usage", USAGE_NUMBERS, _number) or _numbers(
            usage, f"{where}.usage", USAGE_COUNTS, _count
        )
        if problem:
            return problem
    error = observation.get("error")
    if error is not None and not isinstance(error, dict):
        return f"{where}.error", "must be an object ({code, message}) or null"
    return None


def model_call_problem(model_call: Any, where: str = "model_call") -> Problem | None:
    if model_call is None:
        return None
    if not isinstance(model_call, dict):
        return where, "must be an object"
    return _numbers(model_call, where, MODEL_CALL_COUNTS, _count) or _numbers(
        model_call, where, MODEL_CALL_NUMBERS, _number
    )


def step_problem(fields: dict[str, Any]) -> Problem | None:
    """The first problem of a step's client fields (``action``, ``observation``,
    ``model_call``, ``duration_s``…), or None. A NUL anywhere is one."""
    for name in JSON_FIELDS:
        where = jsonsafe.nul_path(fields.get(name), name)
        if where is not None:
            return where, "contains a NUL character, which cannot be stored"
    duration = fields.get("duration_s")
    if duration is not None and not (_number(duration) and duration >= 0):
        return "duration_s", "must be a finite number ≥ 0 or null"
    return observation_problem(fields.get("observation")) or model_call_problem(
        fields.get("model_call")
    )
