"""A FAKE Kubernetes API server, in-process, for tests only.

It speaks the real HTTP/JSON protocol for the endpoints the backend uses, with the
API server's behaviour where the backend depends on it, so the official ``kubernetes``
client runs unmodified against it:

* create/get/list/delete/deletecollection/PATCH/PUT of pods, secrets and network
  policies in a namespace, and of CiliumNetworkPolicies (``cilium.io/v2``, stored as
  sent: no CRD schema); ``409 AlreadyExists``; strict field validation of pod specs
  (``unknown_pod_fields``, ``gated_pod_fields`` play older servers);
* LIST with ``limit``/``continue`` pagination (``metadata.continue``,
  ``remainingItemCount``; a continue token older than the compaction is ``410
  Expired``, as a Status), label selectors and field selectors (``metadata.name``,
  ``metadata.namespace``, ``spec.nodeName``, ``status.phase``, ``status.podIP``;
  ``=``, ``==``, ``!=``);
* the metadata-only listing (``Accept: …;as=PartialObjectMetadataList;g=meta.k8s.io``):
  items without ``data``/``spec``/``status``;
* PATCH: server-side apply (``application/apply-patch+yaml``: creates when absent,
  merges maps, replaces lists and scalars; ``fieldManager`` required; ``409`` when the
  object was written by another manager and ``force`` is not set), JSON merge patch and
  strategic merge patch (treated as a JSON merge patch);
* the garbage collector: an object whose ``ownerReferences`` name a deleted object's
  uid is deleted once its owner is gone (background propagation);
* deletions that complete: a pod deleted with a grace period keeps a
  ``deletionTimestamp`` (and ``deletionGracePeriodSeconds``) until "the kubelet"
  confirms after the grace period — never when its node is in ``dead_nodes`` (node
  lost); ``gracePeriodSeconds=0`` removes it at once (force deletion); any object with
  ``metadata.finalizers`` stays until a PATCH empties them;
* WATCH on pods: chunked event lines, label and field selectors, resume from a
  resourceVersion, bookmarks every ``bookmark_interval_s`` and once shortly before the
  watch's own timeout (as the API server's watch cache does), ``410 Gone`` after
  compaction as an ERROR event, or as the response's HTTP status with
  ``gone_as_status``;
* RBAC: ``grants`` maps a bearer token to the (group, resource, verb) its Roles
  grant; a request with that token for anything else is a ``403 Forbidden`` (the
  backend's tests run as the worker's ServiceAccount, conftest.py), namespaces and
  resourceNames aside;
* SelfSubjectAccessReview (``POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews``):
  allowed or not from the same ``grants`` (any token may ask, as ``system:basic-user``
  lets every authenticated user); ``access_reviews`` records what was asked;
* faults: ``fail_next`` (answer the next requests with these statuses,
  ``Retry-After: <retry_after>``, 0 unless set) and ``stall_next`` (hold the next
  requests this long before answering: request timeouts), ``stall_open_watches``
  (the watches open now deliver nothing more, not even bookmarks, until their timeout:
  a dead connection, a stalled informer; new watches work);
* persistent volume claims and ``snapshot.storage.k8s.io/v1`` VolumeSnapshots (CRUD as
  above) with a FAKE CSI snapshot controller and provisioner, nothing of a real
  driver: a VolumeSnapshot of an existing claim becomes ``readyToUse`` (with
  ``boundVolumeSnapshotContentName`` and the claim's size as ``restoreSize``) once it
  was read ``snapshot_ready_after_reads`` times, never (``snapshot_mode = "never"``),
  or gets ``status.error`` (``"error"``, or a source claim that does not exist); a
  claim is ``Bound`` at once, or, with a VolumeSnapshot as ``dataSource``, only when
  that snapshot exists and is ready (else ``Pending``). No data is copied: there is
  none;
* pod status: ``set_pod_status`` (phase, IP and ``podIPs``, container and init
  container states, conditions ``PodScheduled``/``Ready``) and ``load_status`` (the
  status of a real pod, from the JSON fixtures in ``fixtures/pods``).

What it does not model (verified only on a real cluster, docs/deploy-kubernetes.md):
scheduling, containers, the kubelet's own status transitions (tests write them),
admission (Pod Security, ValidatingAdmissionPolicy), RBAC beyond the verbs above,
NetworkPolicy enforcement, API Priority and Fairness, a consistent snapshot across
``continue`` pages (a page reads the current state), field ownership beyond "who wrote
last" (server-side apply does not remove fields an applier stopped sending), strategic
merge keys, and schema validation of anything but the pod spec's top-level fields.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import threading
import time
import uuid
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "pods"

_PATHS = [
    (
        re.compile(
            r"^/api/v1/namespaces/([^/]+)/(pods|secrets|persistentvolumeclaims)(?:/([^/]+))?$"
        ),
        "v1",
    ),
    (
        re.compile(
            r"^/apis/snapshot\.storage\.k8s\.io/v1/namespaces/([^/]+)/(volumesnapshots)"
            r"(?:/([^/]+))?$"
        ),
        "snapshot.storage.k8s.io/v1",
    ),
    (
        re.compile(
            r"^/apis/networking\.k8s\.io/v1/namespaces/([^/]+)/(networkpolicies)(?:/([^/]+))?$"
        ),
        "networking.k8s.io/v1",
    ),
    (
        re.compile(
            r"^/apis/cilium\.io/v2/namespaces/([^/]+)/(ciliumnetworkpolicies)(?:/([^/]+))?$"
        ),
        "cilium.io/v2",
    ),
]
_KIND = {
    "pods": "Pod",
    "secrets": "Secret",
    "networkpolicies": "NetworkPolicy",
    "ciliumnetworkpolicies": "CiliumNetworkPolicy",
    "persistentvolumeclaims": "PersistentVolumeClaim",
    "volumesnapshots": "VolumeSnapshot",
}
_API_VERSION = {
    "pods": "v1",
    "secrets": "v1",
    "networkpolicies": "networking.k8s.io/v1",
    "ciliumnetworkpolicies": "cilium.io/v2",
    "persistentvolumeclaims": "v1",
    "volumesnapshots": "snapshot.storage.k8s.io/v1",
}
_FIELDS = {
    "metadata.name": lambda o: o["metadata"].get("name"),
    "metadata.namespace": lambda o: o["metadata"].get("namespace"),
    "spec.nodeName": lambda o: (o.get("spec") or {}).get("nodeName") or "",
    "status.phase": lambda o: (o.get("status") or {}).get("phase") or "",
    "status.podIP": lambda o: (o.get("status") or {}).get("podIP") or "",
}
METADATA_ONLY = "as=PartialObjectMetadataList"


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


class FieldSelectorError(ValueError):
    pass


def field_matches(selector: str, obj: dict[str, Any]) -> bool:
    """The API server's field selectors for the fields pods support."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        key, _, value = term.partition("!=" if negate else "=")
        key, value = key.strip(), value.lstrip("=").strip()
        if key not in _FIELDS:
            raise FieldSelectorError(f'"{key}" is not a known field selector')
        if (str(_FIELDS[key](obj)) == value) == negate:
            return False
    return True


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: maps merge, ``null`` removes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


