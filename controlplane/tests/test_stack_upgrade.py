"""`make up`/`make test` upgrade a stack made before credentials existed — a Postgres
cluster with trust authentication and a Redis without a password, both running — in
place and idempotently: afterwards both refuse anonymous clients, accept the generated
passwords, and kept their data. Runs scripts/stack.sh against a private state
directory on free ports (never the shared stack)."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

ROOT = Path(__file__).resolve().parents[2]
PG_BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1]

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres(*args: str) -> None:
    subprocess.run(["runuser", "-u", "postgres", "--", *args], check=True, capture_output=True)


class OldStack:
    """What scripts/stack.sh made before credentials: `initdb -A trust`, and Redis
    started with command-line options and no password."""

    def __init__(self) -> None:
        self.state = Path(tempfile.mkdtemp(prefix="hr-upgrade-"))
        self.state.chmod(0o711)  # postgres must reach its data directory
        self.pg_port, self.redis_port = _free_port(), _free_port()
        self.data = self.state / "postgres"
        (self.state / "run").mkdir()
        (self.state / "redis").mkdir()

    def start(self) -> None:
        self.data.mkdir()
        shutil.chown(self.data, "postgres", "postgres")
        _as_postgres(f"{PG_BIN}/initdb", "-A", "trust", "-U", "hedgerow", "-D", str(self.data))
        _as_postgres(
            f"{PG_BIN}/pg_ctl", "-D", str(self.data), "-w", "-l", str(self.data / "server.log"),
            "-o", f"-p {self.pg_port} -k /tmp -c listen_addresses=127.0.0.1", "start",
        )  # fmt: skip
        with psycopg.connect(self._anonymous("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE hedgerow")
        with psycopg.connect(self._anonymous("hedgerow"), autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (v text)")
            conn.execute("INSERT INTO kept VALUES ('before')")
        subprocess.run(
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
             "--daemonize", "yes", "--save", "", "--appendonly", "no",
             "--dir", str(self.state / "redis"),
             "--pidfile", str(self.state / "run" / "redis.pid")],
            check=True, capture_output=True,
        )  # fmt: skip
        anonymous = redis.Redis(port=self.redis_port)
        for _ in range(100):
            try:
                anonymous.rpush("queue", "queued-before")
                break
            except redis.ConnectionError:
                subprocess.run(["sleep", "0.05"], check=True)

    def _anonymous(self, dbname: str) -> str:
        port = self.pg_port
        return f"host=127.0.0.1 port={port} user=hedgerow dbname={dbname} passfile=/nonexistent"

    def upgrade(self) -> str:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("HEDGEROW_", "PG"))},
            "HEDGEROW_STATE_DIR": str(self.state),
            "HEDGEROW_DB_PORT": str(self.pg_port),
            "HEDGEROW_REDIS_PORT": str(self.redis_port),
        }
        done = subprocess.run(
            [str(ROOT / "scripts" / "stack.sh"), "services"],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    def stop(self) -> None:
        pidfile = self.state / "run" / "redis.pid"
        if pidfile.exists():
            subprocess.run(["kill", pidfile.read_text().strip()], check=False)
        subprocess.run(
            ["runuser", "-u", "postgres", "--", f"{PG_BIN}/pg_ctl", "-D", str(self.data),
             "-m", "immediate", "stop"],
            check=False, capture_output=True,
        )  # fmt: skip
        shutil.rmtree(self.state, ignore_errors=True)


@pytest.fixture
def old_stack() -> Iterator[OldStack]:
    stack = OldStack()
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def test_a_trust_cluster_and_an_open_redis_are_upgraded_in_place_idempotently(
    old_stack: OldStack,
) -> None:
    first = old_stack.upgrade()
    assert "requiring a password for Postgres" in first
    assert "requiring a password for Redis" in first

    db_password = (old_stack.state / "db_password").read_text().strip()
    redis_password = (old_stack.state / "redis_password").read_text().strip()
    for name in ("db_password", "redis_password", "redis/redis.conf"):
        assert (old_stack.state / name).stat().st_mode & 0o077 == 0, name

    # anonymous: refused on TCP and on the unix socket; with the password: the old data
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(old_stack._anonymous("hedgerow"))
    with pytest.raises(psycopg.OperationalError, match="password"):
        socket_dir = f"host=/tmp port={old_stack.pg_port}"
        psycopg.connect(f"{socket_dir} user=hedgerow dbname=hedgerow passfile=/nonexistent")
    with psycopg.connect(old_stack._anonymous("hedgerow") + f" password={db_password}") as conn:
        assert conn.execute("SELECT v FROM kept").fetchall() == [("before",)]

    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=old_stack.redis_port).ping()
    authed: Any = redis.Redis(port=old_stack.redis_port, password=redis_password)
    assert authed.lrange("queue", 0, -1) == [b"queued-before"]
    assert authed.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
    assert int(authed.config_get("maxmemory")["maxmemory"]) > 0

    # again: nothing left to upgrade, and the same passwords still work
    second = old_stack.upgrade()
    assert "requiring a password" not in second
    assert (old_stack.state / "db_password").read_text().strip() == db_password
    assert authed.ping()
