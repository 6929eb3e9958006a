"""Starting a command as the leader of its own session, on the given descriptors.

Popen (close_fds, restore_signals, start_new_session) is the general way. When the
command runs in the agent's own working directory — the default: the launcher starts
the agent in its workdir — and names its program by absolute path (every string
command: the shell), os.posix_spawn does the same in C: libc clones with CLONE_VFORK
and execs, reporting exec errors, without Popen's Python prelude, its error pipe or
the child's close_range. posix_spawn cannot change directory (hence the condition)
and cannot close descriptors; every descriptor Python opens is close-on-exec
(PEP 446), and those the agent inherited from its launcher are made close-on-exec
once, before the first such spawn, so a command sees only 0, 1 and 2 either way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

# The dispositions Popen(restore_signals=True) resets: CPython ignores them itself.
_SIGDEF = tuple(
    getattr(signal, name) for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if hasattr(signal, name)
)
_posix_spawn = getattr(os, "posix_spawn", None)
_DUP2 = getattr(os, "POSIX_SPAWN_DUP2", None)
_state = {"usable": _posix_spawn is not None and _DUP2 is not None, "sealed": False}
_seal_lock = threading.Lock()
# (uid, gid) every command runs as (an OCI image's User), None: the agent's own ids
_run_as: List[Optional[Tuple[int, int]]] = [None]
# A sandboxed agent's real and saved uid (the zygote sets them; its effective uid stays
# the sandbox's root): a process may signal another only when its real or effective
# uid is the other's real or saved uid (or with CAP_KILL), and no command has this one.
AGENT_UID = 65535
# The program every command is started through when the agent's real uid is AGENT_UID
# (the local backend's exec_helper.c): it sets all the command's ids to the effective
# ones and its oom_score_adj to 500, then execs it. None: commands start directly.
_helper: List[Optional[str]] = [None]
# the helper's descriptor for an exec failure's errno (posix_spawn puts it there)
_ERR_FD = 3


def parse_user(value: str) -> Tuple[int, int]:
    """``--user UID:GID`` (numeric: the launcher resolved the image's names)."""
    uid, sep, gid = value.partition(":")
    if not (sep and uid.isdigit() and gid.isdigit()):
        raise ValueError(f"--user wants UID:GID, got {value!r}")
    return int(uid), int(gid)


def run_as(uid: int, gid: int) -> None:
    """Every command from now on runs as uid:gid with no supplementary groups (the
    agent, root of the sandbox, keeps CAP_SETUID/CAP_SETGID for that)."""
    _run_as[0] = None if (uid, gid) == (os.geteuid(), os.getegid()) else (uid, gid)


def use_helper(path: str) -> None:
    """Start every command through ``path`` (``--exec-helper``, exec_helper.c)."""
    _helper[0] = path


def helper() -> Optional[str]:
    return _helper[0]


def wrap(argv: List[str], err_fd: int) -> List[str]:
    """``argv`` as started through the helper, which reports an exec failure on
    ``err_fd``; ``argv`` itself without one."""
    helper = _helper[0]
    return argv if helper is None else [helper, str(err_fd), *argv]


def await_exec(pid: int, err_r: int, program: str) -> None:
    """After a start through the helper: returns once the command's program runs (the
    descriptor closes on exec); raises the exec's OSError, the helper reaped, if not."""
    try:
        data = b""
        while len(data) < 4:
            chunk = os.read(err_r, 4 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(err_r)
    if len(data) == 4:
        code = int.from_bytes(data, sys.byteorder)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        raise OSError(code, os.strerror(code), program)


def identity() -> Dict[str, Any]:
    """Popen's keyword arguments for the commands' identity ({} for the agent's)."""
    who = _run_as[0]
    if who is None:
        return {}
    return {"user": who[0], "group": who[1], "extra_groups": []}


def _seal_inherited_fds() -> bool:
    """Make every descriptor above 2 close-on-exec, once; False if /proc is missing."""
    with _seal_lock:
        if not _state["sealed"]:
            try:
                names = os.listdir("/proc/self/fd")
            except OSError:
                _state["usable"] = False
                return False
            for name in names:
                fd = int(name)
                if fd > 2:
                    try:
                        if os.get_inheritable(fd):
                            os.set_inheritable(fd, False)
                    except OSError:
                        pass  # the listing's own descriptor, already closed
            _state["sealed"] = True
    return True


def _in_own_cwd(cwd: str) -> bool:
    try:
        here = os.stat(".")
        there = os.stat(cwd)
    except OSError:
        return False
    # st_nlink 0: our directory was removed (its inode number may be reused).
    return here.st_nlink > 0 and (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


class Started:
    """A command started (``start``), perhaps still in the helper: ``finish`` waits
    until its own program runs (or raises the exec's error)."""

    __slots__ = ("err_r", "pid", "program")

    def __init__(self, pid: int, err_r: Optional[int], program: str) -> None:
        self.pid, self.err_r, self.program = pid, err_r, program


def start(
    argv: List[str], cwd: str, env: Dict[str, str], stdin: int, stdout: int, stderr: int
) -> Started:
    """Start argv in a new session with the given fds as 0/1/2 (the caller reaps it,
    wait4). Returns once the process exists and runs the helper, if any; ``finish``
    waits for the command's own program, outside what the caller holds (the commands'
    cgroup). OSError when it cannot be started."""
    if _helper[0] is None:
        return Started(_spawn(argv, cwd, env, stdin, stdout, stderr, None), None, argv[0])
    err_r, err_w = os.pipe()
    try:
        pid = _spawn(argv, cwd, env, stdin, stdout, stderr, err_w)
    except BaseException:
        os.close(err_r)
        raise
    finally:
        os.close(err_w)
    return Started(pid, err_r, argv[0])


def finish(started: Started) -> int:
    """The pid, once its program runs; OSError (the helper reaped) when it could not."""
    if started.err_r is not None:
        await_exec(started.pid, started.err_r, started.program)
    return started.pid


def _spawn(
    argv: List[str],
    cwd: str,
    env: Dict[str, str],
    stdin: int,
    stdout: int,
    stderr: int,
    err_w: Optional[int],
) -> int:
    if (
        _state["usable"]
        and _run_as[0] is None  # posix_spawn cannot change ids
        and min(stdin, stdout, stderr) > 2
        and os.path.isabs(argv[0])
        and _in_own_cwd(cwd)
        and (_state["sealed"] or _seal_inherited_fds())
    ):
        assert _posix_spawn is not None
        actions = [(_DUP2, stdin, 0), (_DUP2, stdout, 1), (_DUP2, stderr, 2)]
        if err_w is not None:
            actions.append((_DUP2, err_w, _ERR_FD))  # after 0-2: 3 may be a source
        started = wrap(argv, _ERR_FD)
        try:
            return int(
                _posix_spawn(
                    started[0], started, env, file_actions=actions, setsid=True, setsigdef=_SIGDEF
                )
            )
        except (NotImplementedError, TypeError):
            _state["usable"] = False  # no POSIX_SPAWN_SETSID here: Popen from now on
    proc = subprocess.Popen(
        argv if err_w is None else wrap(argv, err_w),
        cwd=cwd,
        env=env,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        pass_fds=() if err_w is None else (err_w,),
        **identity(),
    )
    # We reap it with wait4 ourselves; Popen must never wait for (and reap) it.
    proc.returncode = -1
    return proc.pid
