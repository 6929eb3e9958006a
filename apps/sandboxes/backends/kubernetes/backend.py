"""KubernetesBackend: one pod per sandbox in a dedicated namespace."""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import re
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from apps.sandboxes.backends.base import (
    BackendError,
    BackendEvent,
    Endpoint,
    ImageInfo,
    ImageUnavailable,
    InventoryItem,
    ProgressCallback,
    RegistryCredentials,
    SandboxSpec,
    SnapshotFailed,
    SnapshotInfo,
    SnapshotNotFound,
    UnknownImage,
)

from . import egress_allow
from .api import KubeApi, is_status
from .config import (
    L_SANDBOX,
    KubernetesConfig,
    UserNamespacesUnavailable,
    check_image_ref,
    check_sandbox_id,
    generation_of,
    identity,
    object_name,
)
from .informer import PodInformer
from .specs import (
    build_egress_policy,
    build_namespace_policy,
    build_pod,
    build_pull_secret,
    build_secret,
)

log = logging.getLogger(__name__)

HOST_ALIAS = "host"  # the API's default image name; mapped to config.default_image


@dataclasses.dataclass(frozen=True)
class Kind:
    """How to create/read/delete/list one kind of object."""

    name: str  # inventory kind
    create: Callable[..., Any]
    read: Callable[..., Any]
    delete: Callable[..., Any]
    listing: Callable[..., Any]
    delete_collection: Callable[..., Any]


