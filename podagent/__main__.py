"""python3 -m podagent --listen HOST:PORT --token-file PATH [...]"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import limits, spawn
from .environment import TOKEN_VAR, EnvError, build_base_env, find_shell, scrub_own_environ
from .log import JsonLog
from .server import AgentServer, AgentState


def parse_listen(value: str) -> Tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError("--listen must be HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def read_token(path: Optional[str], unlink: bool) -> str:
    token = ""
    if path:
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
        if unlink:
            os.unlink(path)
    if not token:
        token = os.environ.get(TOKEN_VAR, "").strip()
    if not token:
        raise SystemExit("podagent: no token (--token-file or HEDGEROW_AGENT_TOKEN)")
    return token


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="podagent")
    parser.add_argument("--listen", type=parse_listen, required=True)
    parser.add_argument("--token-file")
    parser.add_argument("--unlink-token", action="store_true")
    parser.add_argument("--workdir", default="/workspace")
    parser.add_argument("--log-file")
    parser.add_argument("--max-pty", type=int, default=8)
    # a launcher's pipe: one byte once the socket listens (the zygote answers then)
    parser.add_argument("--listening-fd", type=int)
    # descriptors of the sandbox's cgroup files, opened by the launcher (limits.py)
    parser.add_argument("--cgroup-fds", type=limits.parse_fds)
    # an image's User: commands run as UID:GID (spawn.py), the agent stays root
    parser.add_argument("--user", type=spawn.parse_user)
    # the program commands are started through (spawn.py: the exec helper)
    parser.add_argument("--exec-helper")
    return parser


# The options as launchers pass them (``--name value`` or a bare flag): name → (dest,
# converter); None for a flag. Must say what build_parser says (tested).
_PLAIN_OPTIONS: Dict[str, Optional[Tuple[str, Callable[[str], Any]]]] = {
    "--listen": ("listen", parse_listen),
    "--token-file": ("token_file", str),
    "--unlink-token": None,
    "--workdir": ("workdir", str),
    "--log-file": ("log_file", str),
    "--max-pty": ("max_pty", int),
    "--listening-fd": ("listening_fd", int),
    "--cgroup-fds": ("cgroup_fds", limits.parse_fds),
    "--user": ("user", spawn.parse_user),
    "--exec-helper": ("exec_helper", str),
}


def _parse_plain(argv: List[str]) -> Optional[argparse.Namespace]:
    """argv in the plain forms launchers use, read without argparse; None for anything
    else (``--name=value``, ``--help``, a bad value, a missing ``--listen``).

    Building the parser and parsing cost a zygote-forked agent ~1.5 ms of its ~5 ms
    start: the parser's objects and gettext's path lookups, copied on write.
    """
    values: Dict[str, Any] = {
        "listen": None,
        "token_file": None,
        "unlink_token": False,
        "workdir": "/workspace",
        "log_file": None,
        "max_pty": 8,
        "listening_fd": None,
        "cgroup_fds": None,
        "user": None,
        "exec_helper": None,
    }
    i = 0
    while i < len(argv):
        name = argv[i]
        if name not in _PLAIN_OPTIONS:
            return None
        option = _PLAIN_OPTIONS[name]
        if option is None:
            values["unlink_token"] = True
            i += 1
            continue
        if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
            return None
        dest, convert = option
        try:
            values[dest] = convert(argv[i + 1])
        except (ValueError, argparse.ArgumentTypeError):
            return None
        i += 2
    if values["listen"] is None:
        return None
    return argparse.Namespace(**values)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    args = sys.argv[1:] if argv is None else list(argv)
    plain = _parse_plain(args)
    return plain if plain is not None else build_parser().parse_args(args)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)

    # Launchers often start us as a shell's background job, which POSIX makes ignore
    # SIGINT/SIGQUIT; ignored signals survive exec, so every command (and a PTY's
    # Ctrl-C) would inherit that. Commands must see default dispositions.
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    if args.cgroup_fds:
        for fds in args.cgroup_fds.values():
            for fd in fds:
                os.set_inheritable(fd, False)  # commands never get them
        # nor reopen them through /proc/<agent>/fd (same uid): not dumpable, as a
        # zygote-started agent already is
        limits.not_dumpable()
        limits.configure(args.cgroup_fds)
    token = read_token(args.token_file, args.unlink_token)
    try:
        base_env = build_base_env(os.environ)
    except EnvError as exc:
        raise SystemExit(f"podagent: {exc}") from None
    scrub_own_environ()
    if args.user is not None:
        spawn.run_as(*args.user)
    if args.exec_helper is not None:
        spawn.use_helper(args.exec_helper)
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    limits.CGROUPS.sync_dir = workdir  # on the sandbox's volume: see disk_exhausted
    log = JsonLog(args.log_file)
    state = AgentState(token, base_env, find_shell(base_env), workdir, log, args.max_pty)
    server = AgentServer(args.listen, state)
    log.write("listening", address=str(server.server_address[:2]), pid=os.getpid())
    if args.listening_fd is not None:
        os.write(args.listening_fd, b"1")
        os.close(args.listening_fd)
    host, port = server.server_address[:2]
    print(f"podagent listening on {host!s}:{port}", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever(poll_interval=3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
