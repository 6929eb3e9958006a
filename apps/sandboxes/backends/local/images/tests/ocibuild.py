"""Builds OCI image layouts for the tests and the benchmark, from nothing but Python.

The tests build every image they pull (no network beyond loopback): layers are tar
streams written here entry by entry, so a test can put exactly the whiteout, opaque
directory, hard link, device node or ``../`` path it wants to see handled.
"""

from __future__ import annotations

import base64
import fcntl
import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
BUSYBOX = Path("/bin/busybox")


@dataclass
class E:
    """One tar entry. kind: file, dir, symlink, hardlink, char, fifo."""

    path: str
    kind: str = "file"
    data: bytes = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    link: str = ""
    xattrs: dict[str, str] = field(default_factory=dict)
    mtime: int = 1_700_000_000


def layer(entries: list[E], level: int = 6) -> tuple[bytes, str]:
    """A gzipped tar layer and its diff id (sha256 of the uncompressed tar)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            ti = tarfile.TarInfo(e.path)
            ti.mode, ti.uid, ti.gid, ti.mtime = e.mode, e.uid, e.gid, e.mtime
            if e.xattrs:
                ti.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in e.xattrs.items()}
            payload = None
            if e.kind == "file":
                ti.size = len(e.data)
                payload = io.BytesIO(e.data)
            elif e.kind == "dir":
                ti.type = tarfile.DIRTYPE
            elif e.kind == "symlink":
                ti.type, ti.linkname = tarfile.SYMTYPE, e.link
            elif e.kind == "hardlink":
                ti.type, ti.linkname = tarfile.LNKTYPE, e.link
            elif e.kind == "char":
                ti.type, ti.devmajor, ti.devminor = tarfile.CHRTYPE, 1, 3
            elif e.kind == "fifo":
                ti.type = tarfile.FIFOTYPE
            else:
                raise ValueError(e.kind)
            tar.addfile(ti, payload)
    tar_bytes = raw.getvalue()
    return gzip.compress(tar_bytes, compresslevel=level, mtime=0), _sha(tar_bytes)


def busybox_layer() -> tuple[bytes, str]:
    """A minimal userland: busybox-static and the applet links a shell needs."""
    entries = [
        E("bin", "dir", mode=0o755),
        E("bin/busybox", data=BUSYBOX.read_bytes(), mode=0o755),
        E("etc", "dir", mode=0o755),
        E("etc/passwd", data=b"root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n"),
        E("tmp", "dir", mode=0o1777),
    ]
    for applet in ("sh", "ls", "cat", "id", "echo", "touch", "rm", "stat", "env"):
        entries.append(E(f"bin/{applet}", "symlink", link="busybox"))
    return layer(entries)


USERLAND_CACHE = Path("/var/cache/hedgerow/userland")
USERLAND_SUITE = "bookworm"
USERLAND_PACKAGES = ("python3", "python3-pytest", "git")


def userland_layer() -> tuple[Path, str]:
    """A real distribution userland (Debian minbase with python3, pytest and git) as a
    gzipped layer file and its diff id, built with mmdebstrap from the Debian mirror
    the machine's apt uses, once per machine: cached outside the repo (a few minutes
    to build, ~100 MB), keyed by suite and packages; concurrent builders wait on a
    lock. /dev is left empty, as in images (the unpacker refuses device nodes)."""
    key = hashlib.sha256(f"{USERLAND_SUITE} {' '.join(USERLAND_PACKAGES)} v1".encode())
    base = USERLAND_CACHE / key.hexdigest()[:16]
    done = base / "layer.json"
    base.mkdir(parents=True, exist_ok=True)
    with open(base / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            raw = base / "rootfs.tar"
            subprocess.run(
                [
                    "mmdebstrap",
                    "--quiet",
                    "--variant=minbase",
                    "--skip=output/dev",
                    f"--include={','.join(USERLAND_PACKAGES)}",
                    USERLAND_SUITE,
                    str(raw),
                ],
                check=True,
                timeout=1800,
            )
            diff = hashlib.sha256()
            with open(raw, "rb") as f, gzip.open(base / "layer.tar.gz.tmp", "wb", 1) as out:
                while chunk := f.read(1 << 20):
                    diff.update(chunk)
                    out.write(chunk)
            os.replace(base / "layer.tar.gz.tmp", base / "layer.tar.gz")
            raw.unlink()
            done.write_text(json.dumps({"diff_id": "sha256:" + diff.hexdigest()}))
    return base / "layer.tar.gz", str(json.loads(done.read_text())["diff_id"])


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Layout:
    """An OCI image layout directory (the `oci:` transport of skopeo)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        (path / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        self.refs: list[dict[str, Any]] = []

    def blob(self, data: bytes, media_type: str) -> dict[str, Any]:
        digest = _sha(data)
        (self.path / "blobs" / "sha256" / digest.split(":")[1]).write_bytes(data)
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    def image(
        self,
        layers: list[tuple[bytes, str]],
        config: dict[str, Any] | None = None,
        arch: str = "amd64",
    ) -> dict[str, Any]:
        cfg = {
            "architecture": arch,
            "os": "linux",
            "config": config or {},
            "rootfs": {"type": "layers", "diff_ids": [d for _, d in layers]},
        }
        manifest = {
            "schemaVersion": 2,
            "mediaType": MT_MANIFEST,
            "config": self.blob(json.dumps(cfg).encode(), MT_CONFIG),
            "layers": [self.blob(data, MT_LAYER) for data, _ in layers],
        }
        desc = self.blob(json.dumps(manifest).encode(), MT_MANIFEST)
        desc["platform"] = {"architecture": arch, "os": "linux"}
        return desc

    def index(self, manifests: list[dict[str, Any]]) -> dict[str, Any]:
        idx = {"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": manifests}
        return self.blob(json.dumps(idx).encode(), MT_INDEX)

    def tag(self, name: str, desc: dict[str, Any]) -> None:
        d = {k: v for k, v in desc.items() if k != "platform"}
        d["annotations"] = {"org.opencontainers.image.ref.name": name}
        self.refs.append(d)
        (self.path / "index.json").write_text(
            json.dumps({"schemaVersion": 2, "manifests": self.refs})
        )

    def push(self, tag: str, dest: str, creds: str | None = None, *, all_: bool = False) -> None:
        """skopeo copy oci:<layout>:<tag> docker://<dest>, digests preserved."""
        cmd = ["skopeo", "copy", "--quiet", "--preserve-digests", "--dest-tls-verify=false"]
        if creds:
            authfile = self.path / "auth.json"
            registry = dest.split("/", 1)[0]
            auth = base64.b64encode(creds.encode()).decode()
            authfile.write_text(json.dumps({"auths": {registry: {"auth": auth}}}))
            cmd += ["--dest-authfile", str(authfile)]
        if all_:
            cmd.append("--all")
        cmd += [f"oci:{self.path}:{tag}", f"docker://{dest}"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
