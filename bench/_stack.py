"""A private Hedgerow stack for one benchmark run: its own instance, database, key,
web and worker processes; everything it made is removed at the end.

The stack is configured as `make up` starts it (``scripts/stack-defaults.env``, the one
file both read) before a benchmark's own ``configure`` runs, and once it is up its
configuration is printed (``describe``): the figures a benchmark prints are measured on
the configuration on that line, and any deviation from `make up` is named there."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = ROOT / "scripts" / "stack-defaults.env"


def make_up_settings(path: Path = DEFAULTS) -> dict[str, str]:
    """The settings `make up` starts the stack with (``HEDGEROW_*=value`` lines)."""
    out = {}
    for row in path.read_text().splitlines():
        key, sep, value = row.strip().partition("=")
        if sep and key.startswith("HEDGEROW_") and not key.startswith("#"):
            out[key] = value
    return out


def set_arg(args: list[str], flag: str, value: str) -> None:
    """Sets ``flag value`` in a command line, replacing an earlier value."""
    at = [i for i, arg in enumerate(args[:-1]) if arg == flag]
    if at:
        for i in at:
            args[i + 1] = value
    else:
        args += [flag, value]


def get_arg(args: list[str], flag: str, default: str = "") -> str:
    """The value of ``flag`` in a command line (the last one: it wins), or default."""
    at = [i for i, arg in enumerate(args[:-1]) if arg == flag]
    return args[at[-1] + 1] if at else default


def make_up(stack: Any, settings: dict[str, str] | None = None) -> None:
    """Configures a stack's web and worker processes as scripts/stack.sh starts them:
    uvicorn workers on uvloop + httptools with a pooled DB connection each, the
    keep-alive, and the Celery worker's processes (the subnet's size is an environment
    setting: ``private_stack`` sets it)."""
    cfg = settings or make_up_settings()
    for flag, value in (
        ("--workers", cfg["HEDGEROW_WEB_WORKERS"]),
        ("--loop", "uvloop"),
        ("--http", "httptools"),
    ):
        set_arg(stack.web.args, flag, value)
    stack.web.env = {
        **stack.web.env,
        "HEDGEROW_DB_POOL": "1",
        "HEDGEROW_DB_POOL_MAX": cfg["HEDGEROW_DB_POOL_MAX"],
        "HEDGEROW_KEEP_ALIVE_S": cfg["HEDGEROW_KEEP_ALIVE_S"],
    }
    set_arg(stack.worker.args, "-c", cfg["HEDGEROW_WORKER_CONCURRENCY"])


def configuration(stack: Any) -> dict[str, str]:
    """What the started stack runs with, in the names of scripts/stack-defaults.env
    (plus the settings a benchmark may add), read from its processes' command lines
    and environments."""
    web_env, worker_env = stack.web.env, stack.worker.env
    pooled = web_env.get("HEDGEROW_DB_POOL", "") not in ("", "0")
    return {
        "HEDGEROW_WEB_WORKERS": get_arg(stack.web.args, "--workers", "1"),
        "HEDGEROW_DB_POOL_MAX": web_env.get("HEDGEROW_DB_POOL_MAX", "20") if pooled else "off",
        "HEDGEROW_KEEP_ALIVE_S": get_arg(
            stack.web.args, "--timeout-keep-alive", web_env.get("HEDGEROW_KEEP_ALIVE_S", "120")
        ),
        "HEDGEROW_WORKER_CONCURRENCY": get_arg(stack.worker.args, "-c", "?"),
        "HEDGEROW_LOCAL_SUBNET_PREFIX": _subnet_prefix(worker_env),
        "loop/http": f"{get_arg(stack.web.args, '--loop', 'auto')}/"
        f"{get_arg(stack.web.args, '--http', 'auto')}",
        "HEDGEROW_MAX_LIVE_SANDBOXES": worker_env.get("HEDGEROW_MAX_LIVE_SANDBOXES", "0"),
        "HEDGEROW_WARM_POOL": worker_env.get("HEDGEROW_WARM_POOL", "") or "none",
        "HEDGEROW_LOCAL_ZYGOTE_PYTHON": _agent_python(worker_env),
    }


def _agent_python(env: dict[str, str]) -> str:
    """The setting, and what it resolves to on this machine (``auto`` → a path)."""
    from apps.sandboxes.backends.local import agent_python

    value = env.get("HEDGEROW_LOCAL_ZYGOTE_PYTHON", "")
    resolved = agent_python.resolve(value) or f"own ({sys.executable})"
    return f"{value or '(own)'} → {resolved}" if value == agent_python.AUTO else resolved


def _subnet_prefix(env: dict[str, str]) -> str:
    subnet = env.get("HEDGEROW_LOCAL_SUBNET", "")
    if subnet:
        return "/" + subnet.rpartition("/")[2] + f" ({subnet})"
    return "/" + env.get("HEDGEROW_LOCAL_SUBNET_PREFIX", "24")


def describe(stack: Any, settings: dict[str, str] | None = None) -> str:
    """One line: the configuration measured, and how it differs from `make up`'s."""
    cfg = settings or make_up_settings()
    measured = configuration(stack)
    names = {
        "HEDGEROW_WEB_WORKERS": "web workers",
        "HEDGEROW_DB_POOL_MAX": "DB pool per web worker",
        "HEDGEROW_KEEP_ALIVE_S": "keep-alive s",
        "HEDGEROW_WORKER_CONCURRENCY": "Celery worker -c",
        "HEDGEROW_LOCAL_SUBNET_PREFIX": "subnet",
        "loop/http": "loop/http",
        "HEDGEROW_MAX_LIVE_SANDBOXES": "max live",
        "HEDGEROW_WARM_POOL": "warm pool",
        "HEDGEROW_LOCAL_ZYGOTE_PYTHON": "agent python",
    }
    expected = {**cfg, "loop/http": "uvloop/httptools", "HEDGEROW_MAX_LIVE_SANDBOXES": "0"}
    expected["HEDGEROW_LOCAL_SUBNET_PREFIX"] = "/" + cfg["HEDGEROW_LOCAL_SUBNET_PREFIX"]
    expected["HEDGEROW_WARM_POOL"] = "none"
    differs = [
        f"{names[k]} {v} (make up: {expected[k]})"
        for k, v in measured.items()
        if k in expected and v.split(" ")[0] != expected[k]
    ]
    shown = ", ".join(f"{names[k]} {v}" for k, v in measured.items())
    verdict = "as make up" if not differs else "DIFFERS from make up: " + "; ".join(differs)
    return f"configuration: {shown}; cpus {os.cpu_count()} — {verdict}"


