"""Signalling a command's whole session.

A command runs as the leader of its own session, so its session id equals its
pid. Killing its process group is not enough: a shell with job control (`set -m`,
interactive bash in a PTY) puts jobs into other groups of the same session, so
we also scan /proc for every group whose session is the command's.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Set


def _session_groups(sid: int) -> Set[int]:
    groups: Set[int] = set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return groups
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                raw = fh.read()
        except OSError:
            continue
        # comm (field 2) may contain spaces and parens: split after the last ')'.
        fields = raw[raw.rfind(b")") + 2 :].split()
        if len(fields) > 3 and int(fields[3]) == sid:
            groups.add(int(fields[2]))
    return groups


def signal_session(sid: int, sig: int) -> None:
    """Send sig to the process group `sid` and every other group in session `sid`."""
    groups = {sid}
    groups.update(_session_groups(sid))
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def signal_number(name: str) -> int:
    name = name.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    sig = getattr(signal, name, None)
    if not isinstance(sig, signal.Signals):
        raise ValueError(f"unknown signal {name}")
    return int(sig)


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"SIG{num}"
