"""The instance's DNS resolver: answers sandboxes on their gateway, only for names their
egress policy permits, and logs every query (docs/egress.md "The resolver").

One process per instance (``main``, run by ``start``), started
by the backend when the first routed sandbox is provisioned (``ensure_resolver``).
Built on dnspython (a maintained wire-format codec; the forwarding, policy and logging
are ours, so nothing is resolved that the policy does not name and every decision is
logged where the control plane reads it). A query is answered after:

* the sandbox is found from the query's source address (the address claim file and
  meta.json, which it cannot forge: it has no capability in its netns); unknown
  sources are REFUSED;
* a per-sandbox token bucket (``RATE``/``BURST``): over it, REFUSED and flagged
  ``rate_limited``; long labels (> ``LONG_LABEL``) and TXT/NULL/ANY queries are
  flagged ``tunnel_suspect`` (answered only if the name is allowed anyway); names
  longer than ``LONG_NAME`` and messages larger than ``LARGE_QUERY`` bytes (data split
  over many short labels, padding) are flagged ``oversized``, likewise;
* a name the policy does not permit: NXDOMAIN;
* a permitted one: forwarded to the upstream as is (UDP, TCP on truncation); for an
  allowlist sandbox every A record of the answer becomes ``sandbox . address`` in the
  host set ``allow_dst`` with the record's TTL plus ``grace`` *before* the answer is
  sent, so the connection that follows passes.

The log: ``<state_dir>/sandboxes/<sid>/dns.jsonl`` (one JSON object per query: ts,
generation, name, type, allowed, rcode, answer, flags), rotated once at
``LOG_BYTES`` (so at most twice that per sandbox); read with ``read_log``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype

from apps.core.egress import FORBIDDEN_NETWORKS, NONE, EgressError, EgressPolicy, parse_egress

log = logging.getLogger(__name__)

RATE = 20.0  # queries per second per sandbox, sustained
BURST = 40.0
LONG_LABEL = 40
SUSPECT_TYPES = frozenset({"TXT", "NULL", "ANY"})
# a name of this many characters or more carries data, not a host; a plain query
# (one question, an EDNS OPT) is well under 512 bytes whatever the name
LONG_NAME = 100
LARGE_QUERY = 512
LOG_BYTES = 256 * 1024
MAX_TTL = 3600
UPSTREAM_TIMEOUT = 3.0


def log_path(state_dir: Path, sandbox_id: str) -> Path:
    return state_dir / "sandboxes" / sandbox_id / "dns.jsonl"


def read_log(state_dir: Path, sandbox_id: str, limit: int = 1000) -> list[dict[str, Any]]:
    """The sandbox's last ``limit`` queries, oldest first ([] when it made none)."""
    path = log_path(state_dir, sandbox_id)
    lines: list[str] = []
    for p in (path.with_name(path.name + ".1"), path):
        with contextlib.suppress(FileNotFoundError):
            lines += p.read_text().splitlines()
    out = []
    for line in lines[-limit:]:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


