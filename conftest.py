"""Shared fixtures: tenants and keys, and the real stack (Celery worker, ASGI server)
running as subprocesses against the test database."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent
# A real OCI registry on loopback (Debian's docker-registry), for every test that pulls.
pytest_plugins = ["apps.sandboxes.backends.local.images.tests.fixtures"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stack_env(db_name: str) -> dict[str, str]:
    env = dict(os.environ)
    env["HEDGEROW_DB_NAME"] = db_name
    env["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"
    from django.conf import settings

    # The stack must name resources exactly as this process does, or cleanup misses them.
    env["HEDGEROW_INSTANCE"] = settings.HEDGEROW_INSTANCE
    # Agent tokens are derived from the key: the stack must hold the same one.
    env["HEDGEROW_SECRET_KEY"] = settings.SECRET_KEY
    return env


class Proc:
    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name, self.args, self.env = name, args, env
        self.log_path = log_dir / f"{name}.log"
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.popen = subprocess.Popen(
            self.args,
            env=self.env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop(self, sig: int = 15) -> None:
        if self.popen and self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, 9)
                self.popen.wait()

    def kill(self) -> None:
        self.stop(9)

    def tail(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""


class Stack:
    """The real web (uvicorn) and Celery worker against the test database."""

    def __init__(self, db_name: str, log_dir: Path) -> None:
        self.env = _stack_env(db_name)
        # Prometheus scrapes authenticate with this bearer token (tests read /metrics).
        self.metrics_token = self.env.setdefault("HEDGEROW_METRICS_TOKEN", "test-metrics-token")
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        queue = f"{self.env['HEDGEROW_INSTANCE']}.cold"
        self.worker = Proc(
            "worker",
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "controlplane",
                "worker",
                "-l",
                "info",
                "-c",
                "4",
                "-Q",
                queue,
                "-n",
                f"test-{os.getpid()}@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            self.env,
            log_dir,
        )
        self.web = Proc(
            "web",
            [
                sys.executable,
                "-m",
                "controlplane.serve",  # uvicorn with a bounded request head
                "controlplane.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--no-access-log",
            ],
            self.env,
            log_dir,
        )

    def start(self) -> None:
        self.worker.start()
        self.web.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError("web did not start:\n" + self.web.tail())
        self.wait_worker_ready()

    def wait_worker_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "ready." in self.worker.tail():
                return
            if self.worker.popen and self.worker.popen.poll() is not None:
                raise RuntimeError("worker died:\n" + self.worker.tail())
            time.sleep(0.1)
        raise RuntimeError("worker did not become ready:\n" + self.worker.tail())

    def restart_worker(self, extra_env: dict[str, str] | None = None) -> None:
        """Restarts the worker, optionally with extra environment (e.g. HEDGEROW_FAULTS)."""
        self.worker.stop()
        self.worker.env = {**self.env, **(extra_env or {})}
        self.worker.log_path.write_text("")
        self.worker.start()
        self.wait_worker_ready()

    def restart_web(self) -> None:
        """Starts the web process again (after a test killed it) on the same port."""
        self.web.stop()
        self.web.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("web did not restart:\n" + self.web.tail())

    def stop(self) -> None:
        self.web.stop()
        self.worker.stop()


@pytest.fixture(scope="session")
def stack(
    django_db_setup: Any, django_db_blocker: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    from django.db import connection

    db_name = connection.settings_dict["NAME"]
    s = Stack(db_name, tmp_path_factory.mktemp("stack-logs"))
    s.start()
    yield s
    s.stop()
    _destroy_all_sandboxes()
    _teardown_backend_instance()


def _teardown_backend_instance() -> None:
    """Releases the run's bridge, host rules and subnet claim (the pool is finite)."""
    from apps.sandboxes.backends import get_backend

    teardown = getattr(get_backend(), "teardown_instance", None)
    if teardown is not None:
        try:
            teardown()
        except Exception:
            pass


def _destroy_all_sandboxes() -> None:
    from apps.sandboxes.backends import get_backend

    backend = get_backend()
    try:
        ids = {item.sandbox_id for item in backend.inventory() if item.sandbox_id}
    except Exception:
        return
    for sandbox_id in ids:
        try:
            backend.destroy(sandbox_id)
        except Exception:
            pass
    # snapshots (docs/snapshots.md) outlive their sandboxes: none may reach the next test
    for snapshot_id in getattr(backend, "snapshots", list)():
        try:
            backend.delete_snapshot(snapshot_id)
        except Exception:
            pass


@pytest.fixture
def live(stack: Stack, transactional_db: Any) -> Iterator[Stack]:
    """An integration test: the real stack, committed data, and no sandbox left behind."""
    yield stack
    _quiesce()
    _destroy_all_sandboxes()


def _quiesce(timeout: float = 30.0) -> None:
    """Lets the worker finish in-flight provisions and deletes before the database is
    flushed: truncating tables under a worker's open transaction can deadlock."""
    from apps.sandboxes.models import Sandbox, State

    deadline = time.monotonic() + timeout
    busy = (State.REQUESTED, State.PROVISIONING, State.TERMINATING)
    while time.monotonic() < deadline and Sandbox.objects.filter(state__in=busy).exists():
        time.sleep(0.2)


@pytest.fixture
def make_tenant(db: Any) -> Callable[..., tuple[Any, str]]:
    from apps.tenancy.services import api_key_create, tenant_create

    counter = {"n": 0}

    def make(slug: str | None = None, scopes: list[str] | None = None) -> tuple[Any, str]:
        counter["n"] += 1
        tenant = tenant_create(slug=slug or f"team-{counter['n']}-{os.getpid()}")
        issued = api_key_create(
            tenant=tenant, name="test", scopes=scopes or ["read", "write", "admin"]
        )
        return tenant, issued.secret

    return make


@pytest.fixture
def api_client() -> Callable[[str], Any]:
    from rest_framework.test import APIClient

    def make(secret: str) -> APIClient:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
        return client

    return make