@contextlib.contextmanager
def private_stack(
    name: str,
    env: dict[str, str],
    configure: Callable[[Any], None] = lambda stack: None,
    *,
    database: str | None = None,
    reuse: bool = False,
    keep: bool = False,
) -> Iterator[tuple[Any, str]]:
    """Yields (started conftest.Stack, API key secret). ``name`` prefixes the instance
    and database; ``env`` is added to this process's environment before Django starts
    (the stack's processes inherit it); the web/worker processes are configured as
    `make up` starts them, then ``configure`` may change that before they start; the
    configuration is printed once they are up.

    ``database`` names the database instead (default ``hr_bench_{name}_{pid}``); with
    ``reuse`` it already exists and holds a ``bench`` tenant (made by an earlier run
    with ``keep``): it is migrated (so a newer branch's migrations are measured too)
    and a new key is issued for it. With ``keep`` the database is left in place at the
    end; otherwise it is dropped."""
    pid = os.getpid()
    db_name = database or f"hr_bench_{name}_{pid}"
    settings = make_up_settings()
    # make up's settings first; the benchmark's own ``env`` wins (density names its
    # subnet prefix, for one)
    os.environ.update(
        {
            "HEDGEROW_INSTANCE": f"{name}{pid}",
            "HEDGEROW_DB_NAME": db_name,
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "HEDGEROW_LOG_LEVEL": "WARNING",
            "HEDGEROW_LOCAL_SUBNET_PREFIX": settings["HEDGEROW_LOCAL_SUBNET_PREFIX"],
            "HEDGEROW_WORKER_CONCURRENCY": settings["HEDGEROW_WORKER_CONCURRENCY"],
            "HEDGEROW_LOCAL_ZYGOTE_PYTHON": os.environ.get(
                "HEDGEROW_LOCAL_ZYGOTE_PYTHON", settings["HEDGEROW_LOCAL_ZYGOTE_PYTHON"]
            ),
            **env,
        }
    )
    # A throwaway key for this private stack (settings refuse a known default); the
    # stack's processes inherit it, so agent tokens agree.
    os.environ.setdefault("HEDGEROW_SECRET_KEY", uuid.uuid4().hex + uuid.uuid4().hex)
    sys.path.insert(0, str(ROOT))
    import psycopg

    from apps.core.env import db_conninfo

    admin = psycopg.connect(db_conninfo("postgres"))
    admin.autocommit = True
    if not reuse:
        admin.execute(f'CREATE DATABASE "{db_name}"')
    stack = None
    try:
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, check=True)
        import django

        django.setup()
        from apps.tenancy.models import Tenant
        from apps.tenancy.services import api_key_create, tenant_create
        from conftest import Stack

        tenant = Tenant.objects.get(slug="bench") if reuse else tenant_create(slug="bench")
        issued = api_key_create(tenant=tenant, name=f"bench {pid}", scopes=["read", "write"])
        secret = issued.secret
        stack = Stack(db_name, Path(tempfile.mkdtemp(prefix=f"hr-{name}-")))
        make_up(stack, settings)
        configure(stack)
        stack.start()
        print(describe(stack, settings), flush=True)
        yield stack, secret
    finally:
        if stack is not None:
            stack.stop()
            _cleanup()
        from django.db import connections

        connections.close_all()
        if not keep:
            admin.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


def _cleanup() -> None:
    from apps.sandboxes.backends import get_backend

    backend = get_backend()
    for sandbox_id in {i.sandbox_id for i in backend.inventory() if i.sandbox_id}:
        try:
            backend.destroy(sandbox_id)
        except Exception as exc:  # report, keep cleaning
            print(f"cleanup of {sandbox_id} failed: {exc}")
    # The private instance's bridge, nft table, cgroup group and subnet claim go too.
    teardown = getattr(backend, "teardown_instance", None)
    if teardown is not None:
        teardown()
