"""HTTP/1.1 keep-alive server and request routing."""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import socket
import socketserver
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import parse_qs, unquote, urlsplit

from . import VERSION, archive, files, watch
from .body import BodyReader
from .errors import ApiError, bad_request
from .exec_api import ExecService, parse_exec, send_stdin
from .log import JsonLog
from .operations import Registry
from .state import sandbox_state

MAX_JSON_BODY = 8 * 1024 * 1024
MAX_WAIT_S = 600.0
_RESPONSE_REASONS = {
    200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
    404: "Not Found", 405: "Method Not Allowed", 409: "Conflict", 413: "Payload Too Large",
    429: "Too Many Requests", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable",
    505: "HTTP Version Not Supported", 507: "Insufficient Storage",
}  # fmt: skip


class AgentState:
    def __init__(
        self, token: str, base_env: Dict[str, str], shell: str, workdir: str, log: JsonLog,
        max_pty: int = 8,
    ) -> None:  # fmt: skip
        self.token = token.encode()
        self.base_env = base_env
        self.shell = shell
        self.workdir = workdir
        self.log = log
        self.registry = Registry()
        self.execs = ExecService(self.registry)
        self.watchers = watch.Watchers()
        self.started = time.monotonic()
        self.pty_slots = threading.BoundedSemaphore(max_pty)


class AgentServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def __init__(self, address: Tuple[str, int], state: AgentState) -> None:
        self.state = state
        super().__init__(address, Handler)

    def server_bind(self) -> None:
        """TCPServer's bind without HTTPServer's ``socket.getfqdn`` of our own address:
        a reverse lookup nothing reads, which loaded NSS modules and read /etc/hosts in
        every agent (~0.35 MiB of its memory, docs/benchmarks.md "Density")."""
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except RuntimeError as exc:
            # "can't start new thread": the sandbox's pids (or memory) are exhausted.
            # Answer typed on the accepting thread instead of dropping the connection
            # (which the control plane could only report as an unreachable agent).
            self.state.log.write("refused", error=str(exc))
            refuse_exhausted(request)
            self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A broken connection must not print tracebacks per request.
        self.state.log.write("connection_error", error=traceback.format_exc(limit=3))


