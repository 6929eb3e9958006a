"""A stand-in for 'the internet' for the egress tests: a netns of the test's own.

A veth from the host into a namespace holding several addresses (``.2``, ``.3``,
``.4`` of a private /24, one link-local address and one address of another private
range, each routed to it by a /32), TCP
listeners on them, and (``dns=True``) an authoritative DNS server for a test zone.
Nothing leaves the machine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SERVER = Path(__file__).with_name("egress_servers.py")


@dataclass(frozen=True)
class Internet:
    host_ip: str  # the host's end of the veth
    a: str  # .2: the DNS server, allowed.test, cdn-shared.test, other-cdn.test
    b: str  # .3: blocked.test
    c: str  # .4: wild targets (x.wild.test)
    link_local: str  # 169.254.x.1: a "metadata" address the host reaches
    ports: tuple[int, ...]
    private: str = ""  # 172.31.216.x: a private range the operator did not list


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _free_third() -> int:
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    start = os.getpid() % 200
    for step in range(200):
        third = (start + step) % 200 + 20
        if f"10.216.{third}." not in routes:
            return third
    raise RuntimeError("no free 10.216.x.0/24")


@contextmanager
def internet(ports: tuple[int, ...] = (8080, 8081)) -> Iterator[Internet]:
    third = _free_third()
    tag = f"hre{os.getpid() % 100000}"
    net = f"10.216.{third}"
    inet = Internet(
        f"{net}.1",
        f"{net}.2",
        f"{net}.3",
        f"{net}.4",
        f"169.254.216.{third}",
        ports,
        f"172.31.216.{third}",
    )
    _ip("netns", "add", tag)
    server = None
    try:
        _ip("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b", "netns", tag)
        _ip("addr", "add", f"{inet.host_ip}/24", "dev", f"{tag}a")
        _ip("link", "set", f"{tag}a", "up")
        for addr in (inet.a, inet.b, inet.c):
            _ip("-n", tag, "addr", "add", f"{addr}/24", "dev", f"{tag}b")
        _ip("-n", tag, "addr", "add", f"{inet.link_local}/32", "dev", f"{tag}b")
        _ip("-n", tag, "addr", "add", f"{inet.private}/32", "dev", f"{tag}b")
        _ip("-n", tag, "link", "set", f"{tag}b", "up")
        _ip("-n", tag, "route", "add", "default", "via", inet.host_ip)
        _ip("route", "add", f"{inet.link_local}/32", "dev", f"{tag}a")
        _ip("route", "add", f"{inet.private}/32", "dev", f"{tag}a")
        listen = [
            f"{a}:{p}"
            for a in (inet.a, inet.b, inet.c, inet.link_local, inet.private)
            for p in ports
        ]
        server = subprocess.Popen(
            ["ip", "netns", "exec", tag, sys.executable, str(SERVER), net, *listen],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None and server.stdout.readline().strip() == "ok"
        # the host reaches every listener: a failure from a sandbox is the policy's
        for target in listen:
            h, p = target.rsplit(":", 1)
            socket.create_connection((h, int(p)), timeout=2).close()
        yield inet
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "route", "del", f"{inet.link_local}/32"], capture_output=True)
        subprocess.run(["ip", "route", "del", f"{inet.private}/32"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{tag}a"], capture_output=True)
        subprocess.run(["ip", "netns", "del", tag], capture_output=True)
