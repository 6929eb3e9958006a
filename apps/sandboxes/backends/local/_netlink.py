"""In-process rtnetlink and named network namespaces (what ``ip`` does, without ``ip``).

Spawning ``ip`` from a large Celery worker costs a fork+exec per command; a sandbox
needed about ten of them to come and go. The same requests sent over one netlink
socket cost a few syscalls. Only the handful of requests the local backend needs
are here: create/delete links (veth pairs, the bridge), set flags, add addresses,
a default route, neighbour entries and bridge forwarding entries.

Named netns follow ``ip netns``'s convention exactly (a bind mount of the
namespace on ``/run/netns/<name>``, the directory a shared mount), so ``ip netns``,
``ip -n``, gc and operators see and remove them as before.

A netlink socket belongs to the namespace of the thread that opened it, for its
whole life. So a namespace is created by ``unshare(CLONE_NEWNET)`` in a short-lived
thread of our own that opens a socket inside it and exits: the calling thread never
changes namespace, and the socket keeps configuring the namespace afterwards.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

NETNS_DIR = Path("/run/netns")

CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_SHARED = 1 << 20
MNT_DETACH = 2

NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_REPLACE = 0x100
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
NLMSG_ERROR = 2

RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
RTM_NEWADDR = 20
RTM_NEWROUTE = 24
RTM_NEWNEIGH, RTM_DELNEIGH = 28, 29

IFLA_ADDRESS = 1
IFLA_IFNAME = 3
IFLA_MASTER = 10
IFLA_LINKINFO = 18
IFLA_IFALIAS = 20
IFLA_NET_NS_FD = 28
IFLA_INFO_KIND = 1
IFLA_INFO_DATA = 2
IFLA_INFO_SLAVE_KIND = 4
IFLA_INFO_SLAVE_DATA = 5
IFLA_BRPORT_ISOLATED = 33
VETH_INFO_PEER = 1
IFF_UP = 0x1

IFA_ADDRESS = 1
IFA_LOCAL = 2
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_PREFSRC = 1, 4, 5, 7
RT_SCOPE_LINK = 253
RT_TABLE_MAIN = 254
RTPROT_BOOT = 3
RTN_UNICAST = 1

NDA_DST = 1
NDA_LLADDR = 2
NUD_NOARP = 0x40
NUD_PERMANENT = 0x80
NTF_MASTER = 0x04
AF_BRIDGE = 7

_IFINFO = struct.Struct("=BxHiII")  # family, type, index, flags, change
_IFADDR = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")
_NDMSG = struct.Struct("=BxxxiHBB")  # family, ifindex, state, flags, type
_NLHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_NLA = struct.Struct("=HH")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.unshare.argtypes = [ctypes.c_int]
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class NetlinkError(OSError):
    """A request the kernel refused (``errno`` is the kernel's answer)."""


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise NetlinkError(err, f"{what}: {os.strerror(err)}")


def attr(kind: int, payload: bytes) -> bytes:
    head = _NLA.pack(_NLA.size + len(payload), kind)
    return head + payload + b"\0" * (-len(payload) % 4)


def attr_str(kind: int, value: str) -> bytes:
    return attr(kind, value.encode() + b"\0")


def attr_u32(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("=I", value))


def ifinfo(index: int = 0, flags: int = 0, change: int = 0) -> bytes:
    return _IFINFO.pack(socket.AF_UNSPEC, 0, index, flags, change)


def bridge_port_isolated() -> bytes:
    """Bridge-port option ``isolated on`` (for a link already enslaved to a bridge)."""
    port = attr(IFLA_BRPORT_ISOLATED, b"\x01")
    return attr(
        IFLA_LINKINFO, attr_str(IFLA_INFO_SLAVE_KIND, "bridge") + attr(IFLA_INFO_SLAVE_DATA, port)
    )


def mac_bytes(mac: str) -> bytes:
    return bytes(int(part, 16) for part in mac.split(":"))


def header(body_len: int, msg_type: int, flags: int, seq: int) -> bytes:
    return _NLHDR.pack(_NLHDR.size + body_len, msg_type, flags | NLM_F_REQUEST, seq, 0)


def wait_ack(sock: socket.socket, seq: int) -> None:
    """Read until the ack (or error) of request ``seq``; raise NetlinkError on error."""
    while True:
        data = sock.recv(65536)
        offset = 0
        while offset + _NLHDR.size <= len(data):
            length, kind, _flags, got_seq, _pid = _NLHDR.unpack_from(data, offset)
            if kind == NLMSG_ERROR and got_seq == seq:
                (code,) = struct.unpack_from("=i", data, offset + _NLHDR.size)
                if code:
                    raise NetlinkError(-code, os.strerror(-code))
                return
            if length < _NLHDR.size:
                break
            offset += (length + 3) & ~3


class Rtnl:
    """One rtnetlink socket; every request waits for its ack (errors raise)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        self.sock.bind((0, 0))
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Rtnl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, msg_type: int, flags: int, body: bytes) -> None:
        self.seq += 1
        self.sock.send(header(len(body), msg_type, flags | NLM_F_ACK, self.seq) + body)
        wait_ack(self.sock, self.seq)

    # ---- links ----------------------------------------------------------------------

    def new_link(self, body: bytes, *, create: bool = True) -> None:
        flags = NLM_F_CREATE | NLM_F_EXCL if create else 0
        self.request(RTM_NEWLINK, flags, body)

    def add_veth(self, name: str, peer: bytes) -> None:
        """A veth pair ``name`` ↔ peer (``peer``: ifinfomsg + attributes of the far end)."""
        info = attr_str(IFLA_INFO_KIND, "veth") + attr(IFLA_INFO_DATA, attr(VETH_INFO_PEER, peer))
        self.new_link(ifinfo() + attr_str(IFLA_IFNAME, name) + attr(IFLA_LINKINFO, info))

    def add_bridge(self, name: str, mac: str) -> None:
        """A bridge with a fixed MAC: one created without keeps changing it to the
        lowest of its ports' as they come and go."""
        info = attr_str(IFLA_INFO_KIND, "bridge")
        self.new_link(
            ifinfo()
            + attr_str(IFLA_IFNAME, name)
            + attr(IFLA_ADDRESS, mac_bytes(mac))
            + attr(IFLA_LINKINFO, info)
        )

    def set_link(self, name: str, *attrs: bytes, up: bool = False) -> None:
        body = ifinfo(flags=IFF_UP if up else 0, change=IFF_UP if up else 0)
        self.new_link(body + attr_str(IFLA_IFNAME, name) + b"".join(attrs), create=False)

    def index_of(self, name: str) -> int:
        """ifindex of link ``name`` in this socket's netns."""
        self.seq += 1
        body = ifinfo() + attr_str(IFLA_IFNAME, name)
        self.sock.send(header(len(body), RTM_GETLINK, 0, self.seq) + body)
        while True:
            data = self.sock.recv(65536)
            offset = 0
            while offset + _NLHDR.size <= len(data):
                length, kind, _flags, seq, _pid = _NLHDR.unpack_from(data, offset)
                if seq == self.seq and kind == RTM_NEWLINK:
                    return int(_IFINFO.unpack_from(data, offset + _NLHDR.size)[2])
                if seq == self.seq and kind == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", data, offset + _NLHDR.size)
                    raise NetlinkError(-code, f"{name}: {os.strerror(-code)}")
                if length < _NLHDR.size:
                    break
                offset += (length + 3) & ~3

    def del_link(self, name: str) -> bool:
        """Delete link ``name``; False when it does not exist."""
        try:
            self.request(RTM_DELLINK, 0, ifinfo() + attr_str(IFLA_IFNAME, name))
        except NetlinkError as exc:
            if exc.errno == errno.ENODEV:
                return False
            raise
        return True

    # ---- addresses and routes -------------------------------------------------------

    def add_addr(self, index: int, ip: str, prefixlen: int, *, replace: bool = False) -> None:
        raw = socket.inet_aton(ip)
        body = _IFADDR.pack(socket.AF_INET, prefixlen, 0, 0, index)
        body += attr(IFA_LOCAL, raw) + attr(IFA_ADDRESS, raw)
        flags = NLM_F_CREATE | (NLM_F_REPLACE if replace else NLM_F_EXCL)
        self.request(RTM_NEWADDR, flags, body)

    def add_default_route(self, gateway: str) -> None:
        body = _RTMSG.pack(socket.AF_INET, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, 0, RTN_UNICAST, 0)
        body += attr(RTA_GATEWAY, socket.inet_aton(gateway))
        self.request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, body)

    def replace_link_route(self, dst: str, prefixlen: int, index: int, prefsrc: str) -> None:
        """``ip route replace DST/LEN dev INDEX scope link src PREFSRC`` (main table):
        the link's device reaches the block directly, from source ``prefsrc``."""
        body = _RTMSG.pack(
            socket.AF_INET,
            prefixlen,
            0,
            0,
            RT_TABLE_MAIN,
            RTPROT_BOOT,
            RT_SCOPE_LINK,
            RTN_UNICAST,
            0,
        )
        body += attr(RTA_DST, socket.inet_aton(dst)) + attr_u32(RTA_OIF, index)
        body += attr(RTA_PREFSRC, socket.inet_aton(prefsrc))
        self.request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE, body)

    # ---- neighbours -----------------------------------------------------------------

    def set_neigh(self, index: int, ip: str, mac: str) -> None:
        """Permanent IPv4 neighbour ``ip`` → ``mac`` on link ``index`` (created or
        replaced). Permanent entries are never probed and are exempt from neighbour
        GC and from gc_thresh1-3 (``neigh_alloc``'s ``exempt_from_gc``, since 4.19)."""
        body = _NDMSG.pack(socket.AF_INET, index, NUD_PERMANENT, 0, 0)
        body += attr(NDA_DST, socket.inet_aton(ip)) + attr(NDA_LLADDR, mac_bytes(mac))
        self.request(RTM_NEWNEIGH, NLM_F_CREATE | NLM_F_REPLACE, body)

    def del_neigh(self, index: int, ip: str) -> bool:
        """Delete the IPv4 neighbour ``ip`` of link ``index``; False when absent."""
        body = _NDMSG.pack(socket.AF_INET, index, 0, 0, 0) + attr(NDA_DST, socket.inet_aton(ip))
        try:
            self.request(RTM_DELNEIGH, 0, body)
        except NetlinkError as exc:
            if exc.errno in (errno.ENOENT, errno.ENODEV):
                return False
            raise
        return True

    def set_fdb_static(self, port_index: int, mac: str) -> None:
        """Static bridge forwarding entry: frames to ``mac`` go to port ``port_index``
        only (``bridge fdb replace MAC dev PORT master static``); it goes with the port."""
        body = _NDMSG.pack(AF_BRIDGE, port_index, NUD_NOARP, NTF_MASTER, 0)
        body += attr(NDA_LLADDR, mac_bytes(mac))
        self.request(RTM_NEWNEIGH, NLM_F_CREATE | NLM_F_REPLACE, body)


