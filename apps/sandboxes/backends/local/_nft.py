"""nftables in-process through libnftables (what ``nft -f -`` does, without ``nft``).

A context's netlink socket is opened by ``nft_ctx_new`` in the namespace of the
calling thread and stays there: a context made inside a sandbox's netns (see
``_netlink.in_new_netns``) configures that netns; the host context is made in the
host's. Contexts are not thread-safe, and a socket inherited across ``fork`` would
be shared with the parent: the host context is per process. libnftables promises
no thread safety (it keeps some global state), so every call into it holds one
process-wide lock.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import socket
import struct
import threading
from types import TracebackType

from ._netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST, attr, attr_str, header, wait_ack

NFT_CTX_OUTPUT_JSON = 1 << 4


def _load() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("nftables") or "libnftables.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
    for fn in (lib.nft_ctx_buffer_output, lib.nft_ctx_buffer_error):
        fn.argtypes = [ctypes.c_void_p]
    for fn in (lib.nft_ctx_get_output_buffer, lib.nft_ctx_get_error_buffer):
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_char_p
    lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    return lib


_lib = _load()


def available() -> bool:
    return _lib is not None


class NftError(Exception):
    pass


_lib_lock = threading.RLock()


class Nft:
    """One libnftables context in the calling thread's netns."""

    def __init__(self, *, json: bool = False) -> None:
        if _lib is None:
            raise NftError("libnftables is not installed")
        self._lib = _lib
        with _lib_lock:
            ctx = _lib.nft_ctx_new(0)
            if not ctx:
                raise NftError("nft_ctx_new failed")
            self._ctx: int | None = ctx
            _lib.nft_ctx_buffer_output(ctx)
            _lib.nft_ctx_buffer_error(ctx)
            if json:
                _lib.nft_ctx_output_set_flags(ctx, NFT_CTX_OUTPUT_JSON)

    def run(self, commands: str) -> str:
        """Run ``commands`` (one transaction); returns the output, raises on error."""
        if self._ctx is None:
            raise NftError("context closed")
        with _lib_lock:
            rc = self._lib.nft_run_cmd_from_buffer(self._ctx, commands.encode())
            out = self._lib.nft_ctx_get_output_buffer(self._ctx) or b""
            err = self._lib.nft_ctx_get_error_buffer(self._ctx) or b""
        if rc != 0:
            raise NftError(err.decode(errors="replace").strip() or f"nft: error {rc}")
        return out.decode(errors="replace")

    def close(self) -> None:
        if self._ctx is not None:
            with _lib_lock:
                self._lib.nft_ctx_free(self._ctx)
            self._ctx = None

    def __enter__(self) -> Nft:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


_host: dict[bool, tuple[int, Nft]] = {}


def host_run(commands: str, *, json: bool = False) -> str:
    """Run ``commands`` in the host netns with this process's shared context.

    Callers are threads in the host netns (only ``_netlink``'s own short-lived
    threads ever switch namespace).
    """
    with _lib_lock:
        held = _host.get(json)
        if held is None or held[0] != os.getpid():
            held = _host[json] = (os.getpid(), Nft(json=json))
        return held[1].run(commands)


# ---- raw nf_tables netlink for the per-sandbox hot path ----------------------------
# libnftables refreshes its cache from the kernel before (and, on an error, after)
# each command: with the host's ruleset (every instance's tables) that is ~7-10 ms
# of CPU per call. Checking that a table exists and adding or removing one set
# element are single kernel requests, sent here directly.

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END = 0x10, 0x11
NFT_MSG_GETTABLE = 1
NFT_MSG_NEWSETELEM, NFT_MSG_DELSETELEM = 12, 14
NFTA_TABLE_NAME = 1
NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_LIST_SET, NFTA_SET_ELEM_LIST_ELEMENTS = 1, 2, 3
NFTA_LIST_ELEM = 1
NFTA_SET_ELEM_KEY = 1
NFTA_DATA_VALUE = 1
NLA_F_NESTED = 0x8000
FAMILIES = {"inet": 1, "ip": 2, "bridge": 7}

_NFGEN = struct.Struct("=BBH")  # family, version, res_id (big-endian)


def _nfmsg(msg: int) -> int:
    return (NFNL_SUBSYS_NFTABLES << 8) | msg


def _nested(kind: int, payload: bytes) -> bytes:
    return attr(kind | NLA_F_NESTED, payload)


class NfNetlink:
    """One NETLINK_NETFILTER socket in the calling thread's netns."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> NfNetlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _msg(self, kind: int, flags: int, family: int, body: bytes, res_id: int = 0) -> bytes:
        self.seq += 1
        payload = _NFGEN.pack(family, 0, socket.htons(res_id)) + body
        return header(len(payload), kind, flags | NLM_F_REQUEST, self.seq) + payload

    def table_exists(self, family: str, name: str) -> bool:
        msg = self._msg(
            _nfmsg(NFT_MSG_GETTABLE), NLM_F_ACK, FAMILIES[family], attr_str(NFTA_TABLE_NAME, name)
        )
        self.sock.send(msg)
        try:
            wait_ack(self.sock, self.seq)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return False
            raise
        return True

    def set_element(self, family: str, table: str, set_name: str, ipv4: str, *, add: bool) -> bool:
        """Add (``add``) or delete one IPv4 element, in one transaction.

        Returns False when deleting an element that is not there.
        """
        key = _nested(NFTA_SET_ELEM_KEY, attr(NFTA_DATA_VALUE, socket.inet_aton(ipv4)))
        body = (
            attr_str(NFTA_SET_ELEM_LIST_TABLE, table)
            + attr_str(NFTA_SET_ELEM_LIST_SET, set_name)
            + _nested(NFTA_SET_ELEM_LIST_ELEMENTS, _nested(NFTA_LIST_ELEM, key))
        )
        kind = NFT_MSG_NEWSETELEM if add else NFT_MSG_DELSETELEM
        begin = self._msg(NFNL_MSG_BATCH_BEGIN, 0, 0, b"", NFNL_SUBSYS_NFTABLES)
        change = self._msg(
            _nfmsg(kind), NLM_F_ACK | (NLM_F_CREATE if add else 0), FAMILIES[family], body
        )
        seq = self.seq
        end = self._msg(NFNL_MSG_BATCH_END, 0, 0, b"", NFNL_SUBSYS_NFTABLES)
        self.sock.send(begin + change + end)
        try:
            wait_ack(self.sock, seq)
        except OSError as exc:
            if not add and exc.errno == errno.ENOENT:
                return False
            raise
        return True