@dataclass
class Client:
    sandbox_id: str
    generation: int
    policy: EgressPolicy
    tokens: float = BURST
    at: float = field(default_factory=time.monotonic)

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(BURST, self.tokens + (now - self.at) * RATE)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Directory:
    """Source address → sandbox, its generation and policy (meta.json, re-read when it
    changes: a policy change on a live sandbox applies to its next query)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._cache: dict[str, tuple[int, Client]] = {}

    def lookup(self, ip: str) -> Client | None:
        try:
            sid = (self.state_dir / "addresses" / ip).read_text().strip()
            meta_file = self.state_dir / "sandboxes" / sid / "meta.json"
            stamp = meta_file.stat().st_mtime_ns
        except (OSError, ValueError):
            return None
        held = self._cache.get(ip)
        if held is not None and held[0] == stamp and held[1].sandbox_id == sid:
            return held[1]
        try:
            meta = json.loads(meta_file.read_text())
            policy = parse_egress(
                meta.get("egress", "all" if meta.get("network_access") else "none")
            )
        except (OSError, ValueError, EgressError):
            policy = NONE
            meta = {}
        client = Client(sid, int(meta.get("generation", 0)), policy)
        if held is not None and held[1].sandbox_id == sid:  # the bucket survives a change
            client.tokens, client.at = held[1].tokens, held[1].at
        self._cache[ip] = (stamp, client)
        return client


AllowFn = Callable[[str, list[tuple[str, int]]], None]


def nft_allow(table: str, grace: int) -> AllowFn:
    """Adds ``sandbox . address`` to ``allow_dst`` with timeout ttl + grace (replacing
    an element already there, so its timeout is the new one: add, delete, add in one
    transaction)."""
    from . import _nft

    def allow(sandbox_ip: str, addresses: list[tuple[str, int]]) -> None:
        cmds = []
        for addr, ttl in addresses:
            elem = f"{sandbox_ip} . {addr}"
            timeout = max(1, min(ttl, MAX_TTL)) + grace
            cmds += [
                f"add element inet {table} allow_dst {{ {elem} timeout 1s }}",
                f"delete element inet {table} allow_dst {{ {elem} }}",
                f"add element inet {table} allow_dst {{ {elem} timeout {timeout}s }}",
            ]
        if cmds:
            _nft.host_run("\n".join(cmds) + "\n")

    return allow


class Lookup(Protocol):
    """Source address → the sandbox asking (``Directory`` here; the Kubernetes
    resolver's reads pods)."""

    def lookup(self, ip: str) -> Client | None: ...


class Resolver:
    def __init__(
        self,
        state_dir: Path,
        upstream: tuple[str, int],
        allow: AllowFn,
        directory: Lookup | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.upstream = upstream
        self.allow = allow
        self.directory: Lookup = directory or Directory(state_dir)

    def open_addresses(
        self, client: Client, source: str, name: str, addresses: list[tuple[str, int]]
    ) -> None:
        """Lets ``client`` reach the addresses an allowed ``name`` resolved to, before
        the answer is sent (here: the host set; the Kubernetes resolver overrides it)."""
        self.allow(source, addresses)

    async def handle(self, wire: bytes, source: str) -> bytes | None:
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return _formerr(wire)
        client = self.directory.lookup(source)
        if client is None or client.policy.mode == "none" or len(query.question) != 1:
            return _reply(query, dns.rcode.REFUSED)
        q = query.question[0]
        name = q.name.to_text(omit_final_dot=True).lower()
        qtype = dns.rdatatype.to_text(q.rdtype)
        flags = []
        if any(len(label) > LONG_LABEL for label in q.name.labels) or qtype in SUSPECT_TYPES:
            flags.append("tunnel_suspect")
        if len(name) > LONG_NAME or len(wire) > LARGE_QUERY:
            flags.append("oversized")
        entry: dict[str, Any] = {
            "ts": round(time.time(), 3),
            "generation": client.generation,
            "name": name,
            "type": qtype,
        }
        if not client.take():
            self._log(
                client,
                {
                    **entry,
                    "allowed": False,
                    "rcode": "REFUSED",
                    "answer": [],
                    "flags": [*flags, "rate_limited"],
                },
            )
            return _reply(query, dns.rcode.REFUSED)
        if not client.policy.allows_name(name):
            self._log(
                client,
                {**entry, "allowed": False, "rcode": "NXDOMAIN", "answer": [], "flags": flags},
            )
            return _reply(query, dns.rcode.NXDOMAIN)
        try:
            answer_wire = await self._forward(wire)
            answer = dns.message.from_wire(answer_wire)
        except (OSError, TimeoutError, dns.exception.DNSException) as exc:
            self._log(
                client,
                {
                    **entry,
                    "allowed": True,
                    "rcode": "SERVFAIL",
                    "answer": [],
                    "flags": [*flags, "upstream_failed"],
                    "error": str(exc)[:200],
                },
            )
            return _reply(query, dns.rcode.SERVFAIL)
        addresses = [
            (rd.address, rrset.ttl)
            for rrset in answer.answer
            if rrset.rdtype == dns.rdatatype.A
            for rd in rrset
        ]
        # an upstream answer naming a never-reachable or a host address opens nothing
        # (the forward chain would drop it anyway; the SNI check connects from the host)
        refused = [(a, t) for a, t in addresses if not reachable_address(a)]
        if refused:
            flags.append("forbidden_answer")
            addresses = [(a, t) for a, t in addresses if (a, t) not in refused]
        if client.policy.mode == "allow" and addresses:
            try:
                await asyncio.get_running_loop().run_in_executor(
                    None, self.open_addresses, client, source, name, addresses
                )
            except Exception as exc:  # noqa: BLE001 - never an answer the set does not match
                self._log(
                    client,
                    {
                        **entry,
                        "allowed": True,
                        "rcode": "SERVFAIL",
                        "answer": [],
                        "flags": [*flags, "set_failed"],
                        "error": str(exc)[:200],
                    },
                )
                return _reply(query, dns.rcode.SERVFAIL)
        self._log(
            client,
            {
                **entry,
                "allowed": True,
                "rcode": dns.rcode.to_text(answer.rcode()),
                "answer": [{"address": a, "ttl": t} for a, t in addresses],
                "flags": flags,
            },
        )
        return answer_wire

    async def _forward(self, wire: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, self.upstream)
            await loop.sock_sendall(sock, wire)
            data = await asyncio.wait_for(loop.sock_recv(sock, 65535), UPSTREAM_TIMEOUT)
        finally:
            sock.close()
        if len(data) >= 4 and data[2] & 0x02:  # TC: again over TCP
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream), UPSTREAM_TIMEOUT
            )
            try:
                writer.write(struct.pack("!H", len(wire)) + wire)
                size = struct.unpack(
                    "!H", await asyncio.wait_for(reader.readexactly(2), UPSTREAM_TIMEOUT)
                )[0]
                data = await asyncio.wait_for(reader.readexactly(size), UPSTREAM_TIMEOUT)
            finally:
                writer.close()
        return data

    def _log(self, client: Client, entry: dict[str, Any]) -> None:
        path = log_path(self.state_dir, client.sandbox_id)
        line = json.dumps(entry, separators=(",", ":")) + "\n"
        try:
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_size + len(line) > LOG_BYTES:
                    path.replace(path.with_name(path.name + ".1"))
            with open(path, "a") as fh:
                fh.write(line)
        except OSError as exc:  # a sandbox being destroyed: its dir is going
            log.debug("dns log for %s: %s", client.sandbox_id, exc)


