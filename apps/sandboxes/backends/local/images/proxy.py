"""The registry egress proxy: every connection skopeo opens goes through here, and is
checked against the egress policy where it is made.

The policy check before each skopeo call (store.py) sees only the reference's registry.
skopeo then resolves the name again itself (a DNS answer that changes in between is not
seen), follows HTTP redirects (blob downloads go to CDNs) and bearer-token realms to any
URL the registry names. Through this proxy (``HTTPS_PROXY``/``HTTP_PROXY`` of the skopeo
process) each of those connections is checked — the target's host, every address it
resolves to, resolved once here — and opened to exactly the address that was checked:

* ``CONNECT host:port`` (HTTPS): checked, connected, then spliced both ways;
* ``GET http://host/…`` (plain HTTP): only for the policy's ``insecure`` list, forwarded
  once with ``Connection: close``.

A refusal is ``403`` (skopeo reports a failed connection) and is recorded in
``refused`` and the log. Go's HTTP client never proxies ``localhost`` and loopback
literals: those connections skip the proxy, so skopeo runs in a network namespace of
its own where loopback is not this machine's (jail.py; docs/security.md "Registry
egress").
Plain Python, threads, stdlib only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

from . import errors
from .egress import RegistryPolicy
from .reference import Reference

log = logging.getLogger(__name__)

MAX_HEAD = 16 * 1024
CONNECT_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 600.0


def _target(host: str, port: int) -> Reference:
    """The policy speaks in references: a registry ``host:port`` with a dummy path."""
    shown = f"[{host}]" if ":" in host else host
    return Reference(f"{shown}:{port}", "proxy/check", "x", None)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        client = self.request
        client.settimeout(CONNECT_TIMEOUT_S)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = client.recv(4096)
            if not chunk:
                return
            head += chunk
            if len(head) > MAX_HEAD:
                return
        header, _, rest = head.partition(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        try:
            method, uri, _version = lines[0].split(" ", 2)
        except ValueError:
            return
        if method == "CONNECT":
            host, _, port_text = uri.rpartition(":")
            host = host.strip("[]")
            upstream = self.server.open(host, int(port_text or 443), plain=False)
            if upstream is None:
                client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                return
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            if rest:
                upstream.sendall(rest)
        else:
            url = urlsplit(uri)
            if url.scheme != "http" or not url.hostname:
                client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                return
            upstream = self.server.open(url.hostname, url.port or 80, plain=True)
            if upstream is None:
                client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                return
            path = url.path or "/"
            if url.query:
                path += "?" + url.query
            kept = [
                ln
                for ln in lines[1:]
                if ln.split(":", 1)[0].strip().lower()
                not in ("connection", "proxy-connection", "keep-alive")
            ]
            request = "\r\n".join([f"{method} {path} HTTP/1.1", *kept, "Connection: close"])
            upstream.sendall(request.encode("latin-1") + b"\r\n\r\n" + rest)
        with upstream:
            _splice(client, upstream)


def _splice(a: socket.socket, b: socket.socket) -> None:
    a.settimeout(None)
    b.settimeout(None)
    peers = {a: b, b: a}
    open_ = [a, b]
    while open_:
        ready, _, _ = select.select(open_, [], [], IDLE_TIMEOUT_S)
        if not ready:
            return
        for s in ready:
            try:
                data = s.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                open_.remove(s)
                with contextlib.suppress(OSError):
                    peers[s].shutdown(socket.SHUT_WR)
                continue
            try:
                peers[s].sendall(data)
            except OSError:
                return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, policy: Callable[[], RegistryPolicy]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.policy = policy
        self.refused: list[tuple[str, int, str]] = []
        self.allowed: list[tuple[str, int]] = []

    def open(self, host: str, port: int, *, plain: bool) -> socket.socket | None:
        """A connection to host:port if the policy permits it now, to the very address
        it checked; None (recorded and logged) otherwise."""
        policy = self.policy()
        ref = _target(host, port)
        try:
            if plain and not policy.plain_http(ref):
                raise errors.RegistryForbidden(str(ref), "plain HTTP", detail="not insecure")
            addresses = policy.addresses(ref)
        except errors.ImageError as exc:
            self.refused.append((host, port, exc.detail))
            log.warning("registry egress refused %s:%s: %s", host, port, exc.detail)
            return None
        last: OSError | None = None
        for address in addresses or [host]:
            try:
                conn = socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S)
            except OSError as exc:
                last = exc
                continue
            self.allowed.append((host, port))
            return conn
        self.refused.append((host, port, f"unreachable: {last}"))
        return None


class EgressProxy:
    """One per image store, started on first use; ``url`` for HTTPS_PROXY."""

    def __init__(self, policy: Callable[[], RegistryPolicy]) -> None:
        self._policy = policy
        self._server: _Server | None = None
        self._pid = 0
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        with self._lock:
            if self._server is not None and self._pid != os.getpid():
                # a forked child (Celery's prefork pool) inherits the socket, not the
                # thread serving it: a server of its own
                self._server = None
            if self._server is None:
                self._pid = os.getpid()
                self._server = _Server(self._policy)
                threading.Thread(
                    target=self._server.serve_forever, name="registry-egress-proxy", daemon=True
                ).start()
            address = cast(tuple[str, int], self._server.server_address)
            return f"http://{address[0]}:{address[1]}"

    @property
    def refused(self) -> list[tuple[str, int, str]]:
        return list(self._server.refused) if self._server else []

    @property
    def allowed(self) -> list[tuple[str, int]]:
        return list(self._server.allowed) if self._server else []

    def close(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                self._server = None
