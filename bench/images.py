"""The image store against its floor, measured in one run on this machine.

    .venv/bin/python -m bench.images [--size-mb 512] [--layers 5] [--mounts 200]

Starts Debian's docker-registry on loopback (tmp dir), builds and pushes a multi-layer
image of --size-mb uncompressed (half random bytes, half text: gzip ~0.55), then:

* cold pull: ``ImageStore.pull`` into an empty store (skopeo copy + verify + unpack);
* floor: the same bytes with ``skopeo copy`` into an empty OCI layout plus ``tar -xzf``
  of each layer into its own directory (no verification, no whiteout handling);
* warm pull: the same reference again (manifest check with the registry, nothing
  fetched or unpacked);
* overlay: ``mount_rootfs`` of the image's layers (idmapped) + ``umount`` --mounts
  times, CPU ms of this process per mount (the syscalls are all in-process).

Wall seconds and CPU seconds (this process + its children: skopeo, tar) per step, and
the ratios cold/floor.

Optional (issue 15's remaining measurements):

* ``--create-cpu N``: overlay + quota CPU per create (a btrfs subvolume in its own
  quota group, the idmapped overlay with upper/work inside it, unmount + remove);
* ``--create-ratio N [--only-ratio]``: warm create→ready of the image vs ``host``
  through a private stack (bench/_stack.py: web + worker as ``make up`` runs them), N
  of each interleaved in one run, and the ratio. Needs provision to launch OCI images.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import resource
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from apps.sandboxes.backends.local.images import (
    Credentials,
    ImageRecord,
    ImageStore,
    RegistryPolicy,
)
from apps.sandboxes.backends.local.images.overlay import mount_rootfs, unmount_rootfs, userns_fd
from apps.sandboxes.backends.local.images.tests.ocibuild import E, Layout, busybox_layer, layer
from apps.sandboxes.backends.local.images.tests.registry import PASSWORD, USER, start


def cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def measure(fn: Callable[[], object]) -> tuple[float, float]:
    w, c = time.perf_counter(), cpu()
    fn()
    return time.perf_counter() - w, cpu() - c


def build(tmp: Path, size_mb: int, n_layers: int) -> Layout:
    rng = random.Random(7)
    layers = [busybox_layer()]
    per_layer = size_mb * (1 << 20) // n_layers
    file_size = 256 * 1024
    for i in range(n_layers):
        entries = [E(f"data{i}", "dir", mode=0o755)]
        for j in range(per_layer // file_size):
            text = (b"lorem ipsum dolor sit amet %d %d\n" % (i, j)) * (file_size // 2 // 30)
            body = rng.randbytes(file_size // 2) + text
            entries.append(E(f"data{i}/f{j}", data=body[:file_size]))
        layers.append(layer(entries, level=1))
    lay = Layout(tmp / "layout")
    lay.tag("v1", lay.image(layers, {"Env": ["A=1"]}))
    return lay


def floor(ref: str, tmp: Path, authfile: Path) -> None:
    dest = tmp / "floor"
    dest.mkdir()
    subprocess.run(
        [
            "skopeo", "copy", "--quiet", "--src-tls-verify=false",
            "--src-authfile", str(authfile), f"docker://{ref}", f"oci:{dest / 'layout'}",
        ],
        check=True,
    )  # fmt: skip
    index = json.loads((dest / "layout/index.json").read_text())
    blobs = dest / "layout/blobs/sha256"
    manifest = json.loads((blobs / index["manifests"][0]["digest"][7:]).read_text())
    for i, desc in enumerate(manifest["layers"]):
        out = dest / f"l{i}"
        out.mkdir()
        subprocess.run(["tar", "-xzf", str(blobs / desc["digest"][7:]), "-C", str(out)], check=True)


def create_cpu(store: ImageStore, rec: ImageRecord, tmp: Path, n: int) -> None:
    """Overlay + quota CPU per create, what the local backend adds to a create of an
    OCI image: a btrfs subvolume in its own quota group (``Storage.create``), the
    image's idmapped overlay root with upper/work inside that volume, then unmount and
    remove. CPU of this process and its children (ms) per step, n times."""
    from apps.sandboxes.backends.local.storage import Storage

    state = tmp / "storage-state"
    (state / "locks").mkdir(parents=True)
    storage = Storage(state, size_bytes=1 << 30)
    storage.ensure()
    base = 2_000_000_000
    ns = userns_fd(base)
    lowers = store.lower_dirs(rec)
    steps: dict[str, list[float]] = {"quota (volume + qgroup)": [], "overlay mount": []}
    steps["umount + remove"] = []
    try:
        for _ in range(n):
            sid = uuid.uuid4().hex
            c0 = cpu()
            vol = storage.create(sid, 64 << 20)
            c1 = cpu()
            upper, work, target = vol.root / "upper", vol.root / "work", tmp / "roots" / sid
            for x in (upper, work, target):
                x.mkdir(parents=True)
            os.chown(upper, base, base)
            os.chown(work, base, base)
            c2 = cpu()
            mount_rootfs(lowers, upper, work, target, ns)
            c3 = cpu()
            unmount_rootfs(target)
            storage.remove(sid)
            c4 = cpu()
            steps["quota (volume + qgroup)"].append(c1 - c0)
            steps["overlay mount"].append(c3 - c2)
            steps["umount + remove"].append(c4 - c3)
    finally:
        os.close(ns)
        storage.teardown()
    print(f"overlay + quota per create ({len(lowers)} layers), CPU ms over {n}:")
    total = [sum(v) for v in zip(*steps.values(), strict=True)]
    for name, values in [*steps.items(), ("total", total)]:
        values.sort()
        print(f"  {name:<26} mean {1000 * sum(values) / n:7.2f}  p50 "
              f"{1000 * values[n // 2]:7.2f}  p95 {1000 * values[int(n * 0.95)]:7.2f}")  # fmt: skip


def create_ratio(ref: str, n: int) -> None:
    """Warm create→ready of ``ref`` vs ``host`` through a private stack (web + worker,
    as ``make up`` runs them), n of each, interleaved, in one run: the image is pulled
    into the machine-wide store first, so every create is warm. Needs provision to
    launch OCI images (img-launch)."""
    import statistics

    import httpx

    from bench._stack import private_stack

    # the bench's loopback registry is listed like an operator would (registry egress)
    host = ref.split("/", 1)[0]
    extra = {"HEDGEROW_MAX_LIVE_SANDBOXES": "0", "HEDGEROW_INSECURE_REGISTRIES": host}
    with private_stack("img", extra, lambda _s: None) as (
        stack,
        secret,
    ):
        from apps.sandboxes.backends import get_backend

        get_backend().pull_image(ref)
        http = httpx.Client(
            base_url=stack.url + "/api/v1",
            headers={"Authorization": f"Bearer {secret}"},
            timeout=300,
            trust_env=False,
        )
        times: dict[str, list[float]] = {"host": [], ref: []}
        for i in range(2 * n):
            image = ref if i % 2 else "host"
            t0 = time.perf_counter()
            created = http.post("/sandboxes", json={"image": image})
            if created.status_code not in (200, 201):
                raise SystemExit(f"create {image}: {created.status_code} {created.text[:300]}")
            sid = created.json()["id"]
            waited = http.get(f"/sandboxes/{sid}/wait", params={"timeout": 300})
            state = waited.json().get("state")
            if waited.status_code != 200 or state != "ready":
                raise SystemExit(f"{image} did not become ready: {state} {waited.text[:300]}")
            times[image].append(time.perf_counter() - t0)
            http.delete(f"/sandboxes/{sid}")
        http.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    for image, values in times.items():
        values.sort()
        p95 = values[int(len(values) * 0.95)]
        print(f"create→ready {image:<40} p50 {1000 * med[image]:7.1f} ms  "
              f"p95 {1000 * p95:7.1f} ms  (n={len(values)})")  # fmt: skip
    print(f"image/host create→ready (p50): {med[ref] / med['host']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mb", type=int, default=512)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--mounts", type=int, default=200)
    p.add_argument(
        "--create-cpu",
        type=int,
        default=0,
        metavar="N",
        help="also: overlay + quota CPU per create, N times (root; a 1 GiB btrfs in tmp)",
    )
    p.add_argument(
        "--create-ratio",
        type=int,
        default=0,
        metavar="N",
        help="also: warm create→ready of the image vs host through a private stack, N of "
        "each in one run, and their ratio (needs provision to launch OCI images)",
    )
    p.add_argument(
        "--only-ratio",
        action="store_true",
        help="with --create-ratio: skip the pull, floor and mount measurements",
    )
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-images-"))
    proc, reg = start(tmp / "registry", auth=True)
    try:
        t0 = time.perf_counter()
        lay = build(tmp, args.size_mb, args.layers)
        ref = f"{reg.host}/bench/big:v1"
        lay.push("v1", ref, reg.creds)
        print(f"built and pushed {args.size_mb} MiB in {args.layers}+1 layers "
              f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
        if args.create_ratio:
            # the stack's tenants have no registry credentials: an anonymous registry
            oproc, oreg = start(tmp / "open-registry", auth=False)
            try:
                open_ref = f"{oreg.host}/bench/big:v1"
                lay.push("v1", open_ref, None)
                create_ratio(open_ref, args.create_ratio)
            finally:
                oproc.terminate()
                oproc.wait(10)
            if args.only_ratio:
                return
        store = ImageStore(tmp / "store", policy=RegistryPolicy.of(insecure=[reg.host]))
        creds = Credentials(USER, PASSWORD)
        cold = measure(lambda: store.pull(ref, credentials=creds))
        rec = store.pull(ref, credentials=creds)
        authfile = tmp / "auth.json"
        token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        authfile.write_text(json.dumps({"auths": {reg.host: {"auth": token}}}))
        flo = measure(lambda: floor(ref, tmp, authfile))
        warm = measure(lambda: store.pull(ref, credentials=creds))
        print(f"image: {rec.size / 2**20:.0f} MiB compressed, "
              f"{rec.unpacked_size / 2**20:.0f} MiB unpacked")  # fmt: skip
        print(f"{'step':<28}{'wall s':>9}{'cpu s':>9}")
        for name, (w, c) in (("cold pull (store)", cold), ("floor (skopeo copy + tar)", flo),
                             ("warm pull (cached)", warm)):  # fmt: skip
            print(f"{name:<28}{w:>9.2f}{c:>9.2f}")
        print(f"cold/floor: wall {cold[0] / flo[0]:.2f}x, cpu {cold[1] / flo[1]:.2f}x")

        if os.geteuid() == 0:
            base = 2_000_000_000
            ns = userns_fd(base)
            lowers = store.lower_dirs(rec)
            mount_cpu, umount_cpu = [], []
            for i in range(args.mounts):
                d = tmp / "roots" / str(i)
                up, work, target = d / "upper", d / "work", d / "root"
                for x in (up, work, target):
                    x.mkdir(parents=True)
                os.chown(up, base, base)
                os.chown(work, base, base)
                c = time.process_time()
                mount_rootfs(lowers, up, work, target, ns)
                mount_cpu.append(time.process_time() - c)
                c = time.process_time()
                unmount_rootfs(target)
                umount_cpu.append(time.process_time() - c)
            os.close(ns)
            mount_cpu.sort()
            umount_cpu.sort()
            n = len(mount_cpu)
            print(f"mount_rootfs ({len(lowers)} idmapped layers), CPU ms per mount over {n}: "
                  f"mean {1000 * sum(mount_cpu) / n:.2f}, p50 {1000 * mount_cpu[n // 2]:.2f}, "
                  f"p95 {1000 * mount_cpu[int(n * 0.95)]:.2f}; umount mean "
                  f"{1000 * sum(umount_cpu) / n:.2f}")  # fmt: skip
            c = time.process_time()
            for _ in range(50):
                os.close(userns_fd(base))
            print(f"userns_fd (fork + maps), CPU ms of this process: "
                  f"{1000 * (time.process_time() - c) / 50:.2f}")  # fmt: skip
            if args.create_cpu:
                create_cpu(store, rec, tmp, args.create_cpu)
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
