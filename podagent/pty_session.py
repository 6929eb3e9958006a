"""PTY sessions over an upgraded HTTP connection.

After `101 Switching Protocols` both sides exchange frames:
1 byte type | 4 bytes big-endian length | payload. The request thread reads the
client's frames; one output thread copies the terminal's output to the client
and reports the exit. Whatever way the session ends (exit, close frame, client
gone), the whole session gets SIGHUP then SIGKILL, so nothing outlives it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import struct
import subprocess
import termios
import threading
from typing import Any, BinaryIO, Dict, List, Optional, Tuple

from . import limits, spawn
from .errors import ApiError
from .procutil import signal_number, signal_session

PROTOCOL = "hedgerow-pty/1"
MAX_FRAME = 1024 * 1024
INIT_TIMEOUT_S = 10.0
# HOME is /workspace, the user's files: an interactive bash's history goes to /tmp
# instead (the request's env or the image's own HISTFILE still win).
HISTFILE = "/tmp/.bash_history"
HANGUP_GRACE_S = 1.0
_HEADER = struct.Struct(">cI")


class PtyClosed(Exception):
    pass


class FrameIO:
    def __init__(self, rfile: BinaryIO, wfile: Any) -> None:
        self._rfile = rfile
        self._wfile = wfile
        self._lock = threading.Lock()
        self.broken = False

    def send(self, kind: bytes, payload: bytes) -> None:
        with self._lock:
            if self.broken:
                return
            try:
                self._wfile.write(_HEADER.pack(kind, len(payload)) + payload)
            except OSError:
                self.broken = True

    def send_json(self, kind: bytes, obj: Dict[str, Any]) -> None:
        self.send(kind, json.dumps(obj).encode())

    def recv(self) -> Tuple[bytes, bytes]:
        header = self._rfile.read(_HEADER.size)
        if len(header) < _HEADER.size:
            raise PtyClosed()
        kind, length = _HEADER.unpack(header)
        if length > MAX_FRAME:
            raise PtyClosed()
        payload = self._rfile.read(length) if length else b""
        if len(payload) < length:
            raise PtyClosed()
        return kind, payload


def _set_ctty() -> None:
    # Runs in the child after setsid(): make the pty its controlling terminal.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _winsize(fd: int, rows: Any, cols: Any) -> None:
    rows = int(rows) if isinstance(rows, int) and 0 < rows < 10000 else 24
    cols = int(cols) if isinstance(cols, int) and 0 < cols < 10000 else 80
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class Session:
    def __init__(self, io: FrameIO, state: Any) -> None:
        self.io = io
        self.state = state
        self.master = -1
        self.proc: Optional["subprocess.Popen[bytes]"] = None
        self.exited = threading.Event()

    def start(self, init: Dict[str, Any]) -> None:
        shell = self.state.shell
        cmd = init.get("cmd")
        argv: List[str]
        if cmd is None:
            argv = [shell, "-l"] if init.get("login_shell") else [shell]
        elif isinstance(cmd, str) and cmd:
            argv = [shell, "-lc" if init.get("login_shell") else "-c", cmd]
        elif isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd):
            argv = list(cmd)
        else:
            raise ValueError("cmd must be null, a string or a list of strings")
        env = dict(self.state.base_env)
        env.setdefault("TERM", "xterm-256color")
        extra = init.get("env") or {}
        if not isinstance(extra, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in extra.items()
        ):
            raise ValueError("env must map names to strings")
        env.update(extra)
        env.setdefault("HISTFILE", HISTFILE)
        cwd = os.path.join(self.state.workdir, init.get("cwd") or self.state.workdir)
        if not os.path.isdir(cwd):
            raise ValueError(f"cwd_not_found: {cwd}")
        master, slave = os.openpty()
        self.master = master
        # the helper's exec errno (spawn.py), when commands start through one
        err = os.pipe() if spawn.helper() is not None else None
        try:
            _winsize(master, init.get("rows"), init.get("cols"))
            # started in the commands' cgroup, like every exec (limits.py), and through
            # the helper (as other uids than the agent's) where there is one
            self.proc = limits.CGROUPS.spawn(lambda: subprocess.Popen(
                argv if err is None else spawn.wrap(argv, err[1]), stdin=slave, stdout=slave,
                stderr=slave, cwd=cwd, env=env, start_new_session=True, preexec_fn=_set_ctty,
                pass_fds=() if err is None else (err[1],), **spawn.identity(),
            ))  # fmt: skip
        except BaseException:
            if err is not None:
                os.close(err[0])
            raise
        finally:
            os.close(slave)
            if err is not None:
                os.close(err[1])
        if err is None:
            return
        try:
            spawn.await_exec(self.proc.pid, err[0], argv[0])
        except OSError:
            self.proc.returncode = 127  # reaped: never to be waited for or signalled
            self.proc = None
            raise

    def pump_output(self) -> None:
        """Copy terminal output to the client until the command exits."""
        proc = self.proc
        assert proc is not None
        pidfd: Optional[int] = None
        opener = getattr(os, "pidfd_open", None)
        if opener is not None:
            with contextlib.suppress(OSError):
                pidfd = opener(proc.pid)
        master_open = True
        try:
            while master_open:
                fds = [self.master] + ([pidfd] if pidfd is not None else [])
                ready, _, _ = select.select(fds, [], [], None if pidfd is not None else 0.2)
                if self.master in ready:
                    master_open = self._copy_once()
                if (pidfd is not None and pidfd in ready) or proc.poll() is not None:
                    break
            # The command is gone; flush what it wrote before exiting.
            while master_open and select.select([self.master], [], [], 0.05)[0]:
                master_open = self._copy_once()
            code = proc.wait()
            self.io.send_json(b"X", {"code": code})
        finally:
            if pidfd is not None:
                os.close(pidfd)
            self.exited.set()

    def _copy_once(self) -> bool:
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: every slave end is closed
            return False
        if not data:
            return False
        self.io.send(b"O", data)
        return True

    def handle(self, kind: bytes, payload: bytes) -> bool:
        """Apply one client frame; False when the client asked to close."""
        if kind == b"D":
            view = memoryview(payload)
            while view:
                view = view[os.write(self.master, view) :]
        elif kind == b"R":
            size = json.loads(payload)
            _winsize(self.master, size.get("rows"), size.get("cols"))
        elif kind == b"S":
            sig = signal_number(str(json.loads(payload).get("sig", "")))
            assert self.proc is not None
            try:
                pgrp = os.tcgetpgrp(self.master)
            except OSError:
                pgrp = self.proc.pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgrp, sig)
        elif kind == b"C":
            return False
        return True

    def terminate(self) -> None:
        if self.proc is not None and not self.exited.is_set():
            signal_session(self.proc.pid, signal.SIGHUP)
            if not self.exited.wait(HANGUP_GRACE_S):
                signal_session(self.proc.pid, signal.SIGKILL)
            self.exited.wait(HANGUP_GRACE_S * 5)
        if self.proc is not None:
            # Stragglers in the session (background jobs) die with it.
            signal_session(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                self.proc.wait(HANGUP_GRACE_S)
        if self.master >= 0:
            os.close(self.master)
            self.master = -1


def serve_pty(handler: Any) -> None:
    if handler.headers.get("Upgrade", "").lower() != PROTOCOL:
        raise ApiError(400, "bad_request", f"POST /pty needs 'Upgrade: {PROTOCOL}'")
    if handler.body is not None and not handler.body.finished:
        raise ApiError(400, "bad_request", "POST /pty takes no body")
    state = handler.server.state
    if not state.pty_slots.acquire(blocking=False):
        raise ApiError(429, "too_many_sessions", "too many concurrent PTY sessions")
    try:
        handler.status = 101
        handler.close_connection = True
        handler.wfile.write(
            (
                f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: {PROTOCOL}\r\n"
                "Connection: Upgrade\r\n\r\n"
            ).encode()
        )
        _run_session(handler, state)
    finally:
        state.pty_slots.release()
        with contextlib.suppress(OSError):
            handler.connection.shutdown(socket.SHUT_RDWR)


def _run_session(handler: Any, state: Any) -> None:
    io = FrameIO(handler.rfile, handler.wfile)
    sock: socket.socket = handler.connection
    session = Session(io, state)
    try:
        sock.settimeout(INIT_TIMEOUT_S)
        try:
            kind, payload = io.recv()
        except (PtyClosed, OSError):
            return
        sock.settimeout(None)
        try:
            if kind != b"I":
                raise ValueError("the first frame must be init (I)")
            init = json.loads(payload)
            if not isinstance(init, dict):
                raise ValueError("init must be a JSON object")
            session.start(init)
        except (ValueError, OSError) as exc:
            io.send_json(b"E", {"message": str(exc)})
            return
        assert session.proc is not None
        io.send_json(b"P", {"pid": session.proc.pid})
        state.log.write("pty_start", request_id=handler.request_id, pid=session.proc.pid)
        pump = threading.Thread(target=session.pump_output, daemon=True)
        pump.start()
        # When the command exits, the pump sends X and we stop reading: shut the
        # socket's read side so the blocking recv below returns.
        threading.Thread(target=_close_reader_on_exit, args=(session, sock), daemon=True).start()
        while not session.exited.is_set():
            try:
                kind, payload = io.recv()
            except (PtyClosed, OSError):
                break
            try:
                if not session.handle(kind, payload):
                    break
            except (ValueError, AttributeError, OSError) as exc:
                io.send_json(b"E", {"message": f"bad {kind!r} frame: {exc}"})
        session.terminate()
        pump.join(HANGUP_GRACE_S * 5)
    finally:
        session.terminate()


def _close_reader_on_exit(session: Session, sock: socket.socket) -> None:
    session.exited.wait()
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
