"""Cost of the local backend's cold path per sandbox, without the control plane.

    .venv/bin/python -m bench.provision_cost [N]

Provisions N `host` sandboxes one after another under a private instance (every
other one with network access), waits for each agent's /health, destroys them, and
prints per-sandbox wall time of each step and the CPU of this process plus its
reaped children (ip, nft, bwrap launchers; the detached agents' own start-up CPU is
not included), then the same CPU split by part of the local backend: network
(netns, veth, nft, address claims), cgroups, the agent launch, meta.json writes and
the rest (directories, locks, kills).
"""

from __future__ import annotations

import collections
import functools
import os
import resource
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def account(parts: dict[str, float], obj: Any, names: tuple[str, ...], part: str) -> None:
    """Wrap ``obj``'s methods so the CPU spent in them is added to ``parts[part]``
    (outermost call only: nested accounted calls are not counted twice)."""
    for name in names:
        fn: Callable[..., Any] = getattr(obj, name)

        @functools.wraps(fn)
        def wrapped(*args: Any, _fn: Callable[..., Any] = fn, **kwargs: Any) -> Any:
            if parts.get("_depth", 0):
                return _fn(*args, **kwargs)
            parts["_depth"] = 1
            c0 = cpu_s()
            try:
                return _fn(*args, **kwargs)
            finally:
                parts[part] += cpu_s() - c0
                parts["_depth"] = 0

        setattr(obj, name, wrapped)


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    os.environ.update(
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        HEDGEROW_INSTANCE=f"pc{os.getpid()}",
        HEDGEROW_LOG_LEVEL="WARNING",
    )
    os.environ.setdefault("HEDGEROW_SECRET_KEY", uuid.uuid4().hex * 2)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from apps.sandboxes.backends import get_backend
    from apps.sandboxes.backends.base import SandboxSpec
    from apps.sandboxes.services.provisioning import wait_agent_healthy

    backend = get_backend()
    parts: dict[str, float] = collections.defaultdict(float)
    network, cgroups = getattr(backend, "network", None), getattr(backend, "cgroups", None)
    if network is not None and cgroups is not None:
        from apps.sandboxes.backends.local import process

        network_steps = ("ensure_instance", "claim_ip", "create", "netns_pids", "delete")
        account(parts, network, (*network_steps, "release_ips"), "network")
        account(parts, cgroups, ("create", "remove", "paths"), "cgroups")
        account(parts, process, ("launch_detached",), "agent launch")
        account(parts, backend, ("_save_meta",), "meta.json")
    ids = [uuid.uuid4().hex for _ in range(n)]
    try:
        t0, c0 = time.perf_counter(), cpu_s()
        endpoints = [
            backend.provision(SandboxSpec(i, "bench", 1, "host", 250, 128, k % 2 == 1, "t" + i))
            for k, i in enumerate(ids)
        ]
        t1, c1 = time.perf_counter(), cpu_s()
        for sandbox_id, endpoint in zip(ids, endpoints, strict=True):
            wait_agent_healthy(endpoint, "t" + sandbox_id, 30)
        t2 = time.perf_counter()
        c2 = cpu_s()
        for sandbox_id in ids:
            backend.destroy(sandbox_id)
        t3, c3 = time.perf_counter(), cpu_s()
        by_part = {part: spent for part, spent in parts.items() if part != "_depth"}
    finally:
        for sandbox_id in ids:
            backend.destroy(sandbox_id)
        teardown = getattr(backend, "teardown_instance", None)
        if teardown is not None:
            teardown()  # the private instance's bridge, tables and subnet claim
    per = 1000 / n
    print(
        f"N={n} load={Path('/proc/loadavg').read_text().split()[0]}\n"
        f"provision      {per * (t1 - t0):7.1f} ms wall  {per * (c1 - c0):6.1f} ms cpu\n"
        f"until healthy  {per * (t2 - t1):7.1f} ms wall (after all were launched)\n"
        f"destroy        {per * (t3 - t2):7.1f} ms wall  {per * (c3 - c2):6.1f} ms cpu\n"
        f"total cpu      {per * (c3 - c0):7.1f} ms per sandbox (without the agents' own)"
    )
    if by_part:
        by_part["other"] = (c1 - c0) + (c3 - c2) - sum(by_part.values())
        print("cpu by part, provision + destroy, per sandbox:")
        for part, spent in sorted(by_part.items(), key=lambda kv: -kv[1]):
            print(f"  {part:13s}{per * spent:7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
