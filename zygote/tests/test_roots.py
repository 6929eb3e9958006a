"""The zygote's handler hides other image sandboxes' roots from bwrap: its own copy of
the mount table keeps only the root it launches (zygote.daemon.hide_other_roots)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile

import pytest

from zygote import daemon as zygote

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")


def _points_below(prefix: str) -> list[str]:
    with open("/proc/self/mountinfo") as fh:
        return sorted(
            line.split(" ")[4] for line in fh if line.split(" ")[4].startswith(prefix + "/")
        )


def test_only_the_launched_root_is_left_below_the_roots_dir() -> None:
    roots = tempfile.mkdtemp(prefix="hedgerow-roots-")
    names = ["a", "b", "keep", "c"]
    mounted = []
    try:
        for name in names:
            os.mkdir(f"{roots}/{name}")
            subprocess.run(["mount", "-t", "tmpfs", "tmpfs", f"{roots}/{name}"], check=True)
            mounted.append(f"{roots}/{name}")
        os.mkdir(f"{roots}/keep/inner")
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", f"{roots}/keep/inner"], check=True)
        mounted.append(f"{roots}/keep/inner")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the handler's situation: a private copy of the table
            code = 1
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                assert libc.unshare(0x00020000) == 0
                assert libc.mount(b"none", b"/", None, (1 << 14) | (1 << 19), None) == 0
                zygote.hide_other_roots(roots, f"{roots}/keep")
                os.write(w, "\n".join(_points_below(roots)).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        seen = os.read(r, 65536).decode().split("\n")
        os.close(r)
        assert os.waitpid(pid, 0)[1] == 0
        assert seen == [f"{roots}/keep", f"{roots}/keep/inner"]
        # the caller's (the host's) table is untouched
        assert _points_below(roots) == sorted(mounted)
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", "-l", point], check=False)
        subprocess.run(["rm", "-rf", roots], check=False)