_VERB_PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/v\d+)/namespaces/[^/]+/(?P<resource>[^/]+)"
    r"(?:/(?P<name>[^/]+))?$"
)


SELF_SUBJECT_ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"


def request_verb(method: str, path: str, query: dict[str, list[str]]) -> tuple[str, str, str]:
    """(api group, resource, verb) of a request, as the API server's authorizer sees it."""
    m = _VERB_PATH.match(path)
    if m is None:
        return "", path, method.lower()
    group, resource, name = m["group"] or "", m["resource"], m["name"]
    if method == "GET":
        verb = "get" if name else ("watch" if is_watch(query) else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update"}.get(method, method.lower())
    return group, resource, verb


def is_watch(query: dict[str, list[str]]) -> bool:
    return query.get("watch", ["false"])[0].lower() in ("true", "1")


def load_fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return data


class ApiStatusError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.history: list[tuple[int, str, str, str, dict[str, Any]]] = []
        self.rv = 100
        self.compacted_rv = 0
        self.expiry = 0  # bumped to end every open watch with 410
        self.cond = threading.Condition()
        self.requests: list[tuple[str, str, dict[str, list[str]]]] = []
        self.accepts: list[tuple[str, str, str]] = []  # (method, path, Accept header)
        self.failures: list[int] = []  # statuses to answer the next requests with
        self.retry_after = "0"  # the Retry-After header of those answers
        self.stalls: list[float] = []  # seconds to hold the next requests
        self.auto_start = False  # play a kubelet that starts every pod at once
        # Pods honour their grace period: deleted, they keep a deletionTimestamp until
        # the kubelet confirms (after the grace period; never on a node in dead_nodes).
        self.graceful_pods = False
        self.dead_nodes: set[str] = set()
        self.gone_as_status = False  # a too old watch is an HTTP 410, not an ERROR event
        self.stall_epoch = 0  # watches opened before it deliver nothing (dead connections)
        self.bookmark_interval_s = 60.0
        # An older API server: pod spec fields it does not know (fieldValidation=Strict
        # → 400 "unknown field", else dropped), and fields it knows behind a feature
        # gate that is off (dropped silently, whatever the validation mode).
        self.unknown_pod_fields: set[str] = set()
        # RBAC: bearer token → the (api group, resource, verb) its Roles grant; a
        # request with a listed token and a verb not granted is answered 403 like the
        # API server's authorizer. Tokens not listed are unrestricted (the test itself).
        self.grants: dict[str, set[tuple[str, str, str]]] = {}
        self.forbidden: list[tuple[str, str, str, str]] = []  # (token, group, resource, verb)
        self.access_reviews: list[tuple[str, dict[str, Any]]] = []  # (token, review asked)
        self.gated_pod_fields: set[str] = set()
        # the FAKE CSI snapshot controller: "ready" (after that many reads), "never",
        # or "error" (status.error with snapshot_error)
        self.snapshot_mode = "ready"
        self.snapshot_ready_after_reads = 2
        self.snapshot_error = "rpc error: code = Internal desc = fake driver refused"
        self._snapshot_reads: dict[tuple[str, str], int] = {}
        self._ip = 0
        self._confirmed: set[tuple[str, str, str]] = set()  # terminations the kubelet saw
        self._timers: list[threading.Timer] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def access_review(self, token: str, body: dict[str, Any]) -> dict[str, Any]:
        """A SelfSubjectAccessReview answered from ``grants`` (tokens not listed are
        unrestricted), as the API server answers from the Roles it enforces."""
        with self.cond:
            self.access_reviews.append((token, body))
        attributes = (body.get("spec") or {}).get("resourceAttributes") or {}
        asked = (
            attributes.get("group") or "",
            attributes.get("resource") or "",
            attributes.get("verb") or "",
        )
        allowed = token not in self.grants or asked in self.grants[token]
        answer: dict[str, Any] = {"allowed": allowed}
        if allowed and token in self.grants:
            answer["reason"] = "RBAC: allowed by RoleBinding"
        return {
            "kind": "SelfSubjectAccessReview",
            "apiVersion": "authorization.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": body.get("spec") or {},
            "status": answer,
        }

    def start(self) -> FakeKube:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self.expiry += 1
            self.cond.notify_all()
            for timer in self._timers:
                timer.cancel()
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
            meta.setdefault("generation", 1)
            obj.setdefault("kind", _KIND[resource])
            obj.setdefault("apiVersion", _API_VERSION[resource])
            meta["managedFields"] = [{"manager": "create", "operation": "Update"}]
            if resource == "pods":
                obj["status"] = {"phase": "Pending"}
            if resource == "volumesnapshots":
                obj["status"] = {"readyToUse": False}
            if resource == "persistentvolumeclaims":
                obj["status"] = {"phase": self._claim_phase(ns, obj)}
            self.objects[(resource, ns, name)] = obj
            self._record(resource, ns, "ADDED", obj)
            if resource == "pods" and self.auto_start:
                self._start_pod(ns, name)
            return 201, copy.deepcopy(obj)

    def delete(
        self, resource: str, ns: str, name: str, grace_s: int | None = None
    ) -> dict[str, Any] | None:
        """Marks the object deleted; it is removed once nothing holds it (finalizers,
        a pod's kubelet not yet confirming). Returns the object as it stands."""
        key = (resource, ns, name)
        with self.cond:
            obj = self.objects.get(key)
            if obj is None:
                return None
            meta = obj["metadata"]
            graceful = resource == "pods" and self.graceful_pods
            grace = 30 if grace_s is None else grace_s  # the pod default
            if not graceful or grace == 0:
                self._confirmed.add(key)  # nothing to wait for (or forced)
            if meta.get("deletionTimestamp"):
                self._finish(key)
                return copy.deepcopy(self.objects.get(key, obj))
            if not graceful and not meta.get("finalizers"):
                del self.objects[key]
                self._record(resource, ns, "DELETED", obj)
                self._collect_dependents(ns, meta.get("uid"))
                return copy.deepcopy(obj)
            meta["deletionTimestamp"] = _now()
            if resource == "pods":
                meta["deletionGracePeriodSeconds"] = grace
            self._record(resource, ns, "MODIFIED", obj)
            if key not in self._confirmed:
                node = (obj.get("spec") or {}).get("nodeName") or ""
                timer = threading.Timer(grace, self._kubelet_confirms, (key, node))
                timer.daemon = True
                self._timers.append(timer)
                timer.start()
            self._finish(key)
            return copy.deepcopy(self.objects.get(key, obj))

    def _claim_phase(self, ns: str, claim: dict[str, Any]) -> str:
        """The fake provisioner: Bound, unless its dataSource is a VolumeSnapshot that
        is missing or not ready (Pending, as a real provisioner waits)."""
        source = (claim.get("spec") or {}).get("dataSource") or {}
        if source.get("kind") != "VolumeSnapshot":
            return "Bound"
        snap = self.objects.get(("volumesnapshots", ns, source.get("name", "")))
        ready = snap is not None and (snap.get("status") or {}).get("readyToUse") is True
        return "Bound" if ready else "Pending"

    def snapshot_controller(self, ns: str, name: str) -> None:
        """What the CSI snapshotter would have done by the time of this read."""
        with self.cond:
            obj = self.objects.get(("volumesnapshots", ns, name))
            if obj is None or (obj.get("status") or {}).get("readyToUse"):
                return
            reads = self._snapshot_reads.get((ns, name), 0) + 1
            self._snapshot_reads[(ns, name)] = reads
            source = ((obj.get("spec") or {}).get("source") or {}).get(
                "persistentVolumeClaimName", ""
            )
            claim = self.objects.get(("persistentvolumeclaims", ns, source))
            status: dict[str, Any] = {"readyToUse": False}
            if claim is None:
                status["error"] = {
                    "message": f'persistentvolumeclaims "{source}" not found',
                    "time": _now(),
                }
            elif self.snapshot_mode == "error":
                status["error"] = {"message": self.snapshot_error, "time": _now()}
            elif self.snapshot_mode == "ready" and reads >= self.snapshot_ready_after_reads:
                requests = ((claim.get("spec") or {}).get("resources") or {}).get("requests")
                status = {
                    "readyToUse": True,
                    "boundVolumeSnapshotContentName": f"snapcontent-{obj['metadata']['uid']}",
                    "creationTime": _now(),
                    "restoreSize": (requests or {}).get("storage", "0"),
                }
            if status != obj.get("status"):
                obj["status"] = status
                self._record("volumesnapshots", ns, "MODIFIED", obj)

    def _kubelet_confirms(self, key: tuple[str, str, str], node: str) -> None:
        with self.cond:
            if node in self.dead_nodes or key not in self.objects:
                return  # an unreachable kubelet never confirms
            self._confirmed.add(key)
            self._finish(key)

    def _finish(self, key: tuple[str, str, str]) -> None:
        """Removes a deleted object once confirmed and without finalizers."""
        obj = self.objects.get(key)
        if obj is None or not obj["metadata"].get("deletionTimestamp"):
            return
        if key in self._confirmed and not obj["metadata"].get("finalizers"):
            del self.objects[key]
            self._confirmed.discard(key)
            self._record(key[0], key[1], "DELETED", obj)
            self._collect_dependents(key[1], obj["metadata"].get("uid"))

    def _collect_dependents(self, ns: str, owner_uid: str | None) -> None:
        """The garbage collector, background propagation: once an owner is gone, the
        objects of its namespace whose ownerReferences name its uid are deleted (at
        once here; a real cluster's collector gets to them within seconds)."""
        if not owner_uid:
            return
        dependents = [
            key
            for key, obj in self.objects.items()
            if key[1] == ns
            and any(
                ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or []
            )
        ]
        for resource, _ns, name in dependents:
            self.delete(resource, ns, name)

    def patch(
        self,
        resource: str,
        ns: str,
        name: str,
        body: dict[str, Any],
        content_type: str,
        query: dict[str, list[str]],
    ) -> tuple[int, dict[str, Any]]:
        key = (resource, ns, name)
        with self.cond:
            existing = self.objects.get(key)
            if "apply-patch" in content_type:
                manager = query.get("fieldManager", [""])[0]
                if not manager:
                    return 400, status(400, "BadRequest", "fieldManager is required for apply")
                force = query.get("force", ["false"])[0].lower() == "true"
                if existing is None:
                    code, created = self.create(resource, ns, body)
                    if code == 201:
                        created_obj = self.objects[key]
                        created_obj["metadata"]["managedFields"] = [
                            {"manager": manager, "operation": "Apply"}
                        ]
                        created = copy.deepcopy(created_obj)
                    return code, created
                owners = {m["manager"] for m in existing["metadata"].get("managedFields", [])}
                if owners - {manager} and not force:
                    return 409, status(
                        409,
                        "Conflict",
                        f"Apply failed with conflicts: fields are managed by {sorted(owners)}",
                    )
                updated = _apply_merge(existing, body)
                updated["metadata"]["managedFields"] = [{"manager": manager, "operation": "Apply"}]
            else:
                if existing is None:
                    return 404, status(404, "NotFound", f'{resource} "{name}" not found')
                updated = merge_patch(existing, body)
                manager = query.get("fieldManager", ["patch"])[0]
                managers = [m for m in existing["metadata"].get("managedFields", [])]
                if manager not in {m["manager"] for m in managers}:
                    managers.append({"manager": manager, "operation": "Update"})
                updated["metadata"]["managedFields"] = managers
            for keep in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"):
                if keep in existing["metadata"]:
                    updated["metadata"][keep] = existing["metadata"][keep]
            if updated.get("spec") != existing.get("spec"):
                updated["metadata"]["generation"] = existing["metadata"].get("generation", 1) + 1
            self.objects[key] = updated
            self._record(resource, ns, "MODIFIED", updated)
            self._finish(key)
            return 200, copy.deepcopy(updated)

    def replace(
        self, resource: str, ns: str, name: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        key = (resource, ns, name)
        with self.cond:
            existing = self.objects.get(key)
            if existing is None:
                return 404, status(404, "NotFound", f'{resource} "{name}" not found')
            sent = (body.get("metadata") or {}).get("resourceVersion")
            if sent and sent != existing["metadata"]["resourceVersion"]:
                return 409, status(
                    409, "Conflict", "the object has been modified; please apply your changes"
                )
            updated = copy.deepcopy(body)
            for keep in ("uid", "creationTimestamp", "namespace", "deletionTimestamp"):
                if keep in existing["metadata"]:
                    updated["metadata"][keep] = existing["metadata"][keep]
            updated["metadata"]["managedFields"] = [{"manager": "replace", "operation": "Update"}]
            self.objects[key] = updated
            self._record(resource, ns, "MODIFIED", updated)
            return 200, copy.deepcopy(updated)

    def listing(
        self, resource: str, ns: str, selector: str, field_selector: str = ""
    ) -> list[dict[str, Any]]:
        with self.cond:
            return [
                copy.deepcopy(o)
                for (r, n, _), o in sorted(self.objects.items())
                if r == resource
                and n == ns
                and matches(selector, o["metadata"].get("labels", {}))
                and field_matches(field_selector, o)
            ]

    def page(
        self, resource: str, ns: str, query: dict[str, list[str]]
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """One LIST page: (items, list metadata), as the API server paginates."""
        selector = query.get("labelSelector", [""])[0]
        fields = query.get("fieldSelector", [""])[0]
        limit = int(query.get("limit", ["0"])[0] or 0)
        token = query.get("continue", [""])[0]
        with self.cond:
            items = self.listing(resource, ns, selector, fields)
            list_rv = self.rv
            if token:
                state = json.loads(base64.urlsafe_b64decode(token.encode()))
                if int(state["rv"]) < self.compacted_rv:
                    raise ApiStatusError(
                        410,
                        "Expired",
                        "The provided continue parameter is too old to display a consistent "
                        "list result. You can start a new list without the continue parameter.",
                    )
                list_rv = int(state["rv"])
                items = [i for i in items if i["metadata"]["name"] > state["start"]]
        meta: dict[str, Any] = {"resourceVersion": str(list_rv)}
        if limit and len(items) > limit:
            rest = len(items) - limit
            items = items[:limit]
            last = items[-1]["metadata"]["name"]
            raw = json.dumps({"rv": list_rv, "start": last}).encode()
            meta["continue"] = base64.urlsafe_b64encode(raw).decode()
            meta["remainingItemCount"] = rest
        return items, meta

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
        ready: bool | None = None,
        waiting_reason: str = "",
        waiting_message: str = "fake kubelet",
        image_id: str = "",
        exit_code: int | None = None,
        terminated_reason: str = "Error",
        unschedulable: str = "",
        conditions: list[dict[str, Any]] | None = None,
        status_reason: str = "",
        status_message: str = "",
    ) -> None:
        """What the kubelet (or scheduler) would write: phase, IPs, init and main
        container states, conditions (PodScheduled, Initialized, ContainersReady, Ready)."""
        with self.cond:
            obj = self.objects[("pods", ns, name)]
            state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
            if running:
                state = {"running": {"startedAt": _now()}}
            if waiting_reason:
                state = {"waiting": {"reason": waiting_reason, "message": waiting_message}}
            if exit_code is not None:
                state = {
                    "terminated": {
                        "exitCode": exit_code,
                        "reason": terminated_reason,
                        "startedAt": _now(),
                        "finishedAt": _now(),
                    }
                }
            ready = running if ready is None else ready
            obj["spec"]["nodeName"] = node if not unschedulable else None
            conds: list[dict[str, Any]] = []
            if unschedulable:
                conds.append(
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": unschedulable,
                        "lastTransitionTime": _now(),
                    }
                )
            else:
                started = phase != "Pending" or bool(waiting_reason)
                for kind, value in (
                    ("PodScheduled", True),
                    ("Initialized", started),
                    ("ContainersReady", ready),
                    ("Ready", ready),
                ):
                    conds.append(
                        {
                            "type": kind,
                            "status": "True" if value else "False",
                            "lastTransitionTime": _now(),
                        }
                    )
            conds += conditions or []
            init_done = not unschedulable and (phase != "Pending" or bool(waiting_reason))
            init_state: dict[str, Any] = (
                {"terminated": {"exitCode": 0, "reason": "Completed"}}
                if init_done
                else {"waiting": {"reason": "PodInitializing"}}
            )
            obj["status"] = {
                "phase": phase,
                "podIP": pod_ip or None,
                "podIPs": [{"ip": pod_ip}] if pod_ip else None,
                "hostIP": "192.0.2.10" if not unschedulable else None,
                "conditions": conds,
                "initContainerStatuses": [
                    {
                        "name": "hedgerow-agent-inject",
                        "ready": init_done,
                        "restartCount": 0,
                        "image": obj["spec"]["initContainers"][0]["image"]
                        if obj["spec"].get("initContainers")
                        else "injector",
                        "imageID": "",
                        "state": init_state,
                    }
                ],
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
            if status_reason:
                obj["status"]["reason"] = status_reason
                obj["status"]["message"] = status_message
            self._record("pods", ns, "MODIFIED", obj)

    def load_status(self, ns: str, name: str, fixture: str | dict[str, Any]) -> dict[str, Any]:
        """Writes the status of a real pod (a JSON fixture from a cluster) over pod
        ``name``: its status, node, and a deletionTimestamp the fixture carries."""
        data = load_fixture(fixture) if isinstance(fixture, str) else fixture
        with self.cond:
            obj = self.objects[("pods", ns, name)]
            obj["status"] = copy.deepcopy(data["status"])
            node = (data.get("spec") or {}).get("nodeName")
            if node:
                obj["spec"]["nodeName"] = node
            deleting = (data.get("metadata") or {}).get("deletionTimestamp")
            if deleting and not obj["metadata"].get("deletionTimestamp"):
                obj["metadata"]["deletionTimestamp"] = _now()
                obj["metadata"]["deletionGracePeriodSeconds"] = data["metadata"].get(
                    "deletionGracePeriodSeconds", 30
                )
            self._record("pods", ns, "MODIFIED", obj)
            return copy.deepcopy(obj)

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

    def stall_open_watches(self) -> None:
        with self.cond:
            self.stall_epoch += 1
            self.cond.notify_all()

    def fail_next(self, *codes: int) -> None:
        with self.cond:
            self.failures.extend(codes)

    def stall_next(self, *seconds: float) -> None:
        with self.cond:
            self.stalls.extend(seconds)

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

    def calls(self, since: int = 0) -> list[tuple[str, str, dict[str, list[str]]]]:
        """Requests from index ``since`` on, watches left out (they are long-lived)."""
        with self.cond:
            return [r for r in self.requests[since:] if not (r[0] == "GET" and is_watch(r[2]))]


def _apply_merge(existing: dict[str, Any], applied: dict[str, Any]) -> dict[str, Any]:
    """Server-side apply as this fake models it: maps merge, lists and scalars replace."""
    result = copy.deepcopy(existing)
    for key, value in applied.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = _apply_merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def _metadata_only(item: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": item["metadata"],
    }


def _handler(kube: FakeKube) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(
            self, code: int, body: dict[str, Any], headers: dict[str, str] | None = None
        ) -> None:
            data = json.dumps(body).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                pass  # the client gave up (a request timeout)

        def _route(self, method: str) -> None:
            url = urlparse(self.path)
            query = parse_qs(url.query)
            with kube.cond:
                kube.requests.append((method, url.path, query))
                kube.accepts.append((method, url.path, self.headers.get("Accept") or ""))
                failure = kube.failures.pop(0) if kube.failures else None
                stall = kube.stalls.pop(0) if kube.stalls else None
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
            if method == "POST" and url.path == SELF_SUBJECT_ACCESS_REVIEWS:
                # every authenticated user may ask (system:basic-user); answered from
                # the same grants the authorizer below enforces
                self._send(201, kube.access_review(token, body if isinstance(body, dict) else {}))
                return
            if token in kube.grants:
                group, resource, verb = request_verb(method, url.path, query)
                if (group, resource, verb) not in kube.grants[token]:
                    with kube.cond:
                        kube.forbidden.append((token, group, resource, verb))
                    message = (
                        f'{resource} is forbidden: User "system:serviceaccount:hedgerow:{token}" '
                        f'cannot {verb} resource "{resource}" in API group "{group}"'
                    )
                    self._send(403, status(403, "Forbidden", message))
                    return
            if stall is not None:
                time.sleep(stall)  # the fake server is slow; the client's timeout decides
            if failure is not None:
                self._send(
                    failure,
                    status(failure, "ServiceUnavailable", "fake"),
                    {"Retry-After": kube.retry_after},
                )
                return
            for pattern, api_version in _PATHS:
                m = pattern.match(url.path)
                if m:
                    ns, resource, name = m.groups()
                    try:
                        self._dispatch(method, api_version, resource, ns, name, query, body)
                    except ApiStatusError as exc:
                        self._send(exc.code, status(exc.code, exc.reason, exc.message))
                    except FieldSelectorError as exc:
                        self._send(400, status(400, "BadRequest", str(exc)))
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
            grace_raw = query.get("gracePeriodSeconds", [""])[0]
            if not grace_raw and isinstance(body, dict) and "gracePeriodSeconds" in body:
                grace_raw = str(body["gracePeriodSeconds"])
            grace = int(grace_raw) if grace_raw else None
            if name is None and method == "GET":
                if is_watch(query):
                    self._watch(resource, ns, selector, query)
                    return
                items, meta = kube.page(resource, ns, query)
                if METADATA_ONLY in (self.headers.get("Accept") or ""):
                    self._send(
                        200,
                        {
                            "kind": "PartialObjectMetadataList",
                            "apiVersion": "meta.k8s.io/v1",
                            "metadata": meta,
                            "items": [_metadata_only(i) for i in items],
                        },
                    )
                    return
                for item in items:
                    item.setdefault("kind", kind)
                    item.setdefault("apiVersion", api_version)
                self._send(
                    200,
                    {"kind": f"{kind}List", "apiVersion": api_version, "metadata": meta}
                    | {"items": items},
                )
            elif name is None and method == "POST":
                validation = query.get("fieldValidation", [""])[0]
                code, obj = kube.create(resource, ns, body, validation)
                self._send(code, obj)
            elif name is None and method == "DELETE":
                fields = query.get("fieldSelector", [""])[0]
                for item in kube.listing(resource, ns, selector, fields):
                    kube.delete(resource, ns, item["metadata"]["name"], grace)
                self._send(200, status(200, "", "deleted"))
            elif method == "GET":
                if resource == "volumesnapshots":
                    kube.snapshot_controller(ns, name or "")
                with kube.cond:
                    found = kube.objects.get((resource, ns, name or ""))
                    found = copy.deepcopy(found) if found is not None else None
                if found is None:
                    self._send(404, status(404, "NotFound", f'{resource} "{name}" not found'))
                else:
                    self._send(200, found)
            elif method == "DELETE":
                deleted = kube.delete(resource, ns, name or "", grace)
                if deleted is None:
                    self._send(404, status(404, "NotFound", f'{resource} "{name}" not found'))
                elif resource == "pods" or deleted["metadata"].get("deletionTimestamp"):
                    self._send(200, deleted)
                else:
                    self._send(200, status(200, "", "deleted"))
            elif method == "PATCH":
                content_type = self.headers.get("Content-Type") or ""
                code, obj = kube.patch(resource, ns, name or "", body, content_type, query)
                self._send(code, obj)
            elif method == "PUT":
                code, obj = kube.replace(resource, ns, name or "", body)
                self._send(code, obj)
            else:
                self._send(405, status(405, "MethodNotAllowed", method))

        def _watch(
            self, resource: str, ns: str, selector: str, query: dict[str, list[str]]
        ) -> None:
            since = int(query.get("resourceVersion", ["0"])[0] or 0)
            timeout = float(query.get("timeoutSeconds", ["30"])[0])
            bookmarks = query.get("allowWatchBookmarks", ["false"])[0].lower() == "true"
            fields = query.get("fieldSelector", [""])[0]
            field_matches(fields, {"metadata": {}})  # an unknown field is a 400 up front
            with kube.cond:
                expiry = kube.expiry
                epoch = kube.stall_epoch
                expired = bool(since and since < kube.compacted_rv)
            if expired and kube.gone_as_status:
                self._send(410, status(410, "Expired", "too old resource version"))
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def line(event: dict[str, Any]) -> None:
                data = json.dumps(event).encode() + b"\n"
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            start = time.monotonic()
            deadline = start + timeout
            # the watch cache sends one bookmark shortly before it ends a watch
            final_bookmark_at = deadline - min(1.0, timeout / 2)
            last_bookmark = start
            final_sent = False
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
                        stalled = epoch < kube.stall_epoch
                        if (not pending or stalled) and kube.expiry == expiry:
                            remaining = deadline - time.monotonic()
                            if remaining <= 0:
                                break
                            kube.cond.wait(min(remaining, 0.2))
                            pending = [h for h in kube.history if h[0] > cursor]
                        if epoch < kube.stall_epoch:
                            pending = []
                            stalled = True
                        gone = kube.expiry != expiry
                        current = kube.rv
                    for rv, r, n, kind, obj in pending:
                        cursor = rv
                        if (
                            r == resource
                            and n == ns
                            and matches(selector, obj["metadata"].get("labels", {}))
                            and field_matches(fields, obj)
                        ):
                            obj = dict(obj, kind=_KIND[r], apiVersion=_API_VERSION[r])
                            line({"type": kind, "object": obj})
                    if gone and not stalled:
                        line({"type": "ERROR", "object": status(410, "Expired", "watch expired")})
                        return
                    now = time.monotonic()
                    due = now - last_bookmark >= kube.bookmark_interval_s or (
                        now >= final_bookmark_at and not final_sent
                    )
                    if bookmarks and due and not stalled:
                        final_sent = final_sent or now >= final_bookmark_at
                        last_bookmark = now
                        cursor = max(cursor, current)
                        line(
                            {
                                "type": "BOOKMARK",
                                "object": {
                                    "kind": _KIND[resource],
                                    "apiVersion": _API_VERSION[resource],
                                    "metadata": {"resourceVersion": str(cursor)},
                                },
                            }
                        )
                    if time.monotonic() >= deadline:
                        break
            except OSError:
                return
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

        def do_PATCH(self) -> None:
            self._route("PATCH")

        def do_PUT(self) -> None:
            self._route("PUT")

    return Handler
