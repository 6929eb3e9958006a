"""Starts the pod agent from the self-contained bundle, inside any image.

Runs on the bundle's own interpreter (stdlib only, Python >= 3.8), started as
``<bundle>/lib/ld.so --library-path <bundle>/lib <bundle>/bin/python3 -I -m
hedgerow_launcher ...``. Two commands:

``inject --to DIR [--token-from F --token-to F] [--state-dir DIR]``
    The Kubernetes init container: copies the bundle into the shared emptyDir, and
    the agent token from the Secret volume (mounted only in the init container) into
    a memory-backed emptyDir, where the agent deletes it after reading it. With
    snapshots, ``--state-dir`` is the sandbox's state claim: its ``workspace`` and
    ``tmp`` (the main container's subPaths) are made 0777 and 1777 like the emptyDirs
    they replace, when missing; a restored claim's are left as the snapshot has them.

``run -- AGENT_ARGS``
    Starts ``podagent`` on the bundled interpreter with the environment untouched:
    the loader gets the library path as an argument and the interpreter runs
    isolated (-I), so no PYTHONHOME/LD_LIBRARY_PATH is ever set and the image's own
    values (a CUDA image's LD_LIBRARY_PATH, a venv's PYTHONPATH) reach commands as
    the image defines them. As PID 1 (a pod's main container) it stays as a tiny
    init: reaps orphans, forwards SIGTERM/SIGINT/SIGHUP to the agent, and exits with
    the agent's status so a dead agent ends the pod (the backend sees the pod fail).
    Elsewhere (the local backend's bwrap already has an init) it execs the agent.
"""

# ruff: noqa: UP006, UP035, UP045 - runs on bundled interpreters down to Python 3.8
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from typing import Dict, List, Optional

BUNDLE = sys.prefix
RESTORE_VAR = "HEDGEROW_AGENT_ENV_RESTORE"


def agent_argv(bundle: str, agent_args: List[str]) -> List[str]:
    lib = os.path.join(bundle, "lib")
    return [
        os.path.join(lib, "ld.so"),
        "--library-path",
        lib,
        os.path.join(bundle, "bin", "python3"),
        "-I",
        "-m",
        "podagent",
        *agent_args,
    ]


def pristine_environ() -> Dict[str, str]:
    """The environment exactly as the container runtime passed it.

    The bundled interpreter itself may have changed ``os.environ`` already: in the
    C locale it coerces ``LC_CTYPE=C.UTF-8`` into it (PEP 538), and ``-I`` cannot turn
    that off. ``/proc/self/environ`` still holds the original block.
    """
    try:
        with open("/proc/self/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return dict(os.environ)
    env: Dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env[os.fsdecode(key)] = os.fsdecode(value)
    return env


def agent_env(pristine: Dict[str, str]) -> Dict[str, str]:
    """The agent's environment: the pristine one plus the restore map the agent applies
    to what commands see (the agent's interpreter coerces LC_CTYPE again)."""
    env = dict(pristine)
    restore: Dict[str, Optional[str]] = {}
    try:  # a launcher (the local backend's) may already ask for restores: keep them
        given = json.loads(pristine.get(RESTORE_VAR) or "{}")
        if isinstance(given, dict):
            restore.update(given)
    except ValueError:
        pass
    restore["LC_CTYPE"] = pristine.get("LC_CTYPE")
    env[RESTORE_VAR] = json.dumps(restore)
    return env


STATE_DIRS = (("workspace", 0o777), ("tmp", 0o1777))


def prepare_state(state_dir: str) -> List[str]:
    """Creates the state claim's missing subPath directories with the modes of the
    emptyDirs they replace (any uid the image runs as can write them); returns the
    ones made. Existing ones (a restore) keep the snapshot's modes and owners."""
    made = []
    for name, mode in STATE_DIRS:
        path = os.path.join(state_dir, name)
        if os.path.lexists(path):
            continue
        os.mkdir(path)
        os.chmod(path, mode)  # not through mkdir: the umask would narrow it
        made.append(name)
    return made


def inject(
    bundle: str,
    dest: str,
    token_from: Optional[str],
    token_to: Optional[str],
    state_dir: Optional[str] = None,
) -> int:
    if state_dir:
        prepare_state(state_dir)
    staging = dest.rstrip("/") + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(bundle, staging, symlinks=True)
    # rename last: a main container that starts early never sees half a bundle
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(staging, dest)
    if token_from and token_to:
        with open(token_from, "rb") as src:
            token = src.read()
        tmp = token_to + ".tmp"
        # 0644 in the (world-writable) emptyDir: the image may run as any uid and the
        # agent must be able to read and unlink it; it is deleted at agent start.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, token)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o644)
        os.rename(tmp, token_to)
    print(f"hedgerow: agent bundle injected into {dest}", file=sys.stderr, flush=True)
    return 0


def supervise(argv: List[str], env: Dict[str, str]) -> int:
    child = os.fork()
    if child == 0:  # pragma: no cover - replaced by exec
        try:
            os.execve(argv[0], argv, env)  # noqa: S606 - argv is the bundle's own
        finally:
            os._exit(127)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 1
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            continue
        if pid == child:  # orphans reparented to us are reaped and forgotten
            code = os.waitstatus_to_exitcode(status)
            print(f"hedgerow: agent exited ({code})", file=sys.stderr, flush=True)
            return code if code >= 0 else 128 - code


def main(args: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="hedgerow_launcher")
    sub = parser.add_subparsers(dest="command", required=True)
    p_inject = sub.add_parser("inject")
    p_inject.add_argument("--to", required=True)
    p_inject.add_argument("--token-from")
    p_inject.add_argument("--token-to")
    p_inject.add_argument("--state-dir")
    p_run = sub.add_parser("run")
    p_run.add_argument("agent_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(args)
    if ns.command == "inject":
        return inject(BUNDLE, ns.to, ns.token_from, ns.token_to, ns.state_dir)
    agent_args = ns.agent_args[1:] if ns.agent_args[:1] == ["--"] else ns.agent_args
    argv = agent_argv(BUNDLE, agent_args)
    env = agent_env(pristine_environ())
    if os.getpid() != 1:
        os.execve(argv[0], argv, env)  # noqa: S606 - argv is the bundle's own
    return supervise(argv, env)


if __name__ == "__main__":
    sys.exit(main())
