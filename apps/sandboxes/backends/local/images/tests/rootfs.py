"""A sandbox-like root for the tests: an idmapped overlay of an image's layers, and
the image's own shell run as root of the user namespace, chrooted into it."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

from apps.sandboxes.backends.local.images.overlay import mount_rootfs, unmount_rootfs, userns_fd

_libc = ctypes.CDLL("libc.so.6", use_errno=True)
MS_BIND = 4096


class Root:
    def __init__(self, tmp: Path, base: int, layers: list[Path], *, devices: bool = False) -> None:
        self.base = base
        self.upper, self.work, self.target = tmp / "upper", tmp / "work", tmp / "root"
        for d in (self.upper, self.work, self.target):
            d.mkdir(parents=True)
        os.chown(self.upper, base, base)
        os.chown(self.work, base, base)
        self.ns = userns_fd(base)
        mount_rootfs(layers, self.upper, self.work, self.target, self.ns)
        if devices:
            # what bwrap's --dev gives a sandbox, as far as these tests need it
            for name in ("null", "zero", "urandom"):
                node = self.target / "dev" / name
                node.parent.mkdir(exist_ok=True)
                node.touch()
                if _libc.mount(f"/dev/{name}".encode(), bytes(node), None, MS_BIND, None):
                    raise OSError(ctypes.get_errno(), f"bind /dev/{name}")

    def sh(self, script: str) -> str:
        """Run the image's own busybox sh as root of the user namespace, chrooted in.

        The root is reached through an inherited fd: the path to it crosses pytest's
        0700 tmp dirs, which the range's root may not traverse (nor should it).
        """
        out = self.run(script)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def run(self, script: str) -> subprocess.CompletedProcess[str]:
        dirfd = os.open(self.target, os.O_PATH | os.O_DIRECTORY)
        try:
            return self._run(script, dirfd)
        finally:
            os.close(dirfd)

    def _run(self, script: str, dirfd: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                "nsenter",
                f"--user=/proc/self/fd/{self.ns}",
                "--setuid=0",
                "--setgid=0",
                "unshare",
                "--mount",
                "chroot",
                f"/proc/self/fd/{dirfd}",
                "/bin/sh",
                "-c",
                script,
            ],
            capture_output=True,
            text=True,
            pass_fds=(self.ns, dirfd),
            timeout=120,
            check=False,
        )

    def close(self) -> None:
        unmount_rootfs(self.target)  # MNT_DETACH: the device binds go with it
        os.close(self.ns)