def link_index(name: str) -> int:
    """ifindex of ``name`` in the calling thread's netns (0 when absent)."""
    try:
        return socket.if_nametoindex(name)
    except OSError:
        return 0


T = TypeVar("T")


def in_new_netns(name: str, work: Callable[[Rtnl], T]) -> tuple[Rtnl, T]:
    """Create named netns ``name`` (like ``ip netns add``) and run ``work`` inside it.

    Runs in a thread of its own that exits afterwards, so no namespace switch ever
    touches the caller's thread. Returns a netlink socket bound to the new netns
    (for the caller to go on configuring it) and ``work``'s result. On failure the
    netns is removed again.
    """
    result: list[tuple[Rtnl, T]] = []
    failure: list[BaseException] = []
    caller = threading.get_native_id()

    def run() -> None:
        path = NETNS_DIR / name
        created = False
        try:
            _own_os_thread(caller)
            _prepare_netns_dir()
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0)
            os.close(fd)
            created = True
            _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
            _check(
                _libc.mount(b"/proc/thread-self/ns/net", bytes(path), b"none", MS_BIND, None),
                f"bind-mount netns {name}",
            )
            rtnl = Rtnl()
            try:
                result.append((rtnl, work(rtnl)))
            except BaseException:
                rtnl.close()
                raise
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            if created:
                delete_netns(name)
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"netns-{name}")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def _own_os_thread(caller: int) -> None:
    # With green threads (gevent's monkey patching) a "thread" may share the
    # caller's OS thread, and a namespace switch would hit the caller.
    if threading.get_native_id() == caller:
        raise NetlinkError(errno.EDEADLK, "namespace work needs an OS thread of its own")


