"""What runs in the sandbox, for a snapshot's fingerprint (``GET /state``).

* ``ports``: listening TCP sockets and bound UDP sockets of the sandbox's network
  namespace (``/proc/net/{tcp,tcp6,udp,udp6}``), the agent's own port left out. The
  address is reduced to its kind — ``*`` (any), ``loopback`` or ``address`` (one of the
  sandbox's own, which a restored copy gets anew) — so a server bound to the
  sandbox's IP matches in a child that has another IP.
* ``processes``: the argv of every process the agent can see in the sandbox's pid
  namespace, except the namespace's init (``pause``) and the agent itself, sorted.
* ``env``: the environment commands run with (the image's, without the agent's
  bookkeeping).

Stdlib only; nothing here writes.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any, Dict, List, Optional, Set, Tuple

# /proc/net/tcp "st" column: 0A is LISTEN; a UDP socket with no peer is "07" (CLOSE).
_LISTEN = "0A"
_UDP_BOUND = "07"


def _address_kind(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        packed = struct.pack("<I", struct.unpack(">I", raw)[0])
        text = socket.inet_ntop(socket.AF_INET, packed)
        if text == "0.0.0.0":
            return "*"
        return "loopback" if text.startswith("127.") else "address"
    # IPv6: four little-endian 32-bit words
    words = struct.unpack(">4I", raw)
    packed = struct.pack("<4I", *words)
    text = socket.inet_ntop(socket.AF_INET6, packed)
    if text == "::":
        return "*"
    if text == "::1":
        return "loopback"
    if text.startswith("::ffff:"):
        v4 = text[len("::ffff:") :]
        if v4 == "0.0.0.0":
            return "*"
        return "loopback" if v4.startswith("127.") else "address"
    return "address"


def _parse_net(text: str, proto: str, wanted: str) -> List[Tuple[str, str, int]]:
    out = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or fields[3] != wanted:
            continue
        addr, _, port_hex = fields[1].partition(":")
        try:
            out.append((proto, _address_kind(addr), int(port_hex, 16)))
        except (ValueError, OSError, struct.error):
            continue
    return out


def listening_ports(own_port: Optional[int], proc: str = "/proc") -> List[Dict[str, Any]]:
    """Sorted, deduplicated ``{"proto", "address", "port"}`` (tcp6/udp6 reported as
    tcp/udp: a dual-stack socket is one port)."""
    seen: Set[Tuple[str, str, int]] = set()
    for name, proto, wanted in (
        ("tcp", "tcp", _LISTEN),
        ("tcp6", "tcp", _LISTEN),
        ("udp", "udp", _UDP_BOUND),
        ("udp6", "udp", _UDP_BOUND),
    ):
        try:
            with open(os.path.join(proc, "net", name)) as f:
                text = f.read()
        except OSError:
            continue
        for entry in _parse_net(text, proto, wanted):
            if entry[0] == "tcp" and own_port is not None and entry[2] == own_port:
                continue
            seen.add(entry)
    return [{"proto": p, "address": a, "port": n} for p, a, n in sorted(seen)]


def processes(own_pid: int, proc: str = "/proc") -> List[List[str]]:
    """The argv of each visible process but init and the agent, sorted (kernel threads
    and processes that ended during the walk have no argv and are left out)."""
    out = []
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid in (1, own_pid):
            continue
        try:
            with open(os.path.join(proc, entry, "cmdline"), "rb") as f:
                raw = f.read()
        except OSError:
            continue
        if not raw:
            continue
        argv = [part.decode("utf-8", "replace") for part in raw.rstrip(b"\0").split(b"\0")]
        out.append(argv)
    return sorted(out)


def sandbox_state(own_port: Optional[int], base_env: Dict[str, str]) -> Dict[str, Any]:
    return {
        "ports": listening_ports(own_port),
        "processes": processes(os.getpid()),
        "env": dict(sorted(base_env.items())),
    }
