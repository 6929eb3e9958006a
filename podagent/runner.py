"""Runs one command to completion with bounded output and typed termination.

The run happens on the calling thread: one poll(2) multiplexes stdout,
stderr, stdin and (when the platform has it) a pidfd for the exit, so an exec
costs no extra threads, sleeps or polling.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import os
import select
import signal
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from . import limits
from .output import StreamCapture
from .procutil import signal_name, signal_session
from .spawn import finish, start

CHILDREN_GRACE_S = 0.5
READ_SIZE = 65536
_FALLBACK_POLL_S = 0.01

OutputSink = Callable[[str, bytes], None]
StartSink = Callable[[Optional[int]], None]


class ExecSpec:
    __slots__ = (
        "argv", "cwd", "env", "kill_grace", "limit", "stdin", "stdin_open", "timeout", "window",
    )  # fmt: skip

    def __init__(
        self,
        argv: List[str],
        cwd: str,
        env: Dict[str, str],
        stdin: Optional[bytes],
        timeout: Optional[float],
        kill_grace: float,
        window: int,
        limit: Optional[int],
        stdin_open: bool = False,
    ) -> None:
        self.argv = argv
        self.stdin_open = stdin_open
        self.cwd = cwd
        self.env = env
        self.stdin = stdin
        self.timeout = timeout
        self.kill_grace = kill_grace
        self.window = window
        self.limit = limit


STDIN_MAX_BYTES = 1024 * 1024  # input accepted but not yet read by the command


class StdinClosed(Exception):
    """The command's stdin takes no more input: never opened, closed (EOF sent), the
    command stopped reading it, or the command ended."""


class StdinFull(Exception):
    """STDIN_MAX_BYTES are waiting for the command to read them."""


class StdinOffset(Exception):
    """The sender's offset is not where the input stands (a gap, or an overlap that is
    not a resend of what was accepted)."""

    def __init__(self, expected: int) -> None:
        super().__init__(f"the input stands at offset {expected}")
        self.expected = expected


class StdinFeed:
    """A running command's stdin, kept open for input sent while it runs
    (``POST /operations/{id}/stdin``). Bounded: at most STDIN_MAX_BYTES wait to be read;
    a sender waits for room up to its timeout, then gets StdinFull. The runner's poll
    loop does the writing (woken through a pipe), so a command that does not read never
    blocks a request thread for longer than its timeout."""

    def __init__(self, initial: bytes) -> None:
        self.cond = threading.Condition()
        self.buf = bytearray(initial)
        self.eof = False  # EOF asked for: close once the buffer is written
        self.closed = False  # the pipe is closed: nothing more is accepted
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.written = 0
        self.received = len(initial)  # bytes accepted in all: the next offset
        # (offset, sha256) of the last writes: a resend is recognised by both, so a
        # stale writer's new bytes are never mistaken for a resend and dropped.
        self.accepted: Deque[Tuple[int, bytes]] = collections.deque(maxlen=64)

    def send(
        self, data: bytes, eof: bool, timeout: float, offset: Optional[int] = None
    ) -> "tuple[int, int]":
        """Queues ``data`` (and EOF after it); returns (bytes waiting, the next offset).
        With ``offset`` (where ``data`` starts in the whole input) a resend of one of the
        last 64 writes (same offset, same bytes) is answered without being written
        twice, so a sender may retry after a lost answer; anything else off the mark is
        StdinOffset (nothing written: the sender may send again at the new offset)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            if offset is not None and offset != self.received:
                if (offset, hashlib.sha256(data).digest()) in self.accepted:
                    if eof and not (self.closed or self.eof):
                        self.eof = True
                        self._wake()
                    return len(self.buf), self.received  # a resend: already have it
                raise StdinOffset(self.received)
            if not data and eof and (self.closed or self.eof):
                return len(self.buf), self.received  # closing twice is closing
            while True:
                if self.closed or self.eof:
                    raise StdinClosed("the command's stdin is closed")
                if len(self.buf) + len(data) <= STDIN_MAX_BYTES:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StdinFull(
                        f"{len(self.buf)} bytes of input are still waiting for the command "
                        f"to read them (at most {STDIN_MAX_BYTES})"
                    )
                self.cond.wait(left)
            self.buf += data
            self.accepted.append((self.received, hashlib.sha256(data).digest()))
            self.received += len(data)
            self.eof = eof
            waiting = len(self.buf), self.received
        self._wake()
        return waiting

    def _wake(self) -> None:
        try:
            os.write(self.wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # already woken (the pipe is full) or finished

    def peek(self, size: int) -> bytes:
        with self.cond:
            return bytes(self.buf[:size])

    def consumed(self, count: int) -> None:
        with self.cond:
            del self.buf[:count]
            self.written += count
            self.cond.notify_all()

    def pending(self) -> "tuple[bool, bool]":
        """(bytes waiting, EOF due now)."""
        with self.cond:
            return bool(self.buf), self.eof and not self.buf

    def close(self) -> None:
        """The pipe is gone (EOF sent, or the command stopped reading, or ended)."""
        with self.cond:
            self.closed = True
            self.buf.clear()
            self.cond.notify_all()

    def release(self) -> None:
        self.close()
        for fd in (self.wake_r, self.wake_w):
            _close(fd)


class Control:
    """Shared between the running exec and concurrent cancel and stdin requests."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid: Optional[int] = None
        self.cancelled = False
        self.finished = False
        self.stdin: Optional[StdinFeed] = None  # an open stdin (``stdin_open``)

    def cancel(self, grace: float, done: threading.Event) -> None:
        """SIGTERM the session, SIGKILL after grace unless the run finished."""
        with self.lock:
            self.cancelled = True
            pid = None if self.finished else self.pid
        if pid is None:
            return
        signal_session(pid, signal.SIGTERM)
        if not done.wait(grace):
            signal_session(pid, signal.SIGKILL)


def _usage(t0: float, started_at: float, ru: Any) -> Dict[str, Any]:
    return {
        "wall_s": round(time.monotonic() - t0, 6),
        "user_cpu_s": round(ru.ru_utime, 6) if ru is not None else 0.0,
        "sys_cpu_s": round(ru.ru_stime, 6) if ru is not None else 0.0,
        "max_rss_kb": int(ru.ru_maxrss) if ru is not None else 0,
        "started_at": started_at,
        "ended_at": time.time(),
    }


def _termination(reason: str, status: Optional[int], message: Optional[str]) -> Dict[str, Any]:
    exit_code: Optional[int] = None
    sig: Optional[int] = None
    if status is not None:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if reason == "exited":
                reason = "signaled"
                message = f"killed by {signal_name(sig)}"
        elif os.WIFEXITED(status):
            exit_code = os.WEXITSTATUS(status)
    return {"reason": reason, "exit_code": exit_code, "signal": sig, "message": message}


_devnull: List[int] = []
_devnull_lock = threading.Lock()


def _devnull_fd() -> int:
    """One /dev/null descriptor for every command's stdin (opened on first use, in the
    agent process itself, and never closed): saves an open and a close per exec."""
    if not _devnull:
        with _devnull_lock:
            if not _devnull:
                _devnull.append(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))
    return _devnull[0]


def _close(fd: Optional[int]) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def run(
    spec: ExecSpec, control: Control, on_start: StartSink, on_output: OutputSink
) -> Dict[str, Any]:
    started_at = time.time()
    t0 = time.monotonic()
    out = StreamCapture(spec.window)
    err = StreamCapture(spec.window)
    # Plain descriptors, not Popen's PIPE: Popen would wrap each end in a buffered file
    # object we never use, and close them through an ExitStack, on every exec; and
    # posix_spawn (see spawn.py) takes descriptors only.
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    in_r: Optional[int] = None
    in_w: Optional[int] = None
    feed = control.stdin  # set when the request kept stdin open (ExecService.claim)
    if spec.stdin or feed is not None:
        in_r, in_w = os.pipe()
    cgroups = limits.CGROUPS
    watch = cgroups.begin()
    try:
        started = cgroups.spawn(
            lambda: start(
                spec.argv,
                spec.cwd,
                spec.env,
                in_r if in_r is not None else _devnull_fd(),
                out_w,
                err_w,
            )
        )
        # out of the commands' cgroup (and its lock) before waiting for the exec helper
        pid = finish(started)
    except OSError as exc:
        cgroups.exhausted(watch, {})  # ends the watch; the refusal is named below
        for fd in (out_r, err_r, in_w):
            _close(fd)
        if feed is not None:
            feed.release()
        on_start(None)
        failed: Dict[str, Any] = {
            "termination": _termination("agent_error", None, f"cannot start command: {exc}"),
            "stdout": out.result(),
            "stderr": err.result(),
            "usage": _usage(t0, started_at, None),
            "children_remained": False,
        }
        if exc.errno == errno.EAGAIN:  # the fork was refused: pids.max (or RLIMIT_NPROC)
            failed["resource_exhausted"] = {
                "kind": "pids",
                "limit": cgroups.pids_limit(),
                "message": "the sandbox's process limit was reached: the command "
                "could not be started",
            }
        return failed
    finally:
        # Only the child may hold the write ends, or we would never see EOF.
        for fd in (out_w, err_w, in_r):
            _close(fd)
    with control.lock:
        control.pid = pid
        cancelled_early = control.cancelled
    if cancelled_early:
        signal_session(pid, signal.SIGKILL)
    on_start(pid)

    # poll(2), not a selectors.DefaultSelector: epoll costs a descriptor plus a
    # syscall per register/unregister/close, and the Python layer on top of it was a
    # measurable share of the agent's CPU per exec; a command has at most 4 fds.
    poller = select.poll()
    tags: Dict[int, str] = {out_r: "stdout", err_r: "stderr"}
    captures = {out_r: out, err_r: err}
    poller.register(out_r, select.POLLIN)
    poller.register(err_r, select.POLLIN)
    pending = memoryview(spec.stdin or b"")
    in_polled = False  # in_w registered for POLLOUT (an open stdin: only with input)

    def feed_stdin() -> None:
        """Open stdin: poll for room while input waits; close the pipe at EOF."""
        nonlocal in_w, in_polled
        assert feed is not None
        if in_w is None:
            return
        has_data, eof_now = feed.pending()
        if has_data and not in_polled:
            poller.register(in_w, select.POLLOUT)
            in_polled = True
        elif not has_data:
            if in_polled:
                poller.unregister(in_w)
                in_polled = False
            if eof_now:
                os.close(in_w)
                in_w = None
                feed.close()

    if in_w is not None:
        os.set_blocking(in_w, False)
        tags[in_w] = "stdin"
        if feed is None:
            poller.register(in_w, select.POLLOUT)
        else:
            poller.register(feed.wake_r, select.POLLIN)
            tags[feed.wake_r] = "wake"
            feed_stdin()
    pidfd: Optional[int] = None
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is not None:
        try:
            pidfd = pidfd_open(pid)
        except OSError:
            pidfd = None
        else:
            poller.register(pidfd, select.POLLIN)
            tags[pidfd] = "exit"

    status: Optional[int] = None
    rusage: Any = None
    exited_at = 0.0
    open_streams = 2
    reason: Optional[str] = None
    kill_at: Optional[float] = None
    children_remained = False
    deadline = t0 + spec.timeout if spec.timeout is not None else None

    def reap(flags: int) -> None:
        nonlocal status, rusage, exited_at
        rpid, st, ru = os.wait4(pid, flags)
        if rpid == pid:
            status, rusage, exited_at = st, ru, time.monotonic()

    def terminate(why: str) -> None:
        nonlocal reason, kill_at
        reason = why
        signal_session(pid, signal.SIGTERM)
        kill_at = time.monotonic() + spec.kill_grace

    try:
        while open_streams or status is None:
            wake: Optional[float] = None
            if deadline is not None or kill_at is not None or status is not None:
                now = time.monotonic()
                if deadline is not None and reason is None:
                    if now >= deadline:
                        terminate("timeout")
                    else:
                        wake = deadline
                if kill_at is not None:
                    if now >= kill_at:
                        signal_session(pid, signal.SIGKILL)
                        kill_at = None
                    elif wake is None or kill_at < wake:
                        wake = kill_at
                if status is not None:
                    # Main process gone but a background child holds the pipes.
                    if now >= exited_at + CHILDREN_GRACE_S:
                        children_remained = True
                        break
                    if wake is None or exited_at + CHILDREN_GRACE_S < wake:
                        wake = exited_at + CHILDREN_GRACE_S
            if pidfd is None and status is None:
                if not open_streams and wake is None:
                    reap(0)
                    continue
                fallback = time.monotonic() + _FALLBACK_POLL_S
                if wake is None or fallback < wake:
                    wake = fallback
            # poll takes milliseconds and rounds a fraction up, so no busy loop.
            timeout_ms = None if wake is None else max(0.0, wake - time.monotonic()) * 1e3
            for fd, events in poller.poll(timeout_ms):
                tag = tags[fd]
                if tag == "exit":
                    poller.unregister(fd)
                    reap(os.WNOHANG)
                elif tag == "wake":
                    with contextlib.suppress(OSError):
                        os.read(fd, 4096)
                    feed_stdin()
                elif tag == "stdin" and feed is not None:
                    try:
                        wrote = os.write(fd, feed.peek(READ_SIZE))
                    except OSError:  # EPIPE: the command closed its stdin
                        poller.unregister(fd)
                        in_polled = False
                        os.close(fd)
                        in_w = None
                        feed.close()
                    else:
                        feed.consumed(wrote)
                        feed_stdin()
                elif tag == "stdin":
                    try:
                        pending = pending[os.write(fd, pending[:READ_SIZE]) :]
                    except OSError:
                        pending = pending[:0]
                    if not pending:
                        poller.unregister(fd)
                        os.close(fd)
                        in_w = None
                else:
                    # POLLHUP without POLLIN: no writer left and nothing buffered.
                    data = os.read(fd, READ_SIZE) if events & select.POLLIN else b""
                    if not data:
                        poller.unregister(fd)
                        open_streams -= 1
                        continue
                    cap = captures[fd]
                    cap.feed(data)
                    on_output(tag, data)
                    if spec.limit is not None and cap.total > spec.limit and reason is None:
                        terminate("output_limit")
            if pidfd is None and status is None:
                reap(os.WNOHANG)
    except BaseException:
        # Never leave a command running (and the reap below blocking) on an agent bug.
        signal_session(pid, signal.SIGKILL)
        raise
    finally:
        for fd in (in_w, out_r, err_r, pidfd):
            _close(fd)
        if feed is not None:
            feed.release()
        with control.lock:
            control.finished = True
            cancelled = control.cancelled
        if reason is not None or cancelled:
            # Timeout/cancel kill the command's whole tree, stragglers included.
            signal_session(pid, signal.SIGKILL)
            children_remained = False
        if status is None:
            reap(0)

    if cancelled:
        term = _termination("cancelled", status, "cancelled by request")
    elif reason == "timeout":
        term = _termination("timeout", status, f"timed out after {spec.timeout}s")
    elif reason == "output_limit":
        term = _termination("output_limit", status, f"output exceeded {spec.limit} bytes")
    else:
        term = _termination("exited", status, None)
    result: Dict[str, Any] = {
        "termination": term,
        "stdout": out.result(),
        "stderr": err.result(),
        "usage": _usage(t0, started_at, rusage),
        "children_remained": children_remained,
    }
    exhausted = cgroups.exhausted(watch, term)
    if exhausted is None and reason == "output_limit":
        exhausted = {
            "kind": "output",
            "limit": spec.limit,
            "message": f"the command's output exceeded its {spec.limit}-byte cap "
            "(output_limit): it was ended",
        }
    if exhausted is not None:
        result["resource_exhausted"] = exhausted
    return result