class KubernetesBackend:
    name = "kubernetes"

    def __init__(self, config: KubernetesConfig, api: KubeApi) -> None:
        self.config = config
        self.api = api
        core, net = api.core, api.net
        self.pods = Kind(
            "pod",
            core.create_namespaced_pod,
            core.read_namespaced_pod,
            core.delete_namespaced_pod,
            core.list_namespaced_pod,
            core.delete_collection_namespaced_pod,
        )
        self.secrets = Kind(
            "secret",
            core.create_namespaced_secret,
            core.read_namespaced_secret,
            core.delete_namespaced_secret,
            core.list_namespaced_secret,
            core.delete_collection_namespaced_secret,
        )
        self.policies = Kind(
            "network_policy",
            net.create_namespaced_network_policy,
            net.read_namespaced_network_policy,
            net.delete_namespaced_network_policy,
            net.list_namespaced_network_policy,
            net.delete_collection_namespaced_network_policy,
        )
        self.isolation = f"pod+{config.runtime_class}" if config.runtime_class else "pod"
        self.informer = PodInformer(api, config, self.isolation)
        self._namespace_policy_ok = False

    # ---- images ------------------------------------------------------------------

    def images(self) -> list[ImageInfo]:
        found = [ImageInfo(HOST_ALIAS, f"alias of {self.config.default_image}")]
        found += [ImageInfo(name, "container image") for name in self.config.images]
        return found

    def _image_ref(self, image: str) -> str:
        if image == HOST_ALIAS:
            return self.config.default_image
        if image not in self.config.images:
            raise UnknownImage(f"unknown image {image!r}")
        check_image_ref(image)
        return image

    # Nodes pull images themselves (kubelet), with the tenant's login as the pod's own
    # imagePullSecret; these answer from the configured list. The digest a sandbox ran
    # comes from its pod's imageID (Endpoint.image_digest).
    def resolve_image(
        self, reference: str, credentials: RegistryCredentials | None = None
    ) -> ImageInfo:
        return ImageInfo(self._image_ref(reference))

    def pull_image(
        self,
        reference: str,
        credentials: RegistryCredentials | None = None,
        progress: ProgressCallback | None = None,
    ) -> ImageInfo:
        return self.resolve_image(reference, credentials)

    def import_image(self, name: str, archive: Path) -> ImageInfo:
        raise BackendError("the kubernetes backend cannot import archives: push to a registry")

    def remove_image(self, digest: str) -> bool:
        raise BackendError("the kubernetes backend keeps no image cache (nodes do)")

    # ---- snapshots (docs/snapshots.md "Kubernetes": not built yet) ----------------

    def snapshot(self, sandbox_id: str, snapshot_id: str) -> SnapshotInfo:
        raise SnapshotFailed(
            "the kubernetes backend cannot snapshot sandboxes yet", code="snapshots_unsupported"
        )

    def delete_snapshot(self, snapshot_id: str) -> None:
        raise SnapshotNotFound(f"no snapshot {snapshot_id}: the kubernetes backend keeps none")

    # ---- provision ---------------------------------------------------------------

    def provision(self, spec: SandboxSpec, progress: ProgressCallback | None = None) -> Endpoint:
        check_sandbox_id(spec.sandbox_id)
        if spec.snapshot_id:
            raise SnapshotNotFound(f"no snapshot {spec.snapshot_id} on the kubernetes backend")
        spec = dataclasses.replace(spec, image=self._image_ref(spec.image))
        self.informer.unsilence(spec.sandbox_id)
        self.ensure_namespace_policy()
        self.informer.ensure_started()
        # A new generation replaces the old pod: nothing of an older one may answer.
        try:
            self._delete_generations(spec.sandbox_id, keep=spec.generation)
        except ApiException as exc:
            raise BackendError(
                f"cannot remove older generations: {exc.status} {exc.reason}", transient=True
            ) from exc
        # never the whole network instead of an allowlist (egress_allow.py)
        egress_allow.check_supported(self.config, spec.egress_policy)
        owned: list[tuple[Kind, str]] = []  # rollback removes these and nothing else
        try:
            secret = build_secret(self.config, spec)
            self._create_or_adopt(self.secrets, secret)
            owned.append((self.secrets, secret.metadata.name))
            pull_secret = build_pull_secret(self.config, spec)
            if pull_secret is not None:
                self._create_or_adopt(self.secrets, pull_secret)
                owned.append((self.secrets, pull_secret.metadata.name))
            if spec.network_access:
                policy = egress_allow.egress_policy_for(self.config, spec) or build_egress_policy(
                    self.config, spec
                )
                self._create_or_adopt(self.policies, policy)
                owned.append((self.policies, policy.metadata.name))
            pod = build_pod(self.config, spec)
            egress_allow.apply_pod_dns(pod, self.config, spec.egress_policy)
            created = self._create_or_adopt(self.pods, pod)
            owned.insert(0, (self.pods, pod.metadata.name))
            self._check_user_namespace(created)
            return self._wait_started(pod.metadata.name, spec.image)
        except Exception as exc:
            try:
                for kind, name in owned:
                    self._delete(kind, name)
            except Exception as cleanup_exc:  # noqa: BLE001 - report both
                raise BackendError(
                    f"provision failed ({exc}); rollback failed too: {cleanup_exc}"
                ) from exc
            if isinstance(exc, BackendError):
                raise
            raise BackendError(f"provision failed: {exc}") from exc

    def ensure_namespace_policy(self) -> None:
        """The default-deny policy exists before any sandbox pod does (idempotent)."""
        if self._namespace_policy_ok:
            return
        body = build_namespace_policy(self.config)
        try:
            self.api.call(self.policies.create, self.config.namespace, body)
        except ApiException as exc:
            if not is_status(exc, 409):
                raise BackendError(f"cannot create the namespace policy: {exc.reason}") from exc
            try:
                existing = self.api.call(
                    self.policies.read, body.metadata.name, self.config.namespace
                )
            except ApiException as read_exc:
                raise BackendError(f"cannot read the namespace policy: {read_exc.reason}") from exc
            labels = existing.metadata.labels or {}
            # extra labels (kustomize's part-of, …) are fine; ours must all be there
            if any(labels.get(k) != v for k, v in body.metadata.labels.items()):
                raise BackendError(
                    f"network policy {body.metadata.name} exists but is not this "
                    "installation's; refusing to run sandboxes without it"
                ) from exc
        self._namespace_policy_ok = True

    def _check_user_namespace(self, pod: Any) -> None:
        """The pod as stored must still ask for its user namespace: an API server whose
        UserNamespacesSupport gate is off (or that predates the field) drops hostUsers
        silently, and the pod would run with pod root as node root."""
        if self.config.user_namespaces and pod.spec.host_users is not False:
            raise UserNamespacesUnavailable("the stored pod has no hostUsers: false")

    def _create_or_adopt(self, kind: Kind, body: Any) -> Any:
        """Creates ``body``; an existing object of that name is adopted only when its
        labels name the same installation, tenant, sandbox and generation."""
        name = body.metadata.name
        try:
            # Strict: a field the API server does not know is an error, not dropped
            return self.api.call(
                kind.create, self.config.namespace, body, field_validation="Strict"
            )
        except ApiException as exc:
            if kind is self.pods and _rejects_host_users(exc):
                raise UserNamespacesUnavailable(f"{exc.status} {_message(exc)}") from exc
            if not is_status(exc, 409):
                raise BackendError(
                    f"cannot create {kind.name} {name}: {exc.status} {exc.reason}",
                    transient=exc.status in (409, 429) or exc.status >= 500,
                ) from exc
        existing = self.api.call(kind.read, name, self.config.namespace)
        if identity(existing.metadata.labels) != identity(body.metadata.labels):
            raise BackendError(
                f"{kind.name} {name} already exists with other owner labels "
                f"{identity(existing.metadata.labels)}: refusing to share it"
            )
        if existing.metadata.deletion_timestamp is not None:
            raise BackendError(f"{kind.name} {name} is being deleted", transient=True)
        log.info("adopted existing %s %s", kind.name, name)
        return existing

    def _wait_started(self, pod_name: str, image: str) -> Endpoint:
        view = self.informer.wait(pod_name, self.config.ready_timeout_s)
        if view is None:
            raise BackendError(f"pod {pod_name} never appeared in the watch", transient=True)
        if view.running and view.ip and not view.deleting:
            return Endpoint(
                view.ip, self.config.agent_port, self.isolation, view.node, view.image_digest
            )
        if view.pull_reason:
            # the kubelet could not get the sandbox's image: a typed startup failure
            # with the registry's own words, like the local backend's pull errors
            raise ImageUnavailable(
                f"{image}: {view.pull_reason}: {view.pull_message}".rstrip(": "),
                code=pull_error_code(view.pull_reason, view.pull_message),
                reference=image,
            )
        if view.problem or view.terminal:
            raise BackendError(f"pod {pod_name} failed: {view.problem or view.phase}")
        if view.deleting:
            raise BackendError(f"pod {pod_name} was deleted while starting")
        waiting = view.pending_reason or f"phase {view.phase}"
        raise BackendError(
            f"pod {pod_name} not started after {self.config.ready_timeout_s:.0f}s ({waiting})"
        )

    # ---- destroy -------------------------------------------------------------------

    def destroy(self, sandbox_id: str) -> None:
        check_sandbox_id(sandbox_id)
        self.informer.silence(sandbox_id)
        try:
            self._delete_generations(sandbox_id, keep=None)
        except ApiException as exc:  # the destroy task retries BackendErrors only
            raise BackendError(
                f"cannot delete sandbox {sandbox_id}: {exc.status} {exc.reason}", transient=True
            ) from exc

    def _delete_generations(self, sandbox_id: str, *, keep: int | None) -> None:
        """Deletes the sandbox's pods first (the agent stops answering), then its
        policies and secrets; ``keep``: a generation to spare."""
        selector = self.config.sandbox_selector(sandbox_id)
        for kind in (self.pods, self.policies, self.secrets):
            if keep is None:
                # one request per kind, whatever the number of generations
                self.api.call(
                    kind.delete_collection,
                    self.config.namespace,
                    label_selector=selector,
                    **_grace(kind),
                )
                continue
            listing = self.api.call(kind.listing, self.config.namespace, label_selector=selector)
            for obj in listing.items:
                if generation_of(obj.metadata.labels) != keep:
                    self._delete(kind, obj.metadata.name)

    def _delete(self, kind: Kind, name: str) -> None:
        try:
            self.api.call(kind.delete, name, self.config.namespace, **_grace(kind))
        except ApiException as exc:
            if not is_status(exc, 404):
                raise BackendError(
                    f"cannot delete {kind.name} {name}: {exc.status} {exc.reason}",
                    transient=True,
                ) from exc

    # ---- endpoint, inventory, reclaim ----------------------------------------------

    def endpoint(self, sandbox_id: str) -> Endpoint | None:
        check_sandbox_id(sandbox_id)
        self.informer.ensure_started()
        live = [
            p
            for p in self.informer.for_sandbox(sandbox_id)
            if p.running and p.ip and not p.deleting and not p.terminal
        ]
        if not live:
            return None
        best = max(live, key=lambda p: p.generation or 0)
        return Endpoint(
            best.ip, self.config.agent_port, self.isolation, best.node, best.image_digest
        )

    def inventory(self) -> list[InventoryItem]:
        """Pods, network policies and secrets of this installation, listed afresh
        (not from the informer's cache). A pod whose containers ended is
        ``pod_exited``: it holds no running agent but is still a resource to remove.
        A pod deleted less than ``terminating_grace_s`` ago is a deletion in progress,
        not a leak, and is left out."""
        items: list[InventoryItem] = []
        selector = self.config.sandbox_selector()
        now = datetime.now(UTC)
        for kind in (self.pods, self.policies, self.secrets):
            try:
                listing = self.api.call(
                    kind.listing, self.config.namespace, label_selector=selector
                )
            except ApiException as exc:
                raise BackendError(f"cannot list {kind.name}s: {exc.status} {exc.reason}") from exc
            for obj in listing.items:
                meta = obj.metadata
                labels = meta.labels or {}
                name = kind.name
                node = ""
                if kind is self.pods:
                    if meta.deletion_timestamp is not None:
                        age = (now - meta.deletion_timestamp).total_seconds()
                        if age < self.config.terminating_grace_s:
                            continue
                    if obj.status and obj.status.phase in ("Failed", "Succeeded"):
                        name = "pod_exited"
                    node = (obj.spec.node_name if obj.spec else None) or ""
                sid = labels.get(L_SANDBOX) or None
                valid = sid is not None and _valid_id(sid)
                items.append(
                    InventoryItem(
                        name,
                        meta.name,
                        sid if valid else None,
                        generation_of(labels),
                        node,
                    )
                )
        return items

    def reclaim(self, item: InventoryItem) -> None:
        kinds = {"pod": self.pods, "pod_exited": self.pods}
        kinds.update({"network_policy": self.policies, "secret": self.secrets})
        kind = kinds.get(item.kind)
        if kind is None:
            raise BackendError(f"unknown inventory kind {item.kind!r}")
        self._delete(kind, item.name)

    # ---- events --------------------------------------------------------------------

    def watch(self, timeout_s: float) -> Iterator[BackendEvent]:
        self.informer.ensure_started()
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                yield self.informer.events.get(timeout=remaining)
            except queue.Empty:
                return

    def close(self) -> None:
        self.informer.stop()


