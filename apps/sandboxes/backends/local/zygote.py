"""The backend's side of the agent zygote (``zygote/daemon.py``).

One zygote per backend instance, listening on ``<state_dir>/zygote.sock``; started
detached on first use under a file lock, restarted when its socket does not answer or
it runs other agent code. Running sandboxes do not depend on it: a zygote crash only
costs the next provision a restart.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from apps.sandboxes.backends.base import BackendError

from ._sys import SYSTEM_PATH, file_lock, is_alive, run

PAUSE_SOURCE = Path(__file__).with_name("pause.c")
PAUSE_MOUNT = "/opt/hedgerow/pause"
# Every command of a zygote-started agent starts through it (podagent/spawn.py): no
# libc, so it costs a command ~0.05 ms of CPU, not a static glibc binary's ~0.6
EXEC_HELPER_SOURCE = Path(__file__).with_name("exec_helper.c")
EXEC_HELPER_MOUNT = "/opt/hedgerow/exec"
EXEC_HELPER_FLAGS = (
    "-nostdlib",
    "-fno-stack-protector",  # the canary lives in libc's TLS
    "-fno-builtin",
    "-fno-tree-loop-distribute-patterns",  # no memcpy/memset calls either
)
# zygote.daemon's fd numbers: bwrap's --info-fd and pause's ready/hold pipes
READY_FD, HOLD_FD, INFO_FD, SECCOMP_FD, TOKEN_FD = 3, 4, 5, 6, 8
# Paths come on stdin, not argv or environ: agents are forks of the zygote, and their
# /proc/<pid>/cmdline and environ (readable in the sandbox) are the zygote's.
_BOOT = (
    "import json, sys; c = json.loads(sys.stdin.readline()); sys.path.insert(0, c['path']); "
    "import zygote.daemon as z; raise SystemExit(z.main(['--socket', c['socket']]))"
)
_REFUSED = (errno.ENOENT, errno.ECONNREFUSED)
ZYGOTE_ARGV0 = "hedgerow-zygote"


class ZygoteUnavailable(BackendError):
    """The zygote cannot be used on this machine (no gcc to build pause, ...)."""


def source_version(podagent_dir: Path) -> str:
    """Same hash as ``zygote.daemon.source_version`` (tested): the zygote must run the
    agent code (and be the zygote) this control plane ships. ``zygote/`` sits beside
    ``podagent/``."""
    h = hashlib.sha256()
    for prefix, folder in (("", podagent_dir), ("zygote/", podagent_dir.parent / "zygote")):
        for path in sorted(folder.glob("*.py"), key=lambda p: p.name):
            h.update((prefix + path.name).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build_pause(bin_dir: Path) -> Path:
    """``pause`` built static from pause.c into ``bin_dir`` (once per source hash), and
    beside it the commands' exec helper (``exec_helper_path``): a zygote-started agent
    needs both."""
    _build_static(EXEC_HELPER_SOURCE, exec_helper_path(bin_dir), EXEC_HELPER_FLAGS)
    return _build_static(PAUSE_SOURCE, bin_dir / f"pause-{_digest(PAUSE_SOURCE)}", ())


def exec_helper_path(bin_dir: Path) -> Path:
    """Where ``build_pause`` puts the exec helper (exec_helper.c)."""
    return bin_dir / f"exec-{_digest(EXEC_HELPER_SOURCE)}"


def _digest(source: Path) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]


def _build_static(source: Path, target: Path, flags: tuple[str, ...]) -> Path:
    if target.exists():
        return target
    gcc = shutil.which("gcc", path=SYSTEM_PATH)
    if gcc is None:
        raise ZygoteUnavailable(f"gcc is not installed: cannot build the static {source.name}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}"
    try:
        run([gcc, "-static", "-Os", "-s", *flags, "-o", str(tmp), str(source)], timeout=120)
        os.chmod(tmp, 0o755)  # noqa: S103 - a program, bound read-only into sandboxes
        os.replace(tmp, target)  # atomic: a concurrent builder writes the same bytes
    except BackendError as exc:
        raise ZygoteUnavailable(f"cannot build {source.name}: {exc}") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return target


class ZygoteClient:
    def __init__(
        self, state_dir: Path, podagent_dir: Path, runtime_dir: Path, python: str | None = None
    ) -> None:
        self.runtime_dir = runtime_dir
        # the interpreter the zygote must run: a running one of another is replaced
        self.python = os.path.realpath(python or sys.executable)
        if python is not None and not (
            os.path.isfile(self.python) and os.access(self.python, os.X_OK)
        ):
            raise BackendError(
                f"the agent zygote's interpreter {python!r} (HEDGEROW_LOCAL_ZYGOTE_PYTHON) "
                "is not an executable file"
            )
        self.socket_path = state_dir / "zygote.sock"
        self.log_path = state_dir / "zygote.log"
        self.lock_path = state_dir / "locks" / "zygote.lock"
        self.podagent_dir = podagent_dir.resolve()
        self.version = source_version(self.podagent_dir)
        self._checked = False  # the running zygote's version was compared once

    def _connect(self, timeout: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(str(self.socket_path))
        except BaseException:
            sock.close()
            raise
        return sock

    @staticmethod
    def _exchange(sock: socket.socket, request: dict[str, Any]) -> dict[str, Any]:
        with sock:
            sock.sendall(json.dumps(request).encode() + b"\n")
            raw = b""
            while not raw.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                raw += chunk
        if not raw:
            raise ConnectionResetError(errno.ECONNRESET, "the zygote closed the connection")
        answer: dict[str, Any] = json.loads(raw)
        return answer

    def _call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        return self._exchange(self._connect(timeout), request)

    def ping(self) -> dict[str, Any] | None:
        try:
            return self._call({"op": "ping"}, timeout=5)
        except (OSError, ValueError):
            return None

    def ensure(self) -> int:
        """A zygote of this agent code answers on the socket; its pid."""
        answer = self.ping()
        if answer is not None and self._current(answer):
            self._checked = True
            return int(answer["pid"])
        with file_lock(self.lock_path):
            answer = self.ping()  # another process may have started it meanwhile
            if answer is not None and self._current(answer):
                self._checked = True
                return int(answer["pid"])
            if answer:
                # runs other agent code, or another interpreter: replace it
                self._stop(int(answer["pid"]))
            self._start()
            answer = self.ping()
            if not answer:
                raise BackendError(f"the agent zygote does not answer: {self._log_tail()}")
            self._checked = True
            return int(answer["pid"])

    def _current(self, answer: dict[str, Any]) -> bool:
        return answer.get("version") == self.version and answer.get("exe") == self.python

    def _start(self) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # A clean environment: agents are forks of it, so nothing of the control
            # plane's (database URL, secret key) may be in its memory.
            proc = subprocess.run(
                # every agent's /proc/<pid>/cmdline is this argv: argv[0] is a symlink
                # outside the state dir and the repository, not the venv's python
                [str(self._interpreter_link()), "-I", "-S", "-c", _BOOT],
                input=json.dumps(
                    {"path": str(self.podagent_dir.parent), "socket": str(self.socket_path)}
                ).encode()
                + b"\n",
                stdout=log,
                stderr=log,
                env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"},
                cwd="/",
                timeout=60,
                check=False,
            )
        if proc.returncode != 0:
            raise BackendError(
                f"the agent zygote did not start (exit {proc.returncode}): {self._log_tail()}"
            )

    def _interpreter_link(self) -> Path:
        """``<runtime_dir>/bin/hedgerow-zygote`` → the real interpreter (a symlink is
        followed when Python looks for its library; a bare name would not be)."""
        link = self.runtime_dir / "bin" / ZYGOTE_ARGV0
        target = self.python
        if os.path.islink(link) and os.readlink(link) == target:
            return link
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(f".{ZYGOTE_ARGV0}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.symlink(target, tmp)
        os.replace(tmp, link)
        return link

    def _stop(self, pid: int) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._call({"op": "shutdown"}, timeout=5)
        deadline = time.monotonic() + 5
        while is_alive(pid, None) and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        """Stops this instance's zygote, if any (teardown)."""
        answer = self.ping()
        if answer:
            self._stop(int(answer["pid"]))
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    def spawn(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Starts one sandbox's bwrap + agent; the zygote's answer (pids)."""
        if not self._checked:
            self.ensure()
        try:
            sock = self._connect(timeout)
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise BackendError(f"agent zygote: {exc}", transient=True) from exc
            # Nothing was sent, so nothing was started: a fresh zygote, once.
            self.ensure()
            sock = self._connect(timeout)
        try:
            return self._exchange(sock, {"op": "spawn", **request})
        except (OSError, ValueError) as exc:
            # Maybe half started: the caller's rollback kills what is in the netns
            # and cgroups. Not retried here, so a sandbox never gets two agents.
            raise BackendError(f"agent zygote failed mid-request: {exc}", transient=True) from exc

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_bytes()[-2000:].decode(errors="replace").strip()
        except OSError:
            return ""
