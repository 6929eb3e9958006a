"""python3 -m podagent --listen HOST:PORT --token-file PATH [...]"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from typing import List, Optional, Tuple

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


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="podagent")
    parser.add_argument("--listen", type=parse_listen, required=True)
    parser.add_argument("--token-file")
    parser.add_argument("--unlink-token", action="store_true")
    parser.add_argument("--workdir", default="/workspace")
    parser.add_argument("--log-file")
    parser.add_argument("--max-pty", type=int, default=8)
    # a launcher's pipe: one byte once the socket listens (the zygote answers then)
    parser.add_argument("--listening-fd", type=int)
    args = parser.parse_args(argv)

    # Launchers often start us as a shell's background job, which POSIX makes ignore
    # SIGINT/SIGQUIT; ignored signals survive exec, so every command (and a PTY's
    # Ctrl-C) would inherit that. Commands must see default dispositions.
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    token = read_token(args.token_file, args.unlink_token)
    try:
        base_env = build_base_env(os.environ)
    except EnvError as exc:
        raise SystemExit(f"podagent: {exc}") from None
    scrub_own_environ()
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
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
