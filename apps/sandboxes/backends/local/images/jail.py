"""skopeo's own network namespace, so loopback is not this machine's.

Go's HTTP client never proxies ``localhost`` and loopback literals (proxy.py): a
registry the policy allows could redirect a pull, or name a token realm, on
``127.0.0.1:<port>`` and skopeo would connect straight to a service of this machine.
Run as root, each skopeo call gets a fresh network namespace holding only ``lo``, on
which two kinds of listener exist, each spliced to the host side:

* the egress proxy's port (so ``HTTPS_PROXY=http://127.0.0.1:<port>`` still works and
  every non-loopback connection is checked there);
* the pulled reference's own registry port, when that registry is a loopback address
  (the store's policy check has already allowed it: ``HEDGEROW_INSECURE_REGISTRIES``),
  on the same loopback address (``127.0.0.1`` or ``::1``).

Any other loopback port is connection refused; there is no other interface, so nothing
leaves except through these listeners. Not root: no namespace (``Jail.open`` returns
None); skopeo.py then refuses the call unless the operator accepted the gap
(docs/security.md "Registry egress").
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import ipaddress
import os
import select
import socket
import struct
import threading

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _lo_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _splice(a: socket.socket, b: socket.socket) -> None:
    peers = {a: b, b: a}
    open_ = [a, b]
    try:
        while open_:
            ready, _, _ = select.select(open_, [], [], 600)
            if not ready:
                return
            for s in ready:
                data = s.recv(65536)
                if not data:
                    open_.remove(s)
                    with contextlib.suppress(OSError):
                        peers[s].shutdown(socket.SHUT_WR)
                    continue
                peers[s].sendall(data)
    except OSError:
        return
    finally:
        a.close()
        b.close()


class Jail:
    """One namespace (``fd``, for ``nsenter --net=/proc/self/fd/<fd>``) and its
    listeners; ``close`` ends them."""

    def __init__(self, fd: int, listeners: list[tuple[socket.socket, tuple[str, int]]]) -> None:
        self.fd = fd
        self._listeners = listeners
        self._closed = threading.Event()
        for sock, target in listeners:
            threading.Thread(
                target=self._accept, args=(sock, target), name="skopeo-jail", daemon=True
            ).start()

    @classmethod
    def open(cls, forwards: dict[tuple[str, int], tuple[str, int]]) -> Jail | None:
        """A namespace with each ``(loopback address, port)`` key listening, spliced to
        its target (host side); None when this process may not create one (not root)."""
        if os.geteuid() != 0:
            return None
        made: dict[str, object] = {}

        def build() -> None:
            # only this thread enters the new namespace; it ends right after, the
            # namespace lives on through the fd and the sockets made in it
            try:
                if _libc.unshare(CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
                _lo_up()
                listeners = []
                for (addr, port), target in forwards.items():
                    v6 = ipaddress.ip_address(addr).version == 6
                    s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM)
                    if v6:
                        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    s.bind((addr, port))
                    s.listen(64)
                    listeners.append((s, target))
                made["fd"] = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", 0)
                made["listeners"] = listeners
            except OSError as exc:
                made["error"] = exc

        t = threading.Thread(target=build, name="skopeo-jail-netns")
        t.start()
        t.join()
        if "error" in made:
            raise made["error"]  # type: ignore[misc]
        return cls(made["fd"], made["listeners"])  # type: ignore[arg-type]

    def _accept(self, sock: socket.socket, target: tuple[str, int]) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            try:
                out = socket.create_connection(target, timeout=10)
            except OSError:
                conn.close()
                continue
            out.settimeout(None)
            threading.Thread(target=_splice, args=(conn, out), daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        for sock, _ in self._listeners:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)