def refuse_exhausted(sock: socket.socket) -> None:
    """503 ``resource_exhausted`` (kind ``pids``) written straight to a connection no
    thread could be started for. What the client already sent is read first (without
    blocking): closing over unread data would reset the connection before it reads us."""
    body = json.dumps(
        {
            "error": {
                "code": "resource_exhausted",
                "message": "the sandbox's process limit is reached: the agent cannot "
                "start a thread for this request",
                "field": None,
                "kind": "pids",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            for _ in range(16):
                if not sock.recv(65536):
                    break
        sock.setblocking(True)
        sock.settimeout(2)
        sock.sendall(head.encode() + body)
        sock.shutdown(socket.SHUT_WR)


Route = Callable[["Handler"], None]

MAX_HEADER_LINE = 65536
MAX_HEADERS = 100
_JSON = json.JSONEncoder(separators=(",", ":"))


class Headers:
    """Request headers by lower-cased name; the first of repeated names wins (as
    email.message.Message.get, which http.server would have used, returns it)."""

    __slots__ = ("_by_name",)

    def __init__(self) -> None:
        self._by_name: Dict[str, str] = {}

    def add(self, name: str, value: str) -> None:
        self._by_name.setdefault(name.lower(), value)

    def get(self, name: str, default: Any = None) -> Any:
        return self._by_name.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._by_name


class HeaderError(Exception):
    pass


def read_headers(rfile: Any) -> Headers:
    """The header block up to its empty line, with http.client's limits (line length,
    count). http.server hands it to email.parser, whose FeedParser was a quarter of the
    agent's own Python time per exec; an HTTP/1.1 request needs none of it."""
    headers = Headers()
    last = ""
    for _ in range(MAX_HEADERS + 1):
        line = rfile.readline(MAX_HEADER_LINE + 1)
        if len(line) > MAX_HEADER_LINE:
            raise HeaderError("Line too long")
        if line in (b"\r\n", b"\n", b""):
            return headers
        text = line.decode("iso-8859-1")
        if text[0] in " \t" and last:
            # obsolete line folding: a continuation of the previous header
            headers._by_name[last] += " " + text.strip()
            continue
        name, sep, value = text.partition(":")
        if not sep:
            continue  # not a header line; email.parser would have ignored it too
        last = name.lower()
        if last not in headers._by_name:
            headers._by_name[last] = value.strip(" \t\r\n")
        else:
            last = ""
    raise HeaderError("Too many headers")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Without TCP_NODELAY every keep-alive request stalls ~40 ms (Nagle + delayed ACK).
    disable_nagle_algorithm = True
    server_version = "hedgerow-podagent/" + VERSION
    timeout = 900  # idle keep-alive connections are dropped eventually
    server: AgentServer

    headers: Headers  # type: ignore[assignment]  # see parse_request
    raw_requestline: bytes
    request_id = ""
    query: Dict[str, List[str]] = {}
    body: Optional[BodyReader] = None
    status = 0
    upgraded = False

    # --- plumbing -----------------------------------------------------------
    def parse_request(self) -> bool:
        """http.server's parse_request (same checks, errors and keep-alive rules) with
        a lean header reader instead of email.parser."""
        self.command = None  # type: ignore[assignment]
        self.request_version = self.default_request_version
        self.close_connection = True
        requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        self.requestline = requestline
        words = requestline.split()
        if not words:
            return False
        if len(words) >= 3:
            version = words[-1]
            try:
                if not version.startswith("HTTP/"):
                    raise ValueError
                major, minor = version[5:].split(".")
                number = int(major), int(minor)
            except ValueError:
                self.send_error(400, f"Bad request version ({version!r})")
                return False
            if number >= (1, 1):
                self.close_connection = False
            if number >= (2, 0):
                self.send_error(505, f"Invalid HTTP version ({version[5:]})")
                return False
            self.request_version = version
        if not 2 <= len(words) <= 3:
            self.send_error(400, f"Bad request syntax ({requestline!r})")
            return False
        self.command, self.path = words[0], words[1]
        if len(words) == 2:
            self.close_connection = True
            if self.command != "GET":
                self.send_error(400, f"Bad HTTP/0.9 request type ({self.command!r})")
                return False
        if self.path.startswith("//"):
            self.path = "/" + self.path.lstrip("/")
        try:
            self.headers = read_headers(self.rfile)
        except HeaderError as exc:
            self.send_error(431, str(exc))
            return False
        conntype = self.headers.get("Connection", "").lower()
        if conntype == "close":
            self.close_connection = True
        elif conntype == "keep-alive":
            self.close_connection = False
        if (
            self.headers.get("Expect", "").lower() == "100-continue"
            and self.request_version >= "HTTP/1.1"
        ):
            return self.handle_expect_100()
        return True

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def send_error(
        self, code: int, message: Optional[str] = None, explain: Optional[str] = None
    ) -> None:
        # Called by http.server for malformed request lines/headers.
        self.close_connection = True
        err = ApiError(code, "bad_request" if code < 500 else "agent_error", message or "error")
        with contextlib.suppress(OSError):
            self.send_json(code, err.body())

    def send_json(self, status: int, obj: Any, extra: Optional[Dict[str, str]] = None) -> None:
        body = _JSON.encode(obj).encode()
        self.send_head(status, "application/json", len(body), extra, body)

    def send_head(
        self, status: int, ctype: str, length: Optional[int],
        extra: Optional[Dict[str, str]] = None, body: bytes = b"",
    ) -> None:  # fmt: skip
        """Write status line + headers (+ small body) in one send: one packet."""
        self.status = status
        lines = [
            f"HTTP/1.1 {status} {_RESPONSE_REASONS.get(status, 'Unknown')}",
            f"Content-Type: {ctype}",
        ]
        lines.append(
            "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
        )
        if self.request_id:
            lines.append(f"X-Request-Id: {self.request_id}")
        if self.body is not None and not self.body.finished:
            self._drain_unread_body()
        if self.body is not None and not self.body.finished:
            # An unread request body would be parsed as the next request.
            self.close_connection = True
        if self.close_connection:
            lines.append("Connection: close")
        for key, value in (extra or {}).items():
            lines.append(f"{key}: {value}")
        self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)

    def _drain_unread_body(self, budget: int = 8 << 20, timeout: float = 2.0) -> None:
        """Reads and discards (bounded) what the client is still sending before we answer
        early (413, 401): a client that writes its whole body before reading would
        otherwise get a broken pipe instead of our error."""
        body = self.body
        assert body is not None
        previous = self.connection.gettimeout()
        try:
            self.connection.settimeout(timeout)
            while budget > 0 and not body.finished:
                chunk = body.read(min(65536, budget))
                if not chunk:
                    break
                budget -= len(chunk)
        except Exception:  # noqa: BLE001, S110 - best effort; the connection closes anyway
            pass
        finally:
            try:
                self.connection.settimeout(previous)
            except OSError:
                pass

    def write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_chunks(self) -> None:
        self.wfile.write(b"0\r\n\r\n")

    def read_json(self) -> Any:
        assert self.body is not None
        raw = self.body.read_all(MAX_JSON_BODY)
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise bad_request(f"malformed JSON: {exc}") from None

    def param(self, name: str) -> Optional[str]:
        values = self.query.get(name)
        return values[0] if values else None

    # --- dispatch -----------------------------------------------------------
    def do_GET(self) -> None:
        self.dispatch("GET")

    def do_POST(self) -> None:
        self.dispatch("POST")

    def do_PUT(self) -> None:
        self.dispatch("PUT")

    def do_DELETE(self) -> None:
        self.dispatch("DELETE")

    def do_PATCH(self) -> None:
        self.dispatch("PATCH")

    def do_HEAD(self) -> None:
        self.dispatch("HEAD")

    def do_OPTIONS(self) -> None:
        self.dispatch("OPTIONS")

    def dispatch(self, method: str) -> None:
        t0 = time.monotonic()
        self.status = 0
        self.upgraded = False
        rid = self.headers.get("X-Request-Id", "")
        self.request_id = "".join(c for c in rid[:128] if c.isprintable() and c not in "\r\n")
        state = self.server.state
        try:
            self.body = self._body_reader()
            if self.path[:1] != "/" or "?" in self.path or "%" in self.path or "#" in self.path:
                split = urlsplit(self.path)
                path = unquote(split.path)
                self.query = parse_qs(split.query)
            else:  # the common case (/exec, /health), without urllib's work
                path = self.path
                self.query = {}
            routes = self.routes_for(path)
            if routes is None:
                raise ApiError(404, "not_found", f"no route for {path}")
            handler = routes.get(method)
            if handler is None:
                raise ApiError(405, "method_not_allowed", f"{method} not allowed on {path}")
            if path != "/health":
                self.check_token()
            handler(self)
        except ApiError as exc:
            if self.status:
                self.close_connection = True
            else:
                extra = {"Allow": ", ".join(sorted(self._allowed()))} if exc.status == 405 else None
                self.send_json(exc.status, exc.body(), extra)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the agent
            state.log.write("error", request_id=self.request_id, error=traceback.format_exc())
            if self.status:
                self.close_connection = True
            elif isinstance(exc, RuntimeError) and "new thread" in str(exc):
                # a PTY's pump thread: the sandbox's pids are exhausted, typed
                body = ApiError(503, "resource_exhausted", str(exc)).body()
                body["error"]["kind"] = "pids"
                self.send_json(503, body, {"Retry-After": "1"})
            else:
                self.send_json(500, ApiError(500, "agent_error", repr(exc)).body())
        finally:
            if state.log.enabled:
                state.log.write(
                    "request", request_id=self.request_id, method=method,
                    path=self.path.split("?", 1)[0], status=self.status,
                    ms=round((time.monotonic() - t0) * 1000, 3),
                )  # fmt: skip

    def _allowed(self) -> List[str]:
        routes = self.routes_for(unquote(urlsplit(self.path).path))
        return list(routes or {})

    def _body_reader(self) -> BodyReader:
        te = self.headers.get("Transfer-Encoding", "").lower()
        raw_len = self.headers.get("Content-Length")
        length: Optional[int] = None
        if raw_len is not None:
            try:
                length = int(raw_len)
            except ValueError:
                length = -1
            if length < 0:
                self.close_connection = True
                raise bad_request("invalid Content-Length")
        return BodyReader(self.rfile, length, "chunked" in te)  # type: ignore[arg-type]

    def check_token(self) -> None:
        header = self.headers.get("Authorization", "")
        token = header[7:].strip().encode() if header[:7].lower() == "bearer " else b""
        if not hmac.compare_digest(token, self.server.state.token):
            raise ApiError(401, "unauthorized", "missing or invalid bearer token")

    def routes_for(self, path: str) -> Optional[Dict[str, Route]]:
        exact = ROUTES.get(path)
        if exact is not None:
            return exact
        if path.startswith("/operations/"):
            rest = path[len("/operations/") :]
            if rest.endswith("/cancel") and "/" not in rest[: -len("/cancel")]:
                return {"POST": Handler.op_cancel}
            if rest.endswith("/stdin") and "/" not in rest[: -len("/stdin")]:
                return {"POST": Handler.op_stdin}
            if rest and "/" not in rest:
                return {"GET": Handler.op_get}
        if path.startswith("/watchers/") and "/" not in path[len("/watchers/") :]:
            return {"GET": Handler.watcher_events, "DELETE": Handler.watcher_delete}
        return None

    def op_id_from_path(self) -> str:
        rest = unquote(urlsplit(self.path).path)[len("/operations/") :]
        for suffix in ("/cancel", "/stdin"):
            if rest.endswith(suffix):
                return rest[: -len(suffix)]
        return rest

    # --- endpoints ----------------------------------------------------------
    def health(self) -> None:
        state = self.server.state
        self.send_json(200, {
            "status": "ok", "version": VERSION, "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - state.started, 3),
            "running_ops": state.registry.running(),
        })  # fmt: skip

    def state_get(self) -> None:
        """Listening ports, processes and environment (podagent/state.py): part of a
        snapshot's fingerprint."""
        own_port = self.server.server_address[1] if self.server.server_address else None
        self.send_json(200, sandbox_state(own_port, self.server.state.base_env))

    def exec_(self) -> None:
        state = self.server.state
        req = parse_exec(self.read_json(), state.base_env, state.shell, state.workdir)
        op, created = state.execs.claim(req)

        def log_exec() -> None:
            # written once the command was spawned, while it loads: off the latency path
            state.log.write("exec", request_id=self.request_id, op=op.op_id, stream=req.stream)

        if req.stream:
            self.send_head(200, "application/x-ndjson", None)
            if created:
                state.execs.execute(op, req, self.write_chunk, log_exec)
            else:
                state.execs.stream_attached(op, self.write_chunk)
            self.end_chunks()
            return
        if created:
            result = state.execs.execute(op, req, None, log_exec)
        else:
            stored = op.wait(None)
            assert stored is not None
            result = dict(stored, replayed=True)
        self.send_json(200, result)

    def op_get(self) -> None:
        op = self.server.state.registry.get(self.op_id_from_path())
        if op is None:
            raise ApiError(404, "not_found", "unknown operation")
        try:
            wait = min(float(self.param("wait") or 0), MAX_WAIT_S)
        except ValueError:
            raise bad_request("wait must be a number", "wait") from None
        result = op.wait(max(wait, 0.0))
        if result is None:
            self.send_json(200, {"operation_id": op.op_id, "status": "running"})
        else:
            self.send_json(200, result)

    def op_cancel(self) -> None:
        op = self.server.state.registry.get(self.op_id_from_path())
        if op is None:
            raise ApiError(404, "not_found", "unknown operation")
        if op.result is None:
            op.control.cancel(op.kill_grace, op.done)
        result = op.wait(op.kill_grace + 5.0)
        if result is None:
            self.send_json(200, {"operation_id": op.op_id, "status": "running"})
        else:
            self.send_json(200, result)

    def watcher_create(self) -> None:
        path = files.check_path(self.param("path"))
        recursive = self.param("recursive") in ("1", "true")
        include_entry = self.param("include_entry") in ("1", "true")
        watcher = self.server.state.watchers.create(path, recursive, include_entry)
        self.send_json(200, watch.describe(watcher))

    def _watcher_id(self) -> str:
        return unquote(urlsplit(self.path).path)[len("/watchers/") :]

    def watcher_events(self) -> None:
        watcher = self.server.state.watchers.get(self._watcher_id())
        events = watcher.events(watch.parse_wait(self.param("wait")))
        self.send_json(200, {"watcher_id": watcher.id, "events": events})

    def watcher_delete(self) -> None:
        self.server.state.watchers.remove(self._watcher_id())
        self.send_json(200, {"watcher_id": self._watcher_id(), "deleted": True})

    def op_stdin(self) -> None:
        op = self.server.state.registry.get(self.op_id_from_path())
        if op is None:
            raise ApiError(404, "not_found", "unknown operation")
        self.send_json(200, send_stdin(op, self.read_json()))

    def file_put(self) -> None:
        path = files.check_path(self.param("path"))
        mode = files.parse_mode(self.param("mode"))
        limit = files.DEFAULT_MAX_BYTES
        raw_max = self.param("max_bytes")
        if raw_max is not None:
            try:
                limit = min(int(raw_max), limit)
            except ValueError:
                raise bad_request("max_bytes must be an integer", "max_bytes") from None
        assert self.body is not None
        if self.body.length is not None and self.body.length > limit:
            raise files.TooLarge(limit)
        self.send_json(200, files.write_file(path, self.body.read, mode, limit))

    def file_get(self) -> None:
        path = files.check_path(self.param("path"))
        fh, size = files.open_for_read(path)
        with fh:
            self.send_head(200, "application/octet-stream", size)
            sent = self.connection.sendfile(fh, 0, size) if size else 0
            if sent != size:
                self.close_connection = True  # file shrank: the framing is broken

    def archive_get(self) -> None:
        """The directory ``path`` as one streamed tar (chunked). ``X-Tree-Bytes`` is the
        total of its regular files, from the walk made before the first byte."""
        members, total = archive.tree_members(files.check_path(self.param("path")))
        self.send_head(200, "application/x-tar", None, {"X-Tree-Bytes": str(total)})
        # A failure from here on breaks the connection (dispatch: headers are out), so
        # the client sees a truncated body, never a short archive ending as if complete.
        archive.write_tree(members, self.write_chunk)
        self.end_chunks()

    def archive_put(self) -> None:
        path = files.check_path(self.param("path"))
        limit = files.DEFAULT_MAX_BYTES
        raw_max = self.param("max_bytes")
        if raw_max is not None:
            try:
                limit = min(int(raw_max), limit)
            except ValueError:
                raise bad_request("max_bytes must be an integer", "max_bytes") from None
        assert self.body is not None
        if self.body.length is not None and self.body.length > limit:
            raise files.TooLarge(limit)
        self.send_json(200, archive.extract_tree(path, self.body.read, limit))

    def file_delete(self) -> None:
        path = files.check_path(self.param("path"))
        recursive = (self.param("recursive") or "").lower() in ("1", "true", "yes")
        self.send_json(200, files.delete_path(path, recursive))

    def file_mkdir(self) -> None:
        self.send_json(200, files.make_dir(files.check_path(self.param("path"))))

    def file_rename(self) -> None:
        source = files.check_path(self.param("path"))
        destination = self.param("to")
        try:
            target = files.check_path(destination)
        except ApiError as exc:
            raise ApiError(exc.status, exc.code, exc.message.replace("path", "to"), "to") from None
        self.send_json(200, files.rename_path(source, target))

    def file_list(self) -> None:
        limit = files.parse_limit(self.param("limit"))
        after = self.param("after") or None
        self.send_json(200, files.list_dir(files.check_path(self.param("path")), limit, after))

    def file_stat(self) -> None:
        self.send_json(200, files.stat_path(files.check_path(self.param("path"))))

    def pty(self) -> None:
        from .pty_session import serve_pty

        serve_pty(self)


ROUTES: Dict[str, Dict[str, Route]] = {
    "/health": {"GET": Handler.health},
    "/exec": {"POST": Handler.exec_},
    "/files": {"GET": Handler.file_get, "PUT": Handler.file_put, "DELETE": Handler.file_delete},
    "/files/list": {"GET": Handler.file_list},
    "/files/archive": {"GET": Handler.archive_get, "PUT": Handler.archive_put},
    "/files/mkdir": {"POST": Handler.file_mkdir},
    "/files/rename": {"POST": Handler.file_rename},
    "/files/stat": {"GET": Handler.file_stat},
    "/pty": {"POST": Handler.pty},
    "/state": {"GET": Handler.state_get},
    "/watchers": {"POST": Handler.watcher_create},
}
