"""The Kubernetes backend at 10,000 sandboxes — SIMULATED against the in-process fake
API server (apps/sandboxes/backends/kubernetes/tests/fakekube.py), not a cluster.

    .venv/bin/python -m bench.k8s_scale --pods 10000 [--small 1000] [--changes 50]

Measures, for the control plane's side (the client threads; the fake server runs in
this process too, so whole-process CPU would include it and is not used):

1. initial LIST (paginated, ``list_page_size``) + informer sync: wall time, the
   informer thread's CPU, and the memory the informer keeps
   (the memory: the process's RSS growth, an upper bound as the fake serves from the
   same process; the exact figure by tracemalloc up to ``--trace-up-to`` pods);
2. a reconcile round's inventory listing (pods, then policies and secrets as metadata
   only): the calling thread's CPU and wall (goal: ≤ 1 s CPU);
3. one pod change: the informer thread's CPU per watch event and the delay until its
   cache shows it, at ``--small`` and ``--pods`` pods (goal: independent of N);
4. creates paced by the client-side request rate (``api_qps``/``api_burst``), and a 429
   with ``Retry-After`` met by 8 threads at once: everyone waits it out, one retry;
5. a watch broken by compaction (410): LISTs done to recover (goal: one re-list, no
   storm).

What the fake does not model is listed in its docstring (notably API Priority and
Fairness and a consistent snapshot across ``continue`` pages).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import threading
import time
import tracemalloc
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kubernetes import client

from apps.sandboxes.backends.kubernetes import (
    KubeApi,
    KubernetesBackend,
    KubernetesConfig,
)
from apps.sandboxes.backends.kubernetes.config import L_SANDBOX
from apps.sandboxes.backends.kubernetes.tests.conftest import (
    NS,
    make_config,
    new_spec,
)
from apps.sandboxes.backends.kubernetes.tests.fakekube import FakeKube


def _backend(fake: FakeKube, **overrides: Any) -> KubernetesBackend:
    configuration = client.Configuration()
    configuration.host = fake.url
    configuration.retries = False
    config: KubernetesConfig = make_config(watch_timeout_s=60, **overrides)
    return KubernetesBackend(config, KubeApi(client.ApiClient(configuration), config))


def _thread_cpu(thread: threading.Thread | None) -> float:
    assert thread is not None and thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _templates(fake: FakeKube) -> dict[str, dict[str, Any]]:
    """One sandbox provisioned the real way (pod, secret, egress policy): the shapes
    every simulated sandbox is cloned from."""
    fake.auto_start = True
    backend = _backend(fake)
    spec = new_spec(network_access=True)
    backend.provision(spec)
    backend.close()
    fake.auto_start = False
    out: dict[str, dict[str, Any]] = {}
    with fake.cond:
        for (resource, _ns, _name), obj in fake.objects.items():
            labels = obj["metadata"].get("labels") or {}
            if labels.get(L_SANDBOX) == spec.sandbox_id:
                out[resource] = copy.deepcopy(obj)
    out["_id"] = {"id": spec.sandbox_id}
    return out


def _populate(fake: FakeKube, templates: dict[str, dict[str, Any]], n: int) -> None:
    """``n`` more sandboxes' pods, secrets and policies, written into the fake's store
    (as the API server's etcd would hold them; no HTTP)."""
    old = templates["_id"]["id"]
    with fake.cond:
        have = sum(1 for (r, _, _) in fake.objects if r == "pods")
        for _ in range(n - have):
            sid = uuid.uuid4().hex
            for resource in ("pods", "secrets", "networkpolicies"):
                if resource not in templates:
                    continue
                obj = copy.deepcopy(templates[resource])
                meta = obj["metadata"]
                meta["name"] = meta["name"].replace(old, sid)
                meta["uid"] = str(uuid.uuid4())
                meta["labels"] = {
                    k: (sid if v == old else v) for k, v in (meta.get("labels") or {}).items()
                }
                fake.objects[(resource, NS, meta["name"])] = obj
                fake._record(resource, NS, "ADDED", obj)


def _pod_names(fake: FakeKube) -> list[str]:
    with fake.cond:
        return sorted(name for (r, _, name) in fake.objects if r == "pods")


def measure(fake: FakeKube, n: int, changes: int, trace_memory: bool) -> dict[str, Any]:
    backend = _backend(fake)
    informer = backend.informer
    gc.collect()
    if trace_memory:
        tracemalloc.start()
    rss = _rss_mib()
    start = time.perf_counter()
    informer.ensure_started(timeout_s=1800)
    sync_s = time.perf_counter() - start
    sync_cpu = _thread_cpu(informer._thread)
    gc.collect()
    result: dict[str, Any] = {
        "pods": n,
        "sync_s": sync_s,
        "sync_cpu_s": sync_cpu,
        "rss_mib": _rss_mib() - rss,
    }
    if trace_memory:
        gc.collect()
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        result.update(cache_mib=current / 2**20, peak_mib=peak / 2**20)
        backend.close()
        return result
    result["cached"] = len(informer.pods)
    # 2. a reconcile round's listing
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    items = backend.inventory()
    result.update(
        inventory_cpu_s=time.thread_time() - cpu0,
        inventory_s=time.perf_counter() - wall0,
        inventory_items=len(items),
    )
    # 3. one pod change at a time: informer CPU per event, delay until cached
    names = _pod_names(fake)
    delays = []
    cpu_before = _thread_cpu(informer._thread)
    for i in range(changes):
        name = names[(i * 7919) % len(names)]
        ready = i % 2 == 0
        t0 = time.perf_counter()
        fake.set_pod_status(NS, name, phase="Running", running=True, ready=ready)
        while True:
            view = informer.get(name)
            if view is not None and view.ready == ready:
                break
            time.sleep(0.0005)
        delays.append(time.perf_counter() - t0)
    result["change_cpu_ms"] = (_thread_cpu(informer._thread) - cpu_before) / changes * 1000
    delays.sort()
    result["change_delay_ms_p50"] = delays[len(delays) // 2] * 1000
    result["change_delay_ms_max"] = delays[-1] * 1000
    # 5. a watch broken by compaction: how many LISTs to recover
    relists = informer.relists
    lists_before = fake.count("GET", "/pods")
    fake.compact()
    name = names[0]
    t0 = time.perf_counter()
    fake.set_pod_status(NS, name, phase="Running", running=True, ready=False)
    while True:
        view = informer.get(name)
        if view is not None and not view.ready and informer.relists > relists:
            break
        time.sleep(0.001)
    result["recover_410_s"] = time.perf_counter() - t0
    result["relists_after_410"] = informer.relists - relists
    # list pages of the re-list, plus the new watch
    result["pod_requests_after_410"] = fake.count("GET", "/pods") - lists_before
    backend.close()
    return result


def paced(fake: FakeKube, creates: int, qps: float, burst: int) -> dict[str, Any]:
    """Sequential creates through ``KubeApi.call`` with the request rate on."""
    backend = _backend(fake, api_qps=qps, api_burst=burst)
    t0 = time.perf_counter()
    for _ in range(creates):
        backend.api.call(backend.api.core.create_namespaced_secret, NS, _secret())
    wall = time.perf_counter() - t0
    backend.close()
    return {
        "wall_s": wall,
        "floor_s": (creates - burst) / qps,
        "waited_s": backend.api.limiter.waited_s,
    }


def _secret() -> dict[str, Any]:
    return {"metadata": {"name": f"bench-{uuid.uuid4().hex[:12]}"}, "type": "Opaque", "data": {}}


def retry_after(fake: FakeKube, threads: int, each: int, retry_after_s: int) -> dict[str, Any]:
    """``threads`` callers creating ``each`` secrets at once; the first request gets a
    429 with ``Retry-After``: does everyone wait it out, and how many requests does it
    cost?"""
    backend = _backend(fake, api_qps=1000, api_burst=1000, max_concurrency=threads)
    fake.retry_after = str(retry_after_s)
    fake.fail_next(429)
    sent_before = len(fake.requests)
    barrier = threading.Barrier(threads)

    def run() -> None:
        barrier.wait()
        for _ in range(each):
            backend.api.call(backend.api.core.create_namespaced_secret, NS, _secret())

    workers = [threading.Thread(target=run) for _ in range(threads)]
    t0 = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - t0
    fake.retry_after = "0"
    backend.close()
    return {
        "creates": threads * each,
        "wall_s": wall,
        "requests": len(fake.requests) - sent_before,
        "retries": backend.api.retries_done,
        "waited_s": backend.api.limiter.waited_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=10000)
    parser.add_argument("--small", type=int, default=1000)
    parser.add_argument("--changes", type=int, default=50)
    parser.add_argument("--paced", type=int, default=60)
    parser.add_argument("--trace-up-to", type=int, default=1000)
    parser.add_argument("--qps", type=float, default=10.0)
    parser.add_argument("--burst", type=int, default=5)
    args = parser.parse_args()
    print("SIMULATED: in-process fake API server, not a cluster")
    print(f"load average before: {os.getloadavg()}")
    fake = FakeKube().start()
    fake.bookmark_interval_s = 5.0
    templates = _templates(fake)
    print(f"objects per sandbox: {sorted(k for k in templates if not k.startswith('_'))}")
    for n in (args.small, args.pods):
        _populate(fake, templates, n)
        row = measure(fake, n, args.changes, trace_memory=False)
        memory = f"process RSS +{row['rss_mib']:.0f} MiB over the sync (an upper bound)"
        if n <= args.trace_up_to:  # tracing is slow: the exact figure at the small N
            mem = measure(fake, n, 0, trace_memory=True)
            memory += f", informer keeps {mem['cache_mib']:.1f} MiB (peak {mem['peak_mib']:.1f})"
        print(
            f"N={n}: sync {row['sync_s']:.2f} s (informer CPU {row['sync_cpu_s']:.2f} s), "
            f"{memory}; "
            f"inventory {row['inventory_items']} items: CPU {row['inventory_cpu_s']:.2f} s, "
            f"wall {row['inventory_s']:.2f} s; one pod change: informer CPU "
            f"{row['change_cpu_ms']:.2f} ms, cached after p50 {row['change_delay_ms_p50']:.1f} ms "
            f"(max {row['change_delay_ms_max']:.1f}); 410: {row['relists_after_410']} re-list, "
            f"{row['pod_requests_after_410']} pod requests, recovered in "
            f"{row['recover_410_s']:.2f} s"
        )
    row = paced(fake, args.paced, args.qps, args.burst)
    print(
        f"{args.paced} creates at {args.qps} qps (burst {args.burst}): {row['wall_s']:.2f} s "
        f"(floor {row['floor_s']:.2f} s; the limiter slept {row['waited_s']:.2f} s)"
    )
    row = retry_after(fake, 8, 5, 1)
    print(
        f"{row['creates']} creates from 8 threads, first answered 429 Retry-After: 1: "
        f"{row['requests']} requests ({row['retries']} retry), {row['wall_s']:.2f} s; "
        f"callers slept {row['waited_s']:.2f} s in all"
    )
    print(f"load average after: {os.getloadavg()}")
    fake.stop()


if __name__ == "__main__":
    main()