# The kubelet's pull error messages (containerd, CRI-O) → the image error codes of the
# backend contract (docs/images.md); the first match wins, in this order.
_PULL_CODES = (
    ("registry_unauthorized", re.compile(
        r"unauthori[sz]ed|authentication required|access denied|"
        r"authorization failed|insufficient_scope|forbidden|denied", re.I)),
    ("image_not_found", re.compile(r"not found|manifest unknown|name unknown", re.I)),
    ("image_platform_unsupported", re.compile(r"no match for platform", re.I)),
    ("registry_unreachable", re.compile(
        r"no such host|connection refused|timeout|dial tcp|x509|tls: |"
        r"network is unreachable|connection reset", re.I)),
)  # fmt: skip


def pull_error_code(reason: str, message: str) -> str:
    """The stable code of a pull the kubelet reported failed: ``InvalidImageName`` is
    ``image_reference_invalid``; otherwise read from the registry's message, and
    ``unknown_image`` when it says nothing more (``Back-off pulling image "…"``)."""
    if reason == "InvalidImageName":
        return "image_reference_invalid"
    for code, pattern in _PULL_CODES:
        if pattern.search(message):
            return code
    return "unknown_image"


def _grace(kind: Kind) -> dict[str, Any]:
    # a sandbox needs no graceful shutdown; 1 s lets the runtime stop it cleanly
    return {"grace_period_seconds": 1} if kind.name == "pod" else {}


def _message(exc: ApiException) -> str:
    """The API server's Status message (the body), else the HTTP reason."""
    try:
        message = json.loads(exc.body or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message or exc.reason)


def _rejects_host_users(exc: ApiException) -> bool:
    # 400 "strict decoding error: unknown field "spec.hostUsers"" (a server without the
    # field), 422 "spec.hostUsers: Forbidden/Invalid …" (one that validates it away)
    return exc.status in (400, 422) and "hostUsers" in _message(exc)


def _valid_id(sandbox_id: str) -> bool:
    try:
        check_sandbox_id(sandbox_id)
    except BackendError:
        return False
    return True


def pod_name(sandbox_id: str, generation: int) -> str:
    return object_name(sandbox_id, generation)


__all__ = ["KubernetesBackend", "client", "pod_name"]
