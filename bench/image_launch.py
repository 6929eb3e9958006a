"""Image sandboxes against host sandboxes on the local backend, in one run (root).

    .venv/bin/python -m bench.image_launch [--creates 30]

Starts Debian's docker-registry on loopback, pushes a busybox image, makes a private
backend instance (zygote launch), warms it (image pulled, zygote running), then
alternates --creates host and image creates. Per create: wall ms from provision to
the agent's first healthy answer, and CPU ms of this process in the root mount
(user resolution, ``mount_rootfs`` with the cached user namespace) and in the volume
+ quota group creation. Medians, p90 and the image/host ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from apps.sandboxes.backends.base import RegistryCredentials, SandboxSpec
from apps.sandboxes.backends.local import LocalBackend, LocalBackendConfig, wait_healthy
from apps.sandboxes.backends.local.images import RegistryPolicy
from apps.sandboxes.backends.local.images.tests.ocibuild import Layout, busybox_layer
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, start

REPO = Path(__file__).resolve().parents[1]


def _spec(image: str) -> SandboxSpec:
    return SandboxSpec(
        sandbox_id=uuid.uuid4().hex,
        tenant_id="bench",
        generation=1,
        image=image,
        cpu_millis=1000,
        memory_mib=256,
        network_access=False,
        agent_token=uuid.uuid4().hex,
        registry_credentials=RegistryCredentials(USER, PASSWORD),
    )


@contextlib.contextmanager
def _cpu_of(obj: Any, name: str, sink: list[float]) -> Iterator[None]:
    """Records the thread CPU ms of every call of obj.name."""
    real: Callable[..., Any] = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            sink.append((time.thread_time() - t0) * 1000)

    setattr(obj, name, timed)
    try:
        yield
    finally:
        if name in vars(obj):
            delattr(obj, name)


def _stats(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[int(0.9 * (len(xs) - 1))]
    return f"median {statistics.median(xs):7.1f}  p90 {p90:7.1f}  (n={len(xs)})"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--creates", type=int, default=30)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hedgerow-bench-launch-", dir="/tmp"))
    os.chmod(tmp, 0o755)
    proc, reg = start(tmp / "registry", auth=True)
    backend: LocalBackend | None = None
    try:
        lay = Layout(tmp / "layout")
        lay.tag("v1", lay.image([busybox_layer()], {"Cmd": ["/bin/sh"]}))
        ref = f"{reg.host}/bench/busybox:v1"
        lay.push("v1", ref, reg.creds)
        backend = LocalBackend(
            LocalBackendConfig(
                state_dir=tmp / "state",
                instance=f"bil{os.getpid()}",
                podagent_dir=REPO / "podagent",
                isolation="netns",
                image_store=tmp / "images",
                registry_policy=lambda: RegistryPolicy.of(insecure=[reg.host]),
            )
        )
        b = backend

        def create(image: str) -> float:
            spec = _spec(image)
            t0 = time.perf_counter()
            endpoint = b.provision(spec)
            wait_healthy(endpoint, spec.agent_token, timeout=30)
            wall = (time.perf_counter() - t0) * 1000
            b.destroy(spec.sandbox_id)
            return wall

        for image in ("host", ref, "host", ref):  # warm: pulled, zygote running
            create(image)
        walls: dict[str, list[float]] = {"host": [], "image": []}
        mount_cpu: list[float] = []
        volume_cpu: list[float] = []
        assert b.storage is not None
        with _cpu_of(b, "_mount_image_root", mount_cpu), _cpu_of(b.storage, "create", volume_cpu):
            for _ in range(args.creates):
                walls["host"].append(create("host"))
                walls["image"].append(create(ref))
        print(f"create -> ready, host   ms: {_stats(walls['host'])}")
        print(f"create -> ready, image  ms: {_stats(walls['image'])}")
        ratio = statistics.median(walls["image"]) / statistics.median(walls["host"])
        print(f"image/host (medians): {ratio:.2f}")
        print(f"root mount CPU ms (resolve user + idmapped overlay): {_stats(mount_cpu)}")
        print(f"volume + quota group CPU ms (every isolated create): {_stats(volume_cpu)}")
    finally:
        if backend is not None:
            backend.teardown_instance()
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
