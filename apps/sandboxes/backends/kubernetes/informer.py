"""A LIST+WATCH informer over this installation's sandbox pods.

Readiness and endpoints come from here, never from polling: one LIST gives the state
and a resourceVersion, then a WATCH resumes from it (bookmarks keep it fresh). A watch
that ends (server timeout, dropped connection) resumes from the last version seen; a
``410 Gone`` (the version was compacted away) forces a full re-list, and entries the
re-list no longer contains are pruned — reported as ``gone`` so a pod deleted while we
were not watching still marks its sandbox lost.
"""

from __future__ import annotations

import contextlib
import functools
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

# Waiting reasons that will not fix themselves within a provisioning attempt.
FATAL_WAITING = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "CrashLoopBackOff",
        "RunContainerError",
    }
)


# Waiting reasons of the sandbox container that mean its image could not be had.
PULL_FAILURES = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName"})


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
    problem: str  # a fatal reason ("ErrImagePull: …"), "" when none
    pending_reason: str  # e.g. "Unschedulable: 0/3 nodes are available…"
    image_digest: str = ""  # the sandbox container's imageID digest, once known
    pull_reason: str = ""  # the sandbox image could not be pulled: ErrImagePull, …
    pull_message: str = ""  # … and the kubelet's message (the registry's words)

    @property
    def terminal(self) -> bool:
        return self.phase in ("Failed", "Succeeded")


def pod_view(pod: Any) -> PodView:
    meta, status = pod.metadata, pod.status
    labels = meta.labels or {}
    running = ready = False
    problem = image_digest = pull_reason = pull_message = ""
    for cs in list(status.init_container_statuses or []) + list(status.container_statuses or []):
        state = cs.state
        if state and state.waiting and state.waiting.reason in FATAL_WAITING:
            problem = f"{cs.name}: {state.waiting.reason}: {state.waiting.message or ''}".strip()
        if state and state.terminated and state.terminated.exit_code not in (0, None):
            problem = (
                f"{cs.name} exited {state.terminated.exit_code} "
                f"({state.terminated.reason or 'Error'}) {state.terminated.message or ''}"
            ).strip()
        if cs.name == "sandbox":
            running = bool(state and state.running)
            ready = bool(cs.ready)
            image_digest = image_digest_of(cs.image_id or "")
            if state and state.waiting and state.waiting.reason in PULL_FAILURES:
                pull_reason = state.waiting.reason
                pull_message = state.waiting.message or ""
    pending_reason = ""
    for cond in status.conditions or []:
        if cond.type == "PodScheduled" and cond.status == "False":
            pending_reason = f"{cond.reason}: {cond.message or ''}".strip()
    return PodView(
        name=meta.name,
        sandbox_id=labels.get(L_SANDBOX, ""),
        generation=generation_of(labels),
        phase=status.phase or "Pending",
        ip=status.pod_ip or "",
        node=pod.spec.node_name or "" if pod.spec else "",
        running=running,
        ready=ready,
        deleting=meta.deletion_timestamp is not None,
        problem=problem,
        pending_reason=pending_reason,
        image_digest=image_digest,
        pull_reason=pull_reason,
        pull_message=pull_message,
    )


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
        self._cond = threading.Condition()
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: watch.Watch | None = None
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
        listing = self.api.call(
            self.api.core.list_namespaced_pod,
            self.config.namespace,
            label_selector=self.config.sandbox_selector(),
        )
        fresh = {p.metadata.name: pod_view(p) for p in listing.items}
        with self._cond:
            for name in set(self.pods) - set(fresh):
                self._emit_gone(self.pods.pop(name), "pod vanished while not watched")
            for view in fresh.values():
                self._apply(view)
            self.resource_version = listing.metadata.resource_version
            self.relists += 1
            self._cond.notify_all()
        self._synced.set()

    def _watch_once(self) -> None:
        self._watch = watch.Watch()
        list_pods = self.api.core.list_namespaced_pod

        @functools.wraps(list_pods)  # Watch reads the return type from the docstring
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
            view = pod_view(event["object"])
            with self._cond:
                if kind == "DELETED":
                    self.pods.pop(view.name, None)
                    self._emit_gone(view, "pod deleted")
                else:
                    self._apply(view)
                self.resource_version = version or self.resource_version
                self._cond.notify_all()

    # ---- cache and events (under self._cond) --------------------------------------

    def _apply(self, view: PodView) -> None:
        before = self.pods.get(view.name)
        self.pods[view.name] = view
        if view.terminal and not (before and before.terminal):
            reason = view.problem or f"pod {view.phase.lower()}"
            self._emit(BackendEvent(view.sandbox_id, view.generation, "failed", reason))
        elif view.ready and view.ip and not (before and before.ready):
            endpoint = Endpoint(
                view.ip, self.config.agent_port, self.isolation, view.node, view.image_digest
            )
            self._emit(BackendEvent(view.sandbox_id, view.generation, "ready", "", endpoint))

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
                if view and (
                    (view.running and view.ip) or view.terminal or view.problem or view.deleting
                ):
                    return view
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return view
                self._cond.wait(remaining)
