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


def parse_user(value: str) -> Tuple[int, int]:
    """``--user UID:GID`` (numeric: the launcher resolved the image's names)."""
    uid, sep, gid = value.partition(":")
    if not (sep and uid.isdigit() and gid.isdigit()):
        raise ValueError(f"--user wants UID:GID, got {value!r}")
    return int(uid), int(gid)


def run_as(uid: int, gid: int) -> None:
    """Every command from now on runs as uid:gid with no supplementary groups (the
    agent, root of the sandbox, keeps CAP_SETUID/CAP_SETGID for that)."""
    _run_as[0] = None if (uid, gid) == (os.getuid(), os.getgid()) else (uid, gid)


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


def spawn(
    argv: List[str], cwd: str, env: Dict[str, str], stdin: int, stdout: int, stderr: int
) -> int:
    """Start argv in a new session with the given fds as 0/1/2; return its pid.
    The caller reaps it (wait4). OSError when it cannot be started."""
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
        try:
            return int(
                _posix_spawn(
                    argv[0], argv, env, file_actions=actions, setsid=True, setsigdef=_SIGDEF
                )
            )
        except (NotImplementedError, TypeError):
            _state["usable"] = False  # no POSIX_SPAWN_SETSID here: Popen from now on
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        **identity(),
    )
    # We reap it with wait4 ourselves; Popen must never wait for (and reap) it.
    proc.returncode = -1
    return proc.pid