def _reply(query: dns.message.Message, rcode: dns.rcode.Rcode) -> bytes:
    response = dns.message.make_response(query)
    response.set_rcode(rcode)
    response.flags |= dns.flags.RA
    return bytes(response.to_wire())


def _formerr(wire: bytes) -> bytes | None:
    if len(wire) < 12:
        return None
    # id, flags QR|opcode-from-query, rcode FORMERR; no sections
    flags = 0x8000 | (wire[2] & 0x78) << 8 | int(dns.rcode.FORMERR)
    return wire[:2] + struct.pack("!HHHHH", flags, 0, 0, 0, 0)


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, resolver: Resolver) -> None:
        self.resolver = resolver
        self.transport: asyncio.DatagramTransport | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        task = asyncio.get_running_loop().create_task(self._answer(data, addr))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        reply = await self.resolver.handle(data, str(addr[0]))
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


async def _tcp(
    resolver: Resolver, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    source = str(writer.get_extra_info("peername")[0])
    try:
        while True:
            size = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 10))[0]
            wire = await asyncio.wait_for(reader.readexactly(size), 10)
            reply = await resolver.handle(wire, source)
            if reply is None:
                break
            writer.write(struct.pack("!H", len(reply)) + reply)
            await writer.drain()
    except (asyncio.IncompleteReadError, TimeoutError, OSError):
        pass
    finally:
        writer.close()