_netns_dir_shared = False
_netns_dir_lock = threading.Lock()


def _prepare_netns_dir() -> None:
    """/run/netns as a shared mount point, as ``ip netns add`` leaves it: netns
    mounts made here propagate to mount namespaces cloned from this one."""
    global _netns_dir_shared
    with _netns_dir_lock:
        if _netns_dir_shared:
            return
        NETNS_DIR.mkdir(mode=0o755, exist_ok=True)
        target = bytes(NETNS_DIR)
        if _libc.mount(b"", target, b"none", MS_SHARED | MS_REC, None) != 0:
            if ctypes.get_errno() != errno.EINVAL:
                _check(-1, f"make {NETNS_DIR} shared")
            # not a mount point yet: make it one, then shared
            _check(_libc.mount(target, target, b"none", MS_BIND | MS_REC, None), "bind")
            _check(_libc.mount(b"", target, b"none", MS_SHARED | MS_REC, None), "share")
        _netns_dir_shared = True


def delete_netns(name: str) -> bool:
    """Remove named netns ``name`` like ``ip netns del``; False when it did not exist.

    The namespace itself (and the veth end inside it) goes when its last user does.
    """
    path = NETNS_DIR / name
    _libc.umount2(bytes(path), MNT_DETACH)  # EINVAL (not mounted) is fine: unlink it
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def netns_pids(name: str) -> list[int]:
    """Pids of processes in named netns ``name`` (what ``ip netns pids`` prints)."""
    try:
        st = os.stat(NETNS_DIR / name)
    except FileNotFoundError:
        return []
    want = (st.st_dev, st.st_ino)
    found = []
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                ns = os.stat(f"/proc/{entry.name}/ns/net")
            except OSError:
                continue
            if (ns.st_dev, ns.st_ino) == want:
                found.append(int(entry.name))
    return found
