"""The runtime half of a snapshot's fingerprint: listening ports, processes (argv) and
environment, read from the agent (``GET /state``) after the probes at capture and
after the services restarted and the probes ran in every restored child
(docs/snapshots.md, "Fingerprints").

A part the client declared volatile is recorded and shown, never compared:
``"ports"``, ``"port:5432"``, ``"processes"``, ``"process:postgres"`` (by argv[0]'s
base name), ``"env"``, ``"env:NAME"``.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from typing import Any

from apps.core.errors import ValidationFailed

MAX_VOLATILE = 64
MAX_PROCESSES = 512
MAX_ARG = 512  # characters kept of each argument
_VOLATILE = re.compile(
    r"^(ports|processes|env|port:\d{1,5}|process:[^\s/]{1,128}|env:[^=\s]{1,256})$"
)
# Environment values under such names are kept as a hash: the fingerprint is shown in
# the API and the dashboard, and a differing token is still a differing state.
_SECRET_NAME = re.compile(r"secret|token|passw|key|credential|auth", re.IGNORECASE)


def validate_volatile(raw: Any) -> list[str]:
    """The client's volatile declarations: a list of the forms above."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_VOLATILE:
        raise ValidationFailed(f"volatile: a list of at most {MAX_VOLATILE}", field="volatile")
    for i, item in enumerate(raw):
        if not isinstance(item, str) or not _VOLATILE.fullmatch(item):
            raise ValidationFailed(
                f"volatile[{i}]: one of ports, port:N, processes, process:NAME, env, env:NAME",
                field="volatile",
            )
    return sorted(set(raw))


def _env_value(name: str, value: str) -> str:
    if _SECRET_NAME.search(name):
        return "sha256:" + hashlib.sha256(value.encode()).hexdigest()[:16]
    return value


def runtime_fingerprint(state: dict[str, Any]) -> dict[str, Any]:
    """What the fingerprint keeps of the agent's ``/state`` answer."""
    ports = [
        {"proto": str(p.get("proto")), "address": str(p.get("address")), "port": int(p["port"])}
        for p in state.get("ports") or []
        if isinstance(p, dict) and isinstance(p.get("port"), int)
    ]
    processes = [
        [str(arg)[:MAX_ARG] for arg in argv]
        for argv in (state.get("processes") or [])[:MAX_PROCESSES]
        if isinstance(argv, list) and argv
    ]
    env = {str(k): _env_value(str(k), str(v)) for k, v in sorted((state.get("env") or {}).items())}
    return {"ports": sorted(ports, key=_port_key), "processes": sorted(processes), "env": env}


def _port_key(port: dict[str, Any]) -> tuple[str, str, int]:
    return (port["proto"], port["address"], port["port"])


def _process_name(argv: list[str]) -> str:
    return argv[0].rsplit("/", 1)[-1] if argv else ""


def runtime_diff(
    expected: dict[str, Any], actual: dict[str, Any], volatile: list[str]
) -> list[dict[str, Any]]:
    """What differs between the capture's runtime fingerprint and a child's, volatile
    parts left out: ``{"fingerprint": "ports" | "processes", "missing", "unexpected"}``
    and ``{"env": NAME, "expected", "actual"}`` (null: unset). A capture without a
    runtime part (an agent without ``/state``) compares nothing for it."""
    skip = set(volatile)
    out: list[dict[str, Any]] = []
    if "ports" in expected and "ports" not in skip:
        ignored = {int(v.split(":", 1)[1]) for v in skip if v.startswith("port:")}
        want = Counter(_port_key(p) for p in expected["ports"] if p["port"] not in ignored)
        got = Counter(_port_key(p) for p in actual.get("ports", []) if p["port"] not in ignored)
        if want != got:
            out.append(
                {
                    "fingerprint": "ports",
                    "missing": [_port_dict(k) for k in sorted((want - got).elements())],
                    "unexpected": [_port_dict(k) for k in sorted((got - want).elements())],
                }
            )
    if "processes" in expected and "processes" not in skip:
        ignored_names = {v.split(":", 1)[1] for v in skip if v.startswith("process:")}
        want_p = Counter(
            tuple(a) for a in expected["processes"] if _process_name(a) not in ignored_names
        )
        got_p = Counter(
            tuple(a) for a in actual.get("processes", []) if _process_name(a) not in ignored_names
        )
        if want_p != got_p:
            out.append(
                {
                    "fingerprint": "processes",
                    "missing": [list(a) for a in sorted((want_p - got_p).elements())],
                    "unexpected": [list(a) for a in sorted((got_p - want_p).elements())],
                }
            )
    if "env" in expected and "env" not in skip:
        ignored_env = {v.split(":", 1)[1] for v in skip if v.startswith("env:")}
        want_e: dict[str, str] = expected["env"]
        got_e: dict[str, str] = actual.get("env", {})
        for name in sorted(set(want_e) | set(got_e)):
            if name in ignored_env or want_e.get(name) == got_e.get(name):
                continue
            out.append({"env": name, "expected": want_e.get(name), "actual": got_e.get(name)})
    return out


def _port_dict(key: tuple[str, str, int]) -> dict[str, Any]:
    return {"proto": key[0], "address": key[1], "port": key[2]}
