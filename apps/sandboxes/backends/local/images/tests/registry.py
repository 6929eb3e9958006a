"""Debian's docker-registry (the reference registry server) on a free loopback port,
in a directory of the caller's, for the tests and bench/images.py."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

USER, PASSWORD = "alice", "correct-horse"


@dataclass
class Registry:
    host: str  # 127.0.0.1:<port>
    root: Path  # storage root directory
    log: Path
    creds: str | None  # "user:password" or None (anonymous)

    def blob_gets(self, repo: str | None = None, digest: str | None = None) -> int:
        """How many blob GETs the registry answered 200/206/307 (downloads started)."""
        n = 0
        for line in self.log.read_text(errors="replace").splitlines():
            if '"GET /v2/' not in line or "/blobs/sha256:" not in line:
                continue
            if repo and f"/v2/{repo}/blobs/" not in line:
                continue
            if digest and f"/blobs/{digest} " not in line:
                continue
            status = line.split('"', 2)[2].split()[0]
            if status in ("200", "206", "307"):
                n += 1
        return n

    def manifest_gets(self, repo: str) -> int:
        """How many manifest GETs of repo the registry answered 200: registry round
        trips that proved access (``skopeo inspect``, a pull's resolve)."""
        n = 0
        for line in self.log.read_text(errors="replace").splitlines():
            if f'"GET /v2/{repo}/manifests/' not in line:
                continue
            if line.split('"', 2)[2].split()[0] == "200":
                n += 1
        return n

    def blob_file(self, digest: str) -> Path:
        hexd = digest.split(":")[1]
        return self.root / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start(
    tmp: Path, auth: bool, host: str = "127.0.0.1"
) -> tuple[subprocess.Popen[bytes], Registry]:
    """A registry on a free port of ``host`` (a local address; loopback by default)."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "config.yml"
    auth_block = ""
    if auth:
        htpasswd = subprocess.run(
            ["htpasswd", "-nbB", USER, PASSWORD], capture_output=True, check=True, text=True
        ).stdout
        (tmp / "htpasswd").write_text(htpasswd)
        auth_block = f"auth:\n  htpasswd: {{realm: test, path: {tmp / 'htpasswd'}}}\n"
    for _ in range(5):
        port = _free_port(host)
        config.write_text(
            "version: 0.1\nlog: {level: warn, accesslog: {disabled: false}}\n"
            f"storage:\n  filesystem: {{rootdirectory: {tmp / 'data'}}}\n"
            "  delete: {enabled: true}\n"
            f"http: {{addr: '{host}:{port}', secret: test-only}}\n" + auth_block
        )
        log = tmp / f"registry-{port}.log"
        proc = subprocess.Popen(
            ["docker-registry", "serve", str(config)],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"http://{host}:{port}/v2/", timeout=1)
                break
            except urllib.error.HTTPError:
                break  # 401: up, and asking for credentials
            except OSError:
                time.sleep(0.05)
        if proc.poll() is None:
            creds = f"{USER}:{PASSWORD}" if auth else None
            return proc, Registry(f"{host}:{port}", tmp / "data", log, creds)
    raise RuntimeError(f"docker-registry did not start: {log.read_text()}")
