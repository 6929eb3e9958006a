"""A LIST+WATCH informer over this installation's sandbox pods.

One per installation: the watcher's (``KubernetesBackend.watch`` starts it; workers
wait on their own pod instead, unless ``informer_everywhere``). Events, readiness and
endpoints come from here, never from polling: one LIST (paginated) gives
the state and a resourceVersion, then a WATCH resumes from it (bookmarks keep it
fresh). A watch that ends (server timeout, dropped connection) resumes from the last
version seen; a ``410 Gone`` (the version was compacted away) — as an ERROR event or
as the response's status — forces a full re-list, and entries the re-list no longer
contains are pruned — reported as ``gone`` so a pod deleted while we were not watching
still marks its sandbox lost.

A pod ends its sandbox (an event for the watcher, and no endpoint) when it:

* ends (phase Failed/Succeeded): ``failed``; an OOM kill of the sandbox container is
  ``resource_exhausted`` (kind memory), an eviction ``evicted`` with the kubelet's
  message (``status.reason``), anything else the container's exit;
* carries a ``DisruptionTarget`` condition (taint-manager eviction of a lost node,
  preemption, API-initiated eviction, …): ``gone``, ``node_lost`` or ``disrupted``;
* is being deleted by someone other than Hedgerow (``deletionTimestamp`` while its
  sandbox is not being destroyed by us): ``gone``, ``pod_deleted`` — a pod whose node
  is unreachable stays Terminating forever, its agent long gone;
* stays not Ready for ``not_ready_lost_s`` after it was Ready (or with the node
  controller's ``NodeNotReady``): ``gone``, ``node_lost`` / ``not_ready``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from kubernetes import watch
from kubernetes.client.rest import ApiException

from apps.sandboxes.backends.base import BackendEvent, Endpoint

from .api import KubeApi
from .config import L_SANDBOX, KubernetesConfig, generation_of

log = logging.getLogger(__name__)

# Waiting reasons that will not fix themselves within a provisioning attempt. Image
# pulls (ErrImagePull, ImagePullBackOff) are not among them: the kubelet retries with
# back-off, and a registry's rate limit or a blip must not fail the sandbox; they end
# it only at the ready timeout, with the registry's message.
FATAL_WAITING = frozenset(
    {
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "CrashLoopBackOff",
        "RunContainerError",
    }
)


# Waiting reasons of the sandbox container that mean its image could not be had (yet).
PULL_FAILURES = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName"})
# DisruptionTarget reasons that mean the pod's node is gone
NODE_LOST_REASONS = frozenset({"DeletionByTaintManager", "DeletionByPodGC"})

# Lost codes (the ledger's reason when the watcher ends the sandbox)
EVICTED = "evicted"
NODE_LOST = "node_lost"
DISRUPTED = "disrupted"
POD_DELETED = "pod_deleted"
NOT_READY = "not_ready"
RESOURCE_EXHAUSTED = "resource_exhausted"


def image_digest_of(image_id: str) -> str:
    """The manifest digest in a container status's ``imageID``
    (``docker.io/library/python@sha256:…``, ``docker-pullable://…@sha256:…``); "" when
    it names none (a bare ``sha256:…`` is the image's config id, not what was pulled)."""
    _, at, digest = image_id.rpartition("@")
    return digest if at and digest.startswith("sha256:") else ""


@dataclass(frozen=True)
class PodView:
    name: str
    sandbox_id: str
    generation: int | None
    phase: str
    ip: str
    node: str
    running: bool  # the main container (the agent's launcher) is running
    ready: bool  # the readiness probe on /health passes
    deleting: bool
    problem: str  # a fatal reason ("CreateContainerConfigError: …"), "" when none
    pending_reason: str  # e.g. "Unschedulable: 0/3 nodes are available…"
    image_digest: str = ""  # the sandbox container's imageID digest, once known
    pull_reason: str = ""  # the sandbox image could not be pulled (yet): ErrImagePull, …
    pull_message: str = ""  # … and the kubelet's message (the registry's words)
    # the pod ended or is ending its sandbox: a lost code (EVICTED, …) and why
    lost_code: str = ""
    lost_message: str = ""
    not_ready_reason: str = ""  # the Ready condition's reason when it is False
    resource_version: str = ""

    @property
    def terminal(self) -> bool:
        return self.phase in ("Failed", "Succeeded")

    @property
    def usable(self) -> bool:
        """Its agent may answer: running with an IP, not ending, not lost."""
        return bool(
            self.running
            and self.ip
            and not self.deleting
            and not self.terminal
            and not self.lost_code
        )

    @property
    def settled(self) -> bool:
        """Nothing more to wait for while provisioning."""
        return bool(
            (self.running and self.ip)
            or self.terminal
            or self.problem
            or self.deleting
            or self.lost_code
        )


def _memory_limit(pod: dict[str, Any]) -> str:
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == "sandbox":
            limits = (container.get("resources") or {}).get("limits") or {}
            return str(limits.get("memory", ""))
    return ""


def pod_view(pod: dict[str, Any]) -> PodView:
    """The fields Hedgerow uses of a pod as the API server's JSON (camelCase dict, as
    a LIST read raw or a watch event's ``raw_object``): never the generated models,
    whose deserialisation dominated the cost of listing 10,000 pods."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    spec = pod.get("spec") or {}
    labels = meta.get("labels") or {}
    running = ready = False
    problem = image_digest = pull_reason = pull_message = ""
    lost_code = lost_message = ""
    statuses = (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
    for cs in statuses:
        state = cs.get("state") or {}
        waiting = state.get("waiting")
        terminated = state.get("terminated")
        name = cs.get("name")
        if waiting and waiting.get("reason") in FATAL_WAITING:
            problem = f"{name}: {waiting['reason']}: {waiting.get('message') or ''}".strip()
        if terminated and terminated.get("exitCode") not in (0, None):
            problem = (
                f"{name} exited {terminated['exitCode']} "
                f"({terminated.get('reason') or 'Error'}) {terminated.get('message') or ''}"
            ).strip()
        if name == "sandbox":
            running = bool(state.get("running"))
            ready = bool(cs.get("ready"))
            image_digest = image_digest_of(cs.get("imageID") or "")
            if waiting and waiting.get("reason") in PULL_FAILURES:
                pull_reason = waiting["reason"]
                pull_message = waiting.get("message") or ""
            if terminated and terminated.get("reason") == "OOMKilled":
                limit = _memory_limit(pod)
                lost_code = RESOURCE_EXHAUSTED
                lost_message = (
                    f"resource_exhausted: memory: the sandbox went over its memory limit"
                    f"{' of ' + limit if limit else ''} and the kernel killed it (OOMKilled, "
                    f"exit {terminated.get('exitCode')}; with cgroup v2 the kubelet kills "
                    "every process of the container, see docs/deploy-kubernetes.md)"
                )
    pending_reason = not_ready_reason = ""
    disruption: dict[str, Any] | None = None
    for cond in status.get("conditions") or []:
        kind, value = cond.get("type"), cond.get("status")
        if kind == "PodScheduled" and value == "False":
            pending_reason = f"{cond.get('reason')}: {cond.get('message') or ''}".strip()
        if kind == "DisruptionTarget" and value == "True":
            disruption = cond
        if kind == "Ready" and value == "False":
            # the node controller writes this for a node that stopped answering; the
            # container statuses (the kubelet's) still say ready
            not_ready_reason = cond.get("reason") or "NotReady"
            ready = False
    if status.get("reason") == "Evicted":
        lost_code = EVICTED
        message = (status.get("message") or "").strip()
        lost_message = f"evicted by the kubelet: {message}".strip(": ")
    elif not lost_code and disruption is not None:
        reason = disruption.get("reason")
        lost_code = NODE_LOST if reason in NODE_LOST_REASONS else DISRUPTED
        lost_message = f"{lost_code} ({reason}): {disruption.get('message') or ''}".strip(": ")
    return PodView(
        name=meta.get("name") or "",
        sandbox_id=labels.get(L_SANDBOX, ""),
        generation=generation_of(labels),
        phase=status.get("phase") or "Pending",
        ip=status.get("podIP") or "",
        node=spec.get("nodeName") or "",
        running=running,
        ready=ready,
        deleting=meta.get("deletionTimestamp") is not None,
        problem=problem,
        pending_reason=pending_reason,
        image_digest=image_digest,
        pull_reason=pull_reason,
        pull_message=pull_message,
        lost_code=lost_code,
        lost_message=lost_message,
        not_ready_reason=not_ready_reason,
        resource_version=meta.get("resourceVersion") or "",
    )


def keep_registry_message(view: PodView, before: PodView | None) -> PodView:
    """``ImagePullBackOff`` says only "Back-off pulling image"; the registry's words
    came with the ``ErrImagePull`` before it: keep them."""
    if before is None or view.pull_reason != "ImagePullBackOff":
        return view
    if before.pull_message and not before.pull_message.startswith("Back-off"):
        return dataclasses.replace(view, pull_message=before.pull_message)
    return view


class PodInformer:
    def __init__(self, api: KubeApi, config: KubernetesConfig, isolation: str) -> None:
        self.api = api
        self.config = config
        self.isolation = isolation
        self.pods: dict[str, PodView] = {}
        self.resource_version: str | None = None
        self.relists = 0  # full LISTs done (1 at start, +1 per 410)
        self.events: queue.Queue[BackendEvent] = queue.Queue(maxsize=10000)
        self.quiet: dict[str, float] = {}  # sandbox ids being destroyed by us: no events
        self.reported: set[str] = set()  # pods whose loss was reported (once each)
        self.was_ready: set[str] = set()
        self.not_ready_since: dict[str, float] = {}
        self._cond = threading.Condition()
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: RawWatch | None = None
        self._response: Any = None  # the open WATCH response, closed by stop()

    # ---- lifecycle ------------------------------------------------------------------

    def ensure_started(self, timeout_s: float = 30.0) -> None:
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(
                    target=self._run, name="hedgerow-k8s-informer", daemon=True
                )
                self._thread.start()
        if not self._synced.wait(timeout_s):
            from apps.sandboxes.backends.base import BackendError

            raise BackendError("pod informer did not sync with the API", transient=True)

    @property
    def running(self) -> bool:
        """Listed and watching in this process."""
        thread = self._thread
        return thread is not None and thread.is_alive() and self._synced.is_set()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        response = self._response
        if response is not None:
            # unblocks the thread's read at once, instead of after watch_timeout_s
            with contextlib.suppress(Exception):
                response.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self._relist()
                self._watch_once()
                failures = 0
            except ApiException as exc:
                if exc.status == 410:
                    log.info("watch expired (410 Gone): re-listing")
                    self.resource_version = None
                    continue
                failures += 1
                log.warning("pod watch failed: %s", exc)
            except Exception as exc:  # noqa: BLE001 - the informer must outlive any error
                failures += 1
                log.warning("pod informer error: %s", exc)
            if failures:
                self._stop.wait(min(0.1 * 2**failures, 10.0))

    # ---- list and watch -----------------------------------------------------------

    def _relist(self) -> None:
        items, version = self.api.list_json(
            pods_path(self.config.namespace), labelSelector=self.config.sandbox_selector()
        )
        fresh = {view.name: view for view in map(pod_view, items)}
        with self._cond:
            for name in set(self.pods) - set(fresh):
                self._forget(name)
                self._emit_gone(self.pods.pop(name), "pod vanished while not watched")
            for view in fresh.values():
                self._apply(view)
            self.resource_version = version
            self.relists += 1
            self._cond.notify_all()
        self._synced.set()

    def _watch_once(self) -> None:
        self._watch = RawWatch()
        list_pods = self.api.core.list_namespaced_pod

        def list_and_keep_response(*args: Any, **kwargs: Any) -> Any:
            self._response = list_pods(*args, **kwargs)
            return self._response

        stream = self._watch.stream(
            list_and_keep_response,
            self.config.namespace,
            label_selector=self.config.sandbox_selector(),
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.config.watch_timeout_s,
            _request_timeout=self.config.watch_timeout_s + 10,
        )
        for event in stream:
            if self._stop.is_set():
                return
            kind = event["type"]
            raw = event["raw_object"]
            version = (raw.get("metadata") or {}).get("resourceVersion")
            if kind == "BOOKMARK":
                self.resource_version = version or self.resource_version
                continue
            view = pod_view(raw)
            with self._cond:
                if kind == "DELETED":
                    self.pods.pop(view.name, None)
                    if view.name not in self.reported:
                        self._emit(self._lost_event(view, "gone", "pod deleted", POD_DELETED))
                    self._forget(view.name)
                else:
                    self._apply(view)
                self.resource_version = version or self.resource_version
                self._cond.notify_all()

    # ---- cache and events (under self._cond) --------------------------------------

    def _forget(self, name: str) -> None:
        self.reported.discard(name)
        self.was_ready.discard(name)
        self.not_ready_since.pop(name, None)

    def _apply(self, view: PodView) -> None:
        before = self.pods.get(view.name)
        view = keep_registry_message(view, before)
        self.pods[view.name] = view
        if view.ready:
            self.was_ready.add(view.name)
            self.not_ready_since.pop(view.name, None)
        elif view.running and (view.name in self.was_ready or view.not_ready_reason):
            self.not_ready_since.setdefault(view.name, time.monotonic())
        if view.name in self.reported:
            return
        if view.terminal:
            reason = view.lost_message or view.problem or f"pod {view.phase.lower()}"
            self._report(view, "failed", reason, view.lost_code)
        elif view.lost_code:
            self._report(view, "gone", view.lost_message, view.lost_code)
        elif view.deleting and view.sandbox_id not in self.quiet:
            self._report(view, "gone", "the pod is being deleted (not by Hedgerow)", POD_DELETED)
        elif view.ready and view.ip and not (before and before.ready):
            endpoint = Endpoint(
                view.ip, self.config.agent_port, self.isolation, view.node, view.image_digest
            )
            self._emit(BackendEvent(view.sandbox_id, view.generation, "ready", "", endpoint))
        else:
            self._check_not_ready(view, time.monotonic())

    def _check_not_ready(self, view: PodView, now: float) -> None:
        since = self.not_ready_since.get(view.name)
        if since is None or view.ready or now - since < self.config.not_ready_lost_s:
            return
        node_down = view.not_ready_reason == "NodeNotReady"
        code = NODE_LOST if node_down else NOT_READY
        why = (
            f"its node {view.node or '?'} is not ready"
            if node_down
            else "its agent stopped answering the readiness probe"
        )
        self._report(
            view,
            "gone",
            f"{code}: the pod has not been Ready for {now - since:.0f}s: {why}",
            code,
        )

    def _report(self, view: PodView, kind: str, reason: str, code: str) -> None:
        if view.sandbox_id in self.quiet:
            return  # our own destroy
        self.reported.add(view.name)
        self._emit(self._lost_event(view, kind, reason, code))

    def _lost_event(self, view: PodView, kind: str, reason: str, code: str) -> BackendEvent:
        return BackendEvent(view.sandbox_id, view.generation, kind, reason, code=code)

    def sweep(self) -> None:
        """Reports pods not Ready for longer than the bound: no event arrives for a
        pod that simply stays not ready, so the watcher's loop asks."""
        now = time.monotonic()
        with self._cond:
            for name in list(self.not_ready_since):
                view = self.pods.get(name)
                if view is not None and name not in self.reported:
                    self._check_not_ready(view, now)

    def _emit_gone(self, view: PodView, reason: str) -> None:
        self._emit(BackendEvent(view.sandbox_id, view.generation, "gone", reason))

    def _emit(self, event: BackendEvent) -> None:
        if not event.sandbox_id or event.sandbox_id in self.quiet:
            return
        while True:
            try:
                self.events.put_nowait(event)
                return
            except queue.Full:  # nobody consumes (a worker process): keep the newest
                try:
                    self.events.get_nowait()
                except queue.Empty:
                    pass

    # ---- queries --------------------------------------------------------------------

    def silence(self, sandbox_id: str) -> None:
        """Our own destroy is under way: its pod's deletion is not news."""
        now = time.monotonic()
        with self._cond:
            self.quiet = {k: t for k, t in self.quiet.items() if now - t < 600}
            self.quiet[sandbox_id] = now

    def unsilence(self, sandbox_id: str) -> None:
        with self._cond:
            self.quiet.pop(sandbox_id, None)

    def get(self, name: str) -> PodView | None:
        with self._cond:
            return self.pods.get(name)

    def usable(self, view: PodView) -> bool:
        """Its agent may answer (``PodView.usable``) and it was not reported lost."""
        with self._cond:
            return view.usable and view.name not in self.reported

    def for_sandbox(self, sandbox_id: str) -> list[PodView]:
        with self._cond:
            return [p for p in self.pods.values() if p.sandbox_id == sandbox_id]

    def wait(self, name: str, timeout_s: float) -> PodView | None:
        """Waits until pod ``name`` runs its agent (IP assigned, main container running),
        ends, or shows a fatal problem; returns its last view (None if never seen)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                view = self.pods.get(name)
                if view and view.settled:
                    return view
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return view
                self._cond.wait(remaining)

    def observe(self, view: PodView) -> None:
        """A view read directly (the GET fallback): kept when newer than the cache's."""
        with self._cond:
            before = self.pods.get(view.name)
            if before is None or _rv(view.resource_version) > _rv(before.resource_version):
                self._apply(view)
                self._cond.notify_all()


class RawWatch(watch.Watch):  # type: ignore[misc]  # untyped client
    """A watch whose events are left as the API server's JSON (``raw_object``; no
    generated model in ``object``): ``pod_view`` reads the dict."""

    def get_return_type(self, func: Any) -> str:
        return ""


def pods_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods"


def _rv(version: str) -> int:
    return int(version) if version.isdigit() else 0