# ---- SNI / Host check ("match": "sni") ------------------------------------------------
# The host table DNATs an sni-matching sandbox's connections to resolved addresses on
# 80/443 to the gateway's SNI_PORT. Here: the original destination (SO_ORIGINAL_DST),
# the first bytes (a TLS ClientHello's server_name, or an HTTP request's Host), the
# policy's verdict; allowed, a connection from the host to the original destination
# gets those bytes and both directions are spliced; refused, the connection is closed.

SO_ORIGINAL_DST = 80
PEEK_TIMEOUT = 5.0


def tls_server_name(data: bytes) -> str | None:
    """The server_name of a TLS ClientHello record (None: not one, or none in it)."""
    try:
        if len(data) < 5 or data[0] != 0x16 or data[5] != 0x01:
            return None
        pos = 5 + 4 + 2 + 32  # record header, handshake header, version, random
        pos += 1 + data[pos]  # session id
        pos += 2 + int.from_bytes(data[pos : pos + 2], "big")  # cipher suites
        pos += 1 + data[pos]  # compression methods
        end = pos + 2 + int.from_bytes(data[pos : pos + 2], "big")
        pos += 2
        while pos + 4 <= end:
            kind = int.from_bytes(data[pos : pos + 2], "big")
            size = int.from_bytes(data[pos + 2 : pos + 4], "big")
            if kind == 0:  # server_name: list length, type 0, name length, name
                name_len = int.from_bytes(data[pos + 7 : pos + 9], "big")
                return data[pos + 9 : pos + 9 + name_len].decode("ascii").lower()
            pos += 4 + size
    except (IndexError, UnicodeDecodeError):
        return None
    return None


def http_host(data: bytes) -> str | None:
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1", "replace")
    for line in head.split("\r\n")[1:]:
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == "host":
            return value.strip().rsplit(":", 1)[0].lower() or None
    return None


def reachable_address(address: str) -> bool:
    """Not in an always-denied range and not one of the host's own addresses."""
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:
        return False
    if any(ip in net for net in FORBIDDEN_NETWORKS):
        return False
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.bind((address, 0))  # succeeds only for a local address
    except OSError:
        return True
    finally:
        probe.close()
    return False


def original_dst(writer: asyncio.StreamWriter) -> tuple[str, int]:
    sock = writer.get_extra_info("socket")
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port = int.from_bytes(raw[2:4], "big")
    return socket.inet_ntoa(raw[4:8]), port


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            writer.close()


