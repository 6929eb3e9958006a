"""Tiny typed readers for settings from the environment; bad values fail loudly."""

from __future__ import annotations

import os
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

# apps/core/env.py -> the repository root (the default state directory is .state there)
REPO_ROOT = Path(__file__).resolve().parents[2]


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


def state_secret(env_name: str, state_dir: str, file_name: str) -> str:
    """A credential from the environment, else from the installation's state directory
    (``make up``/``make test`` write ``db_password`` and ``redis_password`` there, mode
    0600), else "" (an external service configured entirely by the environment)."""
    from_env = os.environ.get(env_name, "")
    if from_env:
        return from_env
    try:
        with open(os.path.join(state_dir, file_name)) as fh:
            return fh.read().strip()
    except FileNotFoundError:
        return ""


def local_redis_url(state_dir: str) -> str:
    """``HEDGEROW_REDIS_URL`` verbatim when set; else the local stack's Redis on
    loopback (HEDGEROW_REDIS_PORT) with the password from the state directory."""
    url = os.environ.get("HEDGEROW_REDIS_URL", "")
    if url:
        return url
    port = env_int("HEDGEROW_REDIS_PORT", 56379)
    password = state_secret("HEDGEROW_REDIS_PASSWORD", state_dir, "redis_password")
    auth = f":{password}@" if password else ""
    return f"redis://{auth}127.0.0.1:{port}/0"


def db_conninfo(dbname: str) -> str:
    """A libpq conninfo for the configured Postgres (benchmarks' admin connections),
    with the password from the environment or the state directory."""
    state_dir = os.environ.get("HEDGEROW_STATE_DIR") or str(REPO_ROOT / ".state")
    password = state_secret("HEDGEROW_DB_PASSWORD", state_dir, "db_password")
    host = os.environ.get("HEDGEROW_DB_HOST", "127.0.0.1")
    port = env_int("HEDGEROW_DB_PORT", 55432)
    user = os.environ.get("HEDGEROW_DB_USER", "hedgerow")
    return f"host={host} port={port} user={user} password={password} dbname={dbname}"
