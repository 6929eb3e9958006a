"""Which host uids/gids a sandbox's user namespace maps to (docs/security.md).

Sandbox ids 0..65535 are host ids BASE..BASE+65535, BASE = (low 16 bits of the
sandbox's IPv4 address) * 65536. Addresses are unique on the machine while a sandbox
holds one (subnets are claimed machine-wide, addresses per instance), and x.y.0.0 and
x.y.255.255 are never sandboxes, so BASE is in [65536, 2^32-131072]: never host root,
never the ids of the host's own users (< 65536), never another live sandbox's — if no two
instances' subnets share their low 16 bits (10.213.7.0/24 and 10.214.7.0/24 would).
``claim_blocks`` makes that a machine-wide claim, once per instance: one file per /24
block of the low 16 bits under ``<claims_dir>/../uids``, owned by one subnet.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import subprocess
from pathlib import Path

from apps.sandboxes.backends.base import BackendError
from podagent.userns import RANGE, id_map

from ._sys import SYSTEM_PATH


def uid_base(ip: str) -> int:
    low = int(ipaddress.IPv4Address(ip)) & 0xFFFF
    base = low * RANGE
    id_map(base)  # ValueError outside [65536, 2^32-131072]: x.y.0.0 or x.y.255.255
    return base


def blocks_dir(claims_dir: Path) -> Path:
    return claims_dir.parent / "uids"


def claim_blocks(claims_dir: Path, subnet: ipaddress.IPv4Network, owner: str) -> None:
    """Claims the /24 blocks (third octets) of ``subnet`` for it, machine-wide; a block
    another subnet holds is a typed error naming the claim file."""
    if subnet.prefixlen < 16:
        raise BackendError(f"subnet {subnet} is larger than a /16: its uid ranges would repeat")
    directory = blocks_dir(claims_dir)
    directory.mkdir(parents=True, exist_ok=True)
    mine = f"{subnet} {owner}\n"
    first = int(subnet.network_address) >> 8 & 0xFF
    last = int(subnet.broadcast_address) >> 8 & 0xFF
    for block in range(first, last + 1):
        path = directory / str(block)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            held = path.read_text()
            if held.split(" ", 1)[0] != str(subnet):
                raise BackendError(
                    f"the uid range of subnet {subnet} is held by {held.strip()!r} ({path}): "
                    "two instances' subnets share their low 16 bits"
                ) from None
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(mine)


def blocks_free(claims_dir: Path, subnet: ipaddress.IPv4Network) -> bool:
    """No other subnet holds one of ``subnet``'s blocks (subnet choice skips others)."""
    first = int(subnet.network_address) >> 8 & 0xFF
    last = int(subnet.broadcast_address) >> 8 & 0xFF
    for block in range(first, last + 1):
        try:
            held = (blocks_dir(claims_dir) / str(block)).read_text().split(" ", 1)[0]
        except OSError:
            continue
        if held != str(subnet):
            return False
    return True


def release_orphans(claims_dir: Path) -> None:
    """Drops block claims whose subnet is no longer claimed (an instance that died
    with its state dir: gc released its subnet claim, or nothing had it)."""
    with contextlib.suppress(FileNotFoundError):
        for path in blocks_dir(claims_dir).iterdir():
            with contextlib.suppress(OSError, ValueError):
                net = ipaddress.IPv4Network(path.read_text().split(" ", 1)[0])
                if not (claims_dir / str(net.network_address)).exists():
                    path.unlink()


def release_blocks(claims_dir: Path, subnet: ipaddress.IPv4Network) -> None:
    directory = blocks_dir(claims_dir)
    first = int(subnet.network_address) >> 8 & 0xFF
    last = int(subnet.broadcast_address) >> 8 & 0xFF
    for block in range(first, last + 1):
        path = directory / str(block)
        with contextlib.suppress(OSError):
            if path.read_text().split(" ", 1)[0] == str(subnet):
                path.unlink()


def chown_tree_top(paths: list[Path], base: int) -> None:
    """Makes the sandbox's writable host dirs (and the token) its root's."""
    for path in paths:
        os.chown(path, base, base, follow_symlinks=False)


def userns_fd(base: int) -> int:
    """A user namespace fd (inheritable, for exec launch's nsenter) with the sandbox's
    maps, made by a short-lived ``unshare --user`` child: this process may have
    threads (a Celery worker), so it neither forks Python nor unshares itself."""
    child = subprocess.Popen(
        ["unshare", "--user", "--", "/bin/sh", "-c", "echo ready; exec cat >/dev/null"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"PATH": SYSTEM_PATH},
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        if child.stdout.readline() != b"ready\n":
            raise BackendError("could not create the sandbox's user namespace (unshare --user)")
        mapping = id_map(base)
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{child.pid}/{name}", "wb") as fh:
                fh.write(mapping)
        fd = os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY)
        os.set_inheritable(fd, True)
        return fd
    finally:
        child.stdin.close()
        child.stdout.close()
        child.wait(timeout=10)
