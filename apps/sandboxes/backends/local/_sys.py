"""Small system helpers: commands, process identity, atomic files, locks."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from apps.sandboxes.backends.base import BackendError

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def run(
    argv: Sequence[str], *, input: str | None = None, check: bool = True, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            list(argv),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={"PATH": SYSTEM_PATH, "LANG": "C"},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BackendError(f"{argv[0]} failed: {exc}", transient=True) from exc
    if check and proc.returncode != 0:
        raise BackendError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def write_atomic(path: Path, data: str, mode: int = 0o644, *, durable: bool = True) -> None:
    """Replace ``path`` atomically: readers see the old or the new content, never a mix.

    ``durable=False`` skips the fsync, for files that describe state a machine crash
    destroys anyway.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data.encode())
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Cross-process lock (several Celery workers may provision at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def proc_start_time(pid: int) -> int | None:
    """Kernel start time of ``pid`` (clock ticks since boot), None if gone or a zombie.

    The start time survives exec, so it identifies the process across the
    ``setsid → ip netns exec → sh → bwrap`` exec chain and guards against pid reuse.
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm may contain spaces and parentheses: split after the last ')'
    fields = raw[raw.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def is_alive(pid: int | None, start_time: int | None) -> bool:
    if not pid:
        return False
    current = proc_start_time(pid)
    return current is not None and (start_time is None or current == start_time)


def kill_and_wait(pid: int, start_time: int | None, timeout: float = 10) -> None:
    if not is_alive(pid, start_time):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while is_alive(pid, start_time):
        if time.monotonic() > deadline:
            raise BackendError(f"process {pid} did not die", transient=True)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)  # reap it if it happens to be our child
        time.sleep(0.02)


def kill_pids(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