async def _sni(
    resolver: Resolver, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    source = str(writer.get_extra_info("peername")[0])
    try:
        address, port = original_dst(writer)
        # only what the host table redirected: 80/443 of another machine's address
        if port not in (80, 443) or not reachable_address(address):
            writer.close()
            return
        data = await asyncio.wait_for(reader.read(16384), PEEK_TIMEOUT)
    except (OSError, TimeoutError):
        writer.close()
        return
    client = resolver.directory.lookup(source)
    name = tls_server_name(data) if port == 443 else http_host(data)
    allowed = bool(client and name and client.policy.allows_name(name))
    if client is not None:
        resolver._log(
            client,
            {
                "ts": round(time.time(), 3),
                "generation": client.generation,
                "name": name or "",
                "type": "SNI" if port == 443 else "HOST",
                "allowed": allowed,
                "rcode": "",
                "answer": [{"address": address, "ttl": 0}],
                "flags": [] if name else ["no_name"],
            },
        )
    if not allowed:
        writer.close()
        return
    try:
        up_reader, up_writer = await asyncio.wait_for(
            asyncio.open_connection(address, port), UPSTREAM_TIMEOUT
        )
    except (OSError, TimeoutError):
        writer.close()
        return
    up_writer.write(data)
    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def serve(
    resolver: Resolver, listen: str, port: int, ready: Callable[[], None], sni_port: int = 0
) -> None:
    loop = asyncio.get_running_loop()
    await loop.create_datagram_endpoint(lambda: _Udp(resolver), local_addr=(listen, port))
    server = await asyncio.start_server(
        lambda r, w: _tcp(resolver, r, w), host=listen, port=port, reuse_address=True
    )
    if sni_port:
        await asyncio.start_server(
            lambda r, w: _sni(resolver, r, w), host=listen, port=sni_port, reuse_address=True
        )
    ready()
    async with server:
        await server.serve_forever()


def parse_upstream(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    return (host, int(port)) if sep and "." in host else (value, 53)


def system_upstream(resolv_conf: Path = Path("/etc/resolv.conf")) -> str:
    """The host's first IPv4 nameserver (the default upstream)."""
    with contextlib.suppress(OSError):
        for line in resolv_conf.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver" and "." in parts[1]:
                return parts[1]
    return ""


# ---- the process, seen from the backend -----------------------------------------------


def pid_alive(pid_file: Path) -> bool:
    """The resolver of pid_file runs: its pid with the same kernel start time, and not a
    zombie (a resolver that died stays one until the process that started it, any web
    or worker process, reaps it; it serves nothing)."""
    try:
        pid, start = pid_file.read_text().split()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] not in ("Z", "X") and fields[19] == start


def start(
    state_dir: Path,
    listen: str,
    upstream: str,
    table: str,
    grace: int,
    *,
    port: int = 53,
    sni_port: int = 0,
) -> None:
    """Starts the instance's resolver unless it runs; returns once it answers.

    The caller holds the instance lock. The process is its own session (it outlives
    the provisioning process: web, worker and CLI all provision); its pid and kernel
    start time are in ``resolver.pid``, its output in ``resolver.log``.
    """
    pid_file = state_dir / "resolver.pid"
    if pid_alive(pid_file):
        return
    repo = Path(__file__).resolve().parents[4]
    with open(state_dir / "resolver.log", "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from apps.sandboxes.backends.local.resolver import main; main()",
                "--state-dir",
                str(state_dir),
                "--listen",
                listen,
                "--port",
                str(port),
                "--upstream",
                upstream,
                "--table",
                table,
                "--grace",
                str(grace),
                "--sni-port",
                str(sni_port),
            ],
            cwd=repo,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(repo)},
        )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (state_dir / "resolver.log").read_text()[-500:]
            raise OSError(f"the resolver exited ({proc.returncode}): {tail}")
        if pid_alive(pid_file):
            return
        time.sleep(0.02)  # polling for a condition with a deadline
    proc.kill()
    raise OSError("the resolver did not start in 15 s")


def stop(state_dir: Path) -> None:
    pid_file = state_dir / "resolver.pid"
    if pid_alive(pid_file):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text().split()[0]), 9)
    with contextlib.suppress(FileNotFoundError):
        pid_file.unlink()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--port", type=int, default=53)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--grace", type=int, default=30)
    parser.add_argument("--sni-port", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    resolver = Resolver(
        args.state_dir, parse_upstream(args.upstream), nft_allow(args.table, args.grace)
    )

    def ready() -> None:
        start_time = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
        tmp = args.state_dir / "resolver.pid.tmp"
        tmp.write_text(f"{os.getpid()} {start_time}\n")
        tmp.replace(args.state_dir / "resolver.pid")
        log.info("resolver %s on %s:%s → %s", os.getpid(), args.listen, args.port, args.upstream)

    asyncio.run(serve(resolver, args.listen, args.port, ready, args.sni_port))


if __name__ == "__main__":
    main()
