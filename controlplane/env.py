"""Tiny typed readers for settings from the environment; bad values fail loudly."""

from __future__ import annotations

import os

from django.core.exceptions import ImproperlyConfigured


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from exc


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be a number, got {raw!r}") from exc


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (true/false), got {raw!r}")


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_ints(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """Comma-separated positive integers, exactly as many as ``default`` has."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        values = tuple(int(part) for part in raw.split(","))
    except ValueError:
        values = ()
    if len(values) != len(default) or min(values) < 1:
        raise ImproperlyConfigured(
            f"{name} must be {len(default)} comma-separated positive integers, got {raw!r}"
        )
    return values
