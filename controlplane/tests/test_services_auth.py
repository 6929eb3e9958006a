"""The stack's Postgres and Redis (scripts/stack.sh) refuse anyone without the password
generated into the state directory, listen on loopback only, and Redis is bounded
with an eviction policy that never touches keys without a TTL (Celery's queues)."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest
import redis
from django.conf import settings


def _db() -> dict[str, str]:
    db = settings.DATABASES["default"]
    return {"host": str(db["HOST"]), "port": str(db["PORT"]), "user": str(db["USER"])}


def _conninfo(**params: str) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def _no_password_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # libpq would otherwise pick a password from the environment or ~/.pgpass
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", "/nonexistent")


def test_credentials_are_private_files_in_the_state_dir() -> None:
    for name in ("db_password", "redis_password"):
        path = Path(settings.STATE_DIR) / name
        assert path.is_file(), f"{path} missing: scripts/stack.sh generates it"
        assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"
        assert len(path.read_text().strip()) >= 32


def test_postgres_refuses_a_connection_without_password_over_tcp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_password_env(monkeypatch)
    db = _db()
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(_conninfo(**db, dbname="postgres", connect_timeout="5"))


def test_postgres_refuses_a_connection_without_password_on_the_unix_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_password_env(monkeypatch)
    db = _db()
    socket_path = Path(f"/tmp/.s.PGSQL.{db['port']}")
    assert socket_path.exists(), "scripts/stack.sh starts Postgres with -k /tmp"
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(
            _conninfo(
                host="/tmp",
                port=db["port"],
                user=db["user"],
                dbname="postgres",
                connect_timeout="5",
            )
        )


def test_postgres_accepts_the_generated_password_and_listens_on_loopback_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_password_env(monkeypatch)
    password = str(settings.DATABASES["default"]["PASSWORD"])
    assert password, "settings read .state/db_password"
    with psycopg.connect(_conninfo(**_db(), password=password, dbname="postgres")) as conn:
        row = conn.execute("SHOW listen_addresses").fetchone()
        assert row is not None and row[0] == "127.0.0.1"
        hba = conn.execute(
            "SELECT DISTINCT auth_method FROM pg_hba_file_rules WHERE error IS NULL"
        ).fetchall()
        assert {method for (method,) in hba} == {"scram-sha-256"}


def _redis_host_port() -> tuple[str, int]:
    parts = urlsplit(settings.REDIS_URL)
    return parts.hostname or "127.0.0.1", parts.port or 6379


def test_redis_refuses_commands_without_auth() -> None:
    host, port = _redis_host_port()
    anonymous = redis.Redis(host=host, port=port, socket_timeout=5)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    with pytest.raises(redis.AuthenticationError):
        anonymous.set("hedgerow:probe", "x")
    wrong = redis.Redis(host=host, port=port, password="not-the-password", socket_timeout=5)
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()


def test_redis_with_the_password_is_bounded_and_evicts_only_expiring_keys() -> None:
    password = (Path(settings.STATE_DIR) / "redis_password").read_text().strip()
    assert f":{password}@" in settings.REDIS_URL, "settings use the generated password"
    client = redis.Redis.from_url(settings.REDIS_URL)
    assert client.ping()
    config: dict[str, str] = {
        k: v
        for k, v in client.config_get("maxmemory*").items()  # type: ignore[union-attr]
    }
    assert int(config["maxmemory"]) > 0
    # volatile-*: only keys with a TTL are candidates, never Celery's queues and locks
    assert config["maxmemory-policy"] == "volatile-lru"
    bind = client.config_get("bind")["bind"]  # type: ignore[index]
    assert bind.split() == ["127.0.0.1"]


def test_no_credential_is_passed_on_a_command_line() -> None:
    """A process's argv is world-readable (/proc/<pid>/cmdline); the environment is not."""
    secrets = [
        (Path(settings.STATE_DIR) / name).read_text().strip()
        for name in ("db_password", "redis_password")
    ]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        for secret in secrets:
            assert secret not in cmdline, f"pid {pid} has a credential in its argv"
