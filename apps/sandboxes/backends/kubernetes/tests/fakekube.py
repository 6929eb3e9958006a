"""A FAKE Kubernetes API server, in-process, for tests only.

It speaks the real HTTP/JSON protocol for exactly the endpoints the backend uses —
create/get/delete/list/deletecollection of pods, secrets and network policies in a
namespace, and WATCH on pods (chunked event lines, resourceVersion resume, bookmarks,
``410 Gone`` as an ERROR event after compaction) — so the official ``kubernetes``
client runs unmodified against it. It is not a cluster: nothing is scheduled and no
container runs. Tests play the kubelet through ``set_pod_status`` (or ``auto_start``).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

_PATHS = [
    (re.compile(r"^/api/v1/namespaces/([^/]+)/(pods|secrets)(?:/([^/]+))?$"), "v1"),
    (
        re.compile(
            r"^/apis/networking\.k8s\.io/v1/namespaces/([^/]+)/(networkpolicies)(?:/([^/]+))?$"
        ),
        "networking.k8s.io/v1",
    ),
]
_KIND = {"pods": "Pod", "secrets": "Secret", "networkpolicies": "NetworkPolicy"}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure" if code >= 400 else "Success",
        "message": message,
        "reason": reason,
        "code": code,
    }


def matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k.rstrip("=")) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def is_watch(query: dict[str, list[str]]) -> bool:
    return query.get("watch", ["false"])[0].lower() in ("true", "1")


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.history: list[tuple[int, str, str, str, dict[str, Any]]] = []
        self.rv = 100
        self.compacted_rv = 0
        self.expiry = 0  # bumped to end every open watch with 410
        self.cond = threading.Condition()
        self.requests: list[tuple[str, str, dict[str, list[str]]]] = []
        self.failures: list[int] = []  # statuses to answer the next requests with
        self.auto_start = False  # play a kubelet that starts every pod at once
        self.graceful_pods = False  # pods linger with a deletionTimestamp when deleted
        # An older API server: pod spec fields it does not know (fieldValidation=Strict
        # → 400 "unknown field", else dropped), and fields it knows behind a feature
        # gate that is off (dropped silently, whatever the validation mode).
        self.unknown_pod_fields: set[str] = set()
        self.gated_pod_fields: set[str] = set()
        self._ip = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FakeKube:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self.expiry += 1
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()

    # ---- store (under self.cond) --------------------------------------------------

    def _record(self, resource: str, ns: str, kind: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append((self.rv, resource, ns, kind, copy.deepcopy(obj)))
        self.cond.notify_all()

    def create(
        self, resource: str, ns: str, body: dict[str, Any], validation: str = ""
    ) -> tuple[int, dict[str, Any]]:
        with self.cond:
            name = body["metadata"]["name"]
            if (resource, ns, name) in self.objects:
                return 409, status(409, "AlreadyExists", f'{resource} "{name}" already exists')
            obj = copy.deepcopy(body)
            if resource == "pods":
                unknown = sorted(self.unknown_pod_fields & set(obj["spec"]))
                if unknown and validation == "Strict":
                    fields = ", ".join(f'unknown field "spec.{f}"' for f in unknown)
                    message = (
                        'Pod in version "v1" cannot be handled as a Pod: '
                        f"strict decoding error: {fields}"
                    )
                    return 400, status(400, "BadRequest", message)
                for dropped in unknown + sorted(self.gated_pod_fields & set(obj["spec"])):
                    del obj["spec"][dropped]
            meta = obj["metadata"]
            meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
            if resource == "pods":
                obj["status"] = {"phase": "Pending"}
            self.objects[(resource, ns, name)] = obj
            self._record(resource, ns, "ADDED", obj)
            if resource == "pods" and self.auto_start:
                self._start_pod(ns, name)
            return 201, copy.deepcopy(obj)

    def delete(self, resource: str, ns: str, name: str) -> dict[str, Any] | None:
        with self.cond:
            obj = self.objects.get((resource, ns, name))
            if obj is None:
                return None
            if resource == "pods" and self.graceful_pods:
                if not obj["metadata"].get("deletionTimestamp"):
                    obj["metadata"]["deletionTimestamp"] = _now()
                    self._record(resource, ns, "MODIFIED", obj)
                return copy.deepcopy(obj)
            del self.objects[(resource, ns, name)]
            self._record(resource, ns, "DELETED", obj)
            return copy.deepcopy(obj)

    def listing(self, resource: str, ns: str, selector: str) -> list[dict[str, Any]]:
        with self.cond:
            return [
                copy.deepcopy(o)
                for (r, n, _), o in sorted(self.objects.items())
                if r == resource and n == ns and matches(selector, o["metadata"].get("labels", {}))
            ]

    # ---- test controls: the kubelet, the scheduler, etcd compaction ---------------

    def _start_pod(self, ns: str, name: str) -> None:
        self._ip += 1
        self.set_pod_status(ns, name, phase="Running", pod_ip=f"10.42.0.{self._ip}", running=True)

    def set_pod_status(
        self,
        ns: str,
        name: str,
        *,
        phase: str,
        pod_ip: str = "",
        node: str = "node-a",
        running: bool = False,
        ready: bool = False,
        waiting_reason: str = "",
        waiting_message: str = "fake kubelet",
        image_id: str = "",
        exit_code: int | None = None,
        unschedulable: str = "",
    ) -> None:
        """What the kubelet (or scheduler) would write: phase, IP, container states."""
        with self.cond:
            obj = self.objects[("pods", ns, name)]
            state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
            if running:
                state = {"running": {"startedAt": _now()}}
            if waiting_reason:
                state = {"waiting": {"reason": waiting_reason, "message": waiting_message}}
            if exit_code is not None:
                state = {"terminated": {"exitCode": exit_code, "reason": "Error"}}
            obj["spec"]["nodeName"] = node if not unschedulable else None
            conditions = []
            if unschedulable:
                conditions.append(
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": unschedulable,
                    }
                )
            obj["status"] = {
                "phase": phase,
                "podIP": pod_ip or None,
                "conditions": conditions,
                "containerStatuses": [
                    {
                        "name": "sandbox",
                        "ready": ready,
                        "restartCount": 0,
                        "image": obj["spec"]["containers"][0]["image"],
                        "imageID": image_id,
                        "state": state,
                    }
                ],
            }
            self._record("pods", ns, "MODIFIED", obj)

    def compact(self) -> None:
        """Every resourceVersion seen so far becomes too old; open watches get 410."""
        with self.cond:
            self.compacted_rv = self.rv
            self.history.clear()
            self.expiry += 1
            self.cond.notify_all()

    def vanish(self, resource: str, ns: str, name: str) -> None:
        """The object disappears and the event is lost (deleted, then compacted away)."""
        with self.cond:
            self.objects.pop((resource, ns, name), None)
            self.rv += 1
        self.compact()

    def fail_next(self, *codes: int) -> None:
        with self.cond:
            self.failures.extend(codes)

    def watch_queries(self) -> list[dict[str, list[str]]]:
        with self.cond:
            return [q for m, _, q in self.requests if m == "GET" and is_watch(q)]

    def count(self, method: str, path_part: str, **query: str) -> int:
        with self.cond:
            return sum(
                1
                for m, p, q in self.requests
                if m == method
                and path_part in p
                and all(str(q.get(k, [None])[0]).lower() == v.lower() for k, v in query.items())
            )


def _handler(kube: FakeKube) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(
            self, code: int, body: dict[str, Any], headers: dict[str, str] | None = None
        ) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str) -> None:
            url = urlparse(self.path)
            query = parse_qs(url.query)
            with kube.cond:
                kube.requests.append((method, url.path, query))
                failure = kube.failures.pop(0) if kube.failures else None
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            if failure is not None:
                self._send(
                    failure, status(failure, "ServiceUnavailable", "fake"), {"Retry-After": "0"}
                )
                return
            for pattern, api_version in _PATHS:
                m = pattern.match(url.path)
                if m:
                    ns, resource, name = m.groups()
                    self._dispatch(method, api_version, resource, ns, name, query, body)
                    return
            self._send(404, status(404, "NotFound", f"no route {url.path}"))

        def _dispatch(
            self,
            method: str,
            api_version: str,
            resource: str,
            ns: str,
            name: str | None,
            query: dict[str, list[str]],
            body: Any,
        ) -> None:
            selector = query.get("labelSelector", [""])[0]
            kind = _KIND[resource]
            if name is None and method == "GET":
                if query.get("watch", ["false"])[0].lower() in ("true", "1"):
                    self._watch(resource, ns, selector, query)
                    return
                items = kube.listing(resource, ns, selector)
                for item in items:
                    item.setdefault("kind", kind)
                    item.setdefault("apiVersion", api_version)
                self._send(
                    200,
                    {
                        "kind": f"{kind}List",
                        "apiVersion": api_version,
                        "metadata": {"resourceVersion": str(kube.rv)},
                        "items": items,
                    },
                )
            elif name is None and method == "POST":
                validation = query.get("fieldValidation", [""])[0]
                code, obj = kube.create(resource, ns, body, validation)
                self._send(code, obj)
            elif name is None and method == "DELETE":
                for item in kube.listing(resource, ns, selector):
                    kube.delete(resource, ns, item["metadata"]["name"])
                self._send(200, status(200, "", "deleted"))
            elif method == "GET":
                found = [o for o in kube.listing(resource, ns, "") if o["metadata"]["name"] == name]
                if not found:
                    self._send(404, status(404, "NotFound", f'{resource} "{name}" not found'))
                else:
                    self._send(200, found[0])
            elif method == "DELETE":
                deleted = kube.delete(resource, ns, name or "")
                if deleted is None:
                    self._send(404, status(404, "NotFound", f'{resource} "{name}" not found'))
                elif resource == "pods":
                    self._send(200, deleted)
                else:
                    self._send(200, status(200, "", "deleted"))
            else:
                self._send(405, status(405, "MethodNotAllowed", method))

        def _watch(
            self, resource: str, ns: str, selector: str, query: dict[str, list[str]]
        ) -> None:
            since = int(query.get("resourceVersion", ["0"])[0] or 0)
            timeout = float(query.get("timeoutSeconds", ["30"])[0])
            bookmarks = query.get("allowWatchBookmarks", ["false"])[0].lower() == "true"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def line(event: dict[str, Any]) -> None:
                data = json.dumps(event).encode() + b"\n"
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            deadline = time.monotonic() + timeout
            with kube.cond:
                expiry = kube.expiry
                expired = since and since < kube.compacted_rv
            try:
                if expired:
                    line(
                        {
                            "type": "ERROR",
                            "object": status(410, "Expired", "too old resource version"),
                        }
                    )
                    return
                cursor = since
                while True:
                    with kube.cond:
                        pending = [h for h in kube.history if h[0] > cursor]
                        if not pending and kube.expiry == expiry:
                            remaining = deadline - time.monotonic()
                            if remaining <= 0:
                                break
                            kube.cond.wait(min(remaining, 0.5))
                            pending = [h for h in kube.history if h[0] > cursor]
                        gone = kube.expiry != expiry
                        current = kube.rv
                    for rv, r, n, kind, obj in pending:
                        cursor = rv
                        if (
                            r == resource
                            and n == ns
                            and matches(selector, obj["metadata"].get("labels", {}))
                        ):
                            obj = dict(obj, kind=_KIND[r], apiVersion="v1")
                            line({"type": kind, "object": obj})
                    if gone:
                        line({"type": "ERROR", "object": status(410, "Expired", "watch expired")})
                        return
                    if bookmarks and not pending and current > cursor:
                        cursor = current
                        line(
                            {
                                "type": "BOOKMARK",
                                "object": {
                                    "kind": _KIND[resource],
                                    "apiVersion": "v1",
                                    "metadata": {"resourceVersion": str(current)},
                                },
                            }
                        )
                    if time.monotonic() >= deadline:
                        break
            finally:
                try:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except OSError:
                    pass

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        def do_DELETE(self) -> None:
            self._route("DELETE")

    return Handler
