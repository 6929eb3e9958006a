"""Cost of the local backend's cold path per sandbox, without the control plane.

    .venv/bin/python -m bench.provision_cost [N] [zygote|exec]

Provisions N `host` sandboxes one after another under a private instance (after one
warm-up sandbox, so the zygote's start and the pause build are not counted), waits for
each agent's /health, destroys them, and prints per sandbox:

* provision: wall time and the CPU of this process plus its reaped children (ip, nft,
  the exec launcher's sh);
* ready: wall time from the start of provision until /health answers;
* sandbox processes: CPU (/proc/<pid>/schedstat) of every process in the sandbox's
  netns just before destroy (the exec chain sh → ip → bwrap and its init under one
  pid, pause, the agent: its interpreter start and imports, or its life after the fork);
* zygote: CPU of the zygote and its reaped handlers (and the children they reaped)
  over the provisions;
* destroy: wall and CPU of this process plus reaped children;
* the provision + destroy CPU of this process split by part of the local backend:
  network (netns, veth, nft, address claims), cgroups, agent launch, meta.json writes,
  disk quota (the sandbox's btrfs volume and quota group) and the rest (directories,
  locks, kills).

CPU is user+system time (/proc/<pid>/stat, getrusage), which other work on a shared
machine does not inflate the way it inflates wall time. The load average is printed.
"""

from __future__ import annotations

import functools
import os
import resource
import statistics
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_TICK = os.sysconf("SC_CLK_TCK")


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


def proc_cpu_s(pid: int, with_children: bool = False) -> float:
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    ticks = int(fields[11]) + int(fields[12])
    if with_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICK


def netns_cpu_s(netns: str) -> dict[str, float]:
    """CPU per comm of every process in the named netns (including reaped children)."""
    target = os.stat(f"/run/netns/{netns}").st_ino
    found: dict[str, float] = defaultdict(float)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}/ns/net").st_ino != target:
                continue
            comm = Path(f"/proc/{name}/comm").read_text().strip()
            # schedstat: ns on CPU, exact (stat's ticks truncate each small process to
            # 0 or 10 ms); nothing in a fresh sandbox has reaped a child yet
            found[comm] += int(Path(f"/proc/{name}/schedstat").read_text().split()[0]) / 1e9
        except OSError:
            continue
    return found


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    launch = sys.argv[2] if len(sys.argv) > 2 else "auto"
    os.environ.update(
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        HEDGEROW_INSTANCE=f"pc{os.getpid()}",
        HEDGEROW_LOG_LEVEL="WARNING",
        HEDGEROW_LOCAL_AGENT_LAUNCH=launch,
        # a benchmark, not a multi-tenant service: exec launch is measured too
        HEDGEROW_LOCAL_ALLOW_UNPROTECTED_EXEC_LAUNCH="1",
    )
    os.environ.setdefault("HEDGEROW_SECRET_KEY", uuid.uuid4().hex * 2)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from apps.sandboxes.backends import get_backend
    from apps.sandboxes.backends.base import SandboxSpec
    from apps.sandboxes.services.provisioning import wait_agent_healthy

    backend = get_backend()

    def spec(sandbox_id: str) -> SandboxSpec:
        return SandboxSpec(sandbox_id, "bench", 1, "host", 250, 128, False, "t" + sandbox_id)

    parts: dict[str, float] = defaultdict(float)
    network, cgroups = getattr(backend, "network", None), getattr(backend, "cgroups", None)
    ids = [uuid.uuid4().hex for _ in range(n)]
    sandbox_cpu: dict[str, float] = defaultdict(float)
    ready: list[float] = []
    try:
        warm = uuid.uuid4().hex
        wait_agent_healthy(backend.provision(spec(warm)), "t" + warm, 30)
        backend.destroy(warm)
        zygote = getattr(backend, "zygote", None)
        answer = zygote.ping() if zygote is not None else None
        zpid = int(answer["pid"]) if answer else None
        z0 = proc_cpu_s(zpid, with_children=True) if zpid else 0.0
        if network is not None and cgroups is not None:  # after the warm-up
            network_steps = ("ensure_instance", "claim_ip", "create", "netns_pids", "delete")
            account(parts, network, (*network_steps, "release_ips"), "network")
            account(parts, cgroups, ("create", "remove", "paths"), "cgroups")
            from apps.sandboxes.backends.local import process

            account(parts, backend, ("_spawn_from_zygote",), "agent launch")
            account(parts, process, ("launch_detached",), "agent launch")
            account(parts, backend, ("_save_meta",), "meta.json")
            storage = getattr(backend, "storage", None)
            if storage is not None:  # the per-sandbox volume and quota group
                account(parts, storage, ("ensure", "create", "remove"), "disk quota")
        wall_provision = cpu_provision = 0.0
        for sandbox_id in ids:
            t0, c0 = time.perf_counter(), cpu_s()
            endpoint = backend.provision(spec(sandbox_id))
            t1, c1 = time.perf_counter(), cpu_s()
            wait_agent_healthy(endpoint, "t" + sandbox_id, 30)
            ready.append(time.perf_counter() - t0)
            wall_provision += t1 - t0
            cpu_provision += c1 - c0
        z1 = proc_cpu_s(zpid, with_children=True) if zpid else 0.0
        names = getattr(backend, "names", None)
        for sandbox_id in ids:
            if names is not None:
                for comm, seconds in netns_cpu_s(names.netns(sandbox_id)).items():
                    sandbox_cpu[comm] += seconds
        t2, c2 = time.perf_counter(), cpu_s()
        for sandbox_id in ids:
            backend.destroy(sandbox_id)
        t3, c3 = time.perf_counter(), cpu_s()
    finally:
        for sandbox_id in ids:
            backend.destroy(sandbox_id)
        teardown = getattr(backend, "teardown_instance", None)
        if teardown is not None:
            teardown()  # the private instance's bridge, tables, zygote and subnet claim
    per = 1000 / n
    in_sandbox = sum(sandbox_cpu.values())
    total = cpu_provision + (z1 - z0) + in_sandbox + (c3 - c2)
    print(
        f"N={n} launch={getattr(backend, 'agent_launch', '?')} "
        f"load={' '.join(Path('/proc/loadavg').read_text().split()[:3])}\n"
        f"provision         {per * wall_provision:7.1f} ms wall  {per * cpu_provision:6.1f} ms cpu"
        " (this process + reaped children)\n"
        f"ready             {1000 * statistics.median(ready):7.1f} ms wall median, "
        f"{1000 * max(ready):.1f} max (provision start → /health 200)\n"
        f"zygote + handlers                  {per * (z1 - z0):6.1f} ms cpu\n"
        f"sandbox processes                  {per * in_sandbox:6.1f} ms cpu  ("
        + ", ".join(f"{k} {per * v:.1f}" for k, v in sorted(sandbox_cpu.items()))
        + ")\n"
        f"destroy           {per * (t3 - t2):7.1f} ms wall  {per * (c3 - c2):6.1f} ms cpu\n"
        f"total cpu         {per * total:7.1f} ms per sandbox"
    )
    by_part = {part: spent for part, spent in parts.items() if part != "_depth"}
    if by_part:
        by_part["other"] = cpu_provision + (c3 - c2) - sum(by_part.values())
        print("this process's cpu by part, provision + destroy, per sandbox:")
        for part, spent in sorted(by_part.items(), key=lambda kv: -kv[1]):
            print(f"  {part:13s}{per * spent:7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
