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
from kubernetes.utils import parse_quantity

from apps.core.egress import EgressPolicy
from apps.core.redis_sync import redis_client
from apps.sandboxes.backends.base import (
    BackendError,
    BackendEvent,
    Endpoint,
    ImageInfo,
    ImageUnavailable,
    InventoryItem,
    MetricsUnavailable,
    ProgressCallback,
    RegistryCredentials,
    SandboxMetrics,
    SandboxSpec,
    SnapshotFailed,
    SnapshotInfo,
    SnapshotNotFound,
    UnknownImage,
)

from . import dnslog, egress_allow
from .api import KubeApi, is_status
from .config import (
    A_SNAPSHOT_DIGEST,
    A_SNAPSHOT_IMAGE,
    COMPONENT_SNAPSHOT,
    L_COMPONENT,
    L_SANDBOX,
    L_SNAPSHOT,
    L_TENANT,
    KubernetesConfig,
    UserNamespacesUnavailable,
    check_image_ref,
    check_sandbox_id,
    generation_of,
    identity,
    object_name,
    snapshot_object_name,
)
from .informer import PodInformer, PodView, RawWatch, keep_registry_message, pod_view
from .specs import (
    SNAPSHOT_GROUP,
    SNAPSHOT_VERSION,
    build_egress_policy,
    build_namespace_policy,
    build_pod,
    build_pull_secret,
    build_secret,
    build_state_claim,
    build_volume_snapshot,
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
    replace: Callable[..., Any]


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
            core.replace_namespaced_pod,
        )
        self.secrets = Kind(
            "secret",
            core.create_namespaced_secret,
            core.read_namespaced_secret,
            core.delete_namespaced_secret,
            core.list_namespaced_secret,
            core.delete_collection_namespaced_secret,
            core.replace_namespaced_secret,
        )
        self.policies = Kind(
            "network_policy",
            net.create_namespaced_network_policy,
            net.read_namespaced_network_policy,
            net.delete_namespaced_network_policy,
            net.list_namespaced_network_policy,
            net.delete_collection_namespaced_network_policy,
            net.replace_namespaced_network_policy,
        )
        self.cilium: Kind | None = _cilium_kind(api) if config.cni == "cilium" else None
        self.claims = Kind(
            "volume",
            core.create_namespaced_persistent_volume_claim,
            core.read_namespaced_persistent_volume_claim,
            core.delete_namespaced_persistent_volume_claim,
            core.list_namespaced_persistent_volume_claim,
            core.delete_collection_namespaced_persistent_volume_claim,
            core.replace_namespaced_persistent_volume_claim,
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

    # ---- snapshots (docs/snapshots.md "Kubernetes"): CSI VolumeSnapshots ------------

    def snapshot(self, sandbox_id: str, snapshot_id: str) -> SnapshotInfo:
        """A ``VolumeSnapshot`` of the sandbox's state claim (/workspace and /tmp),
        waited for until ``readyToUse`` (at most ``snapshot_ready_timeout_s``). The
        control plane quiesced the sandbox first (no running operation, probes read);
        there is no freezer here: the snapshot is crash-consistent. All or nothing: an
        error status, a timeout or a vanished object deletes the VolumeSnapshot and
        raises SnapshotFailed (``snapshot_failed``, ``snapshot_timeout``)."""
        check_sandbox_id(sandbox_id)
        name = snapshot_object_name(snapshot_id)
        if not self.config.snapshots_enabled:
            raise SnapshotFailed(
                "the kubernetes backend takes snapshots only with a VolumeSnapshotClass "
                "configured (HEDGEROW_K8S_SNAPSHOT_CLASS)",
                code="snapshots_unsupported",
            )
        pod = self._running_pod(sandbox_id)
        meta = pod.get("metadata") or {}
        generation = generation_of(meta.get("labels"))
        claim = object_name(sandbox_id, generation or 0, "-state")
        volumes = (pod.get("spec") or {}).get("volumes") or []
        if not any(
            (v.get("persistentVolumeClaim") or {}).get("claimName") == claim for v in volumes
        ):
            raise SnapshotFailed(
                f"sandbox {sandbox_id} has no state volume (it started before snapshots "
                "were configured): nothing to snapshot",
                code="snapshots_unsupported",
            )
        containers = (pod.get("spec") or {}).get("containers") or [{}]
        image = str(containers[0].get("image") or "")
        body = build_volume_snapshot(
            self.config,
            snapshot_id=snapshot_id,
            sandbox_id=sandbox_id,
            claim=claim,
            image=image.split("@", 1)[0],
            image_digest=pod_view(pod).image_digest,
        )
        started = time.monotonic()
        try:
            self.api.call(
                self.api.custom.create_namespaced_custom_object,
                SNAPSHOT_GROUP,
                SNAPSHOT_VERSION,
                self.config.namespace,
                "volumesnapshots",
                body,
            )
        except ApiException as exc:
            if is_status(exc, 409):
                raise SnapshotFailed(f"snapshot {snapshot_id} exists already") from exc
            raise SnapshotFailed(
                f"cannot create VolumeSnapshot {name}: {exc.status} {_message(exc)}"
            ) from exc
        try:
            ready = self._wait_snapshot_ready(name)
        except BaseException as exc:
            try:
                self._delete_volume_snapshot(name)  # nothing half-created is kept
            except BackendError as cleanup:  # the reconciler reclaims it (no ready record)
                raise SnapshotFailed(f"{exc}; and its VolumeSnapshot is left: {cleanup}") from exc
            raise
        status = ready.get("status") or {}
        size = status.get("restoreSize")
        annotations = (ready.get("metadata") or {}).get("annotations") or {}
        return SnapshotInfo(
            snapshot_id=snapshot_id,
            sandbox_id=sandbox_id,
            image=annotations.get(A_SNAPSHOT_IMAGE, ""),
            image_digest=annotations.get(A_SNAPSHOT_DIGEST, ""),
            # no tree hash: the control plane cannot read a CSI snapshot's files. The
            # fingerprint names the storage system's copy; what a restore is checked by
            # (services, probes, runtime state) is docs/snapshots.md "Kubernetes".
            fingerprint=f"csi:{status.get('boundVolumeSnapshotContentName') or name}",
            files=0,
            size_bytes=int(parse_quantity(size)) if size else 0,
            capture_s=time.monotonic() - started,
            captured_at=time.time(),
        )

    def _sandbox_pods(self, sandbox_id: str) -> list[dict[str, Any]]:
        """The sandbox's pods as JSON, by label (every generation, ended ones too); an
        API failure is a transient BackendError naming the sandbox."""
        try:
            pods, _ = self.api.list_json(
                self._path(self.pods), labelSelector=self.config.sandbox_selector(sandbox_id)
            )
        except ApiException as exc:
            raise BackendError(
                f"cannot list the pods of {sandbox_id}: {exc.status} {exc.reason}",
                transient=True,
            ) from exc
        return list(pods)

    def _running_pod(self, sandbox_id: str) -> dict[str, Any]:
        """The sandbox's running pod (its newest usable generation), as JSON."""
        try:
            pods = self._sandbox_pods(sandbox_id)
        except BackendError as exc:
            raise SnapshotFailed(str(exc)) from exc
        usable = [p for p in pods if pod_view(p).usable]
        if not usable:
            raise SnapshotFailed(
                f"sandbox {sandbox_id} has no running pod", code="sandbox_not_running"
            )
        return max(usable, key=lambda p: pod_view(p).generation or 0)

    def _wait_snapshot_ready(self, name: str) -> dict[str, Any]:
        """Reads the VolumeSnapshot until ``status.readyToUse``; SnapshotFailed on an
        ``status.error`` (the CSI driver's message), on its disappearance, or when
        ``snapshot_ready_timeout_s`` has passed."""
        timeout = self.config.snapshot_ready_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            obj = self._read_volume_snapshot(name)
            if obj is None:
                raise SnapshotFailed(f"VolumeSnapshot {name} was deleted while capturing")
            status = obj.get("status") or {}
            if status.get("readyToUse") is True:
                return obj
            error = status.get("error") or {}
            if error.get("message"):
                raise SnapshotFailed(f"the CSI snapshot of {name} failed: {error['message']}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SnapshotFailed(
                    f"VolumeSnapshot {name} not readyToUse after {timeout:g}s "
                    f"(class {self.config.snapshot_class!r})",
                    code="snapshot_timeout",
                )
            time.sleep(min(self.config.snapshot_poll_s, remaining))

    def _read_volume_snapshot(self, name: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = self.api.call(
                self.api.custom.get_namespaced_custom_object,
                SNAPSHOT_GROUP,
                SNAPSHOT_VERSION,
                self.config.namespace,
                "volumesnapshots",
                name,
            )
        except ApiException as exc:
            if is_status(exc, 404):
                return None
            raise BackendError(
                f"cannot read VolumeSnapshot {name}: {exc.status} {exc.reason}", transient=True
            ) from exc
        return obj

    def _delete_volume_snapshot(self, name: str) -> None:
        try:
            self.api.call(
                self.api.custom.delete_namespaced_custom_object,
                SNAPSHOT_GROUP,
                SNAPSHOT_VERSION,
                self.config.namespace,
                "volumesnapshots",
                name,
            )
        except ApiException as exc:
            if not is_status(exc, 404):
                raise BackendError(
                    f"cannot delete VolumeSnapshot {name}: {exc.status} {exc.reason}",
                    transient=True,
                ) from exc

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Deletes the VolumeSnapshot (the CSI driver then removes its content, once
        no claim is still being restored from it). Idempotent; restored sandboxes keep
        their own claims."""
        name = snapshot_object_name(snapshot_id)
        if not self.config.snapshots_enabled:
            raise SnapshotNotFound(f"no snapshot {snapshot_id}: the kubernetes backend keeps none")
        self._delete_volume_snapshot(name)

    def snapshots(self) -> list[str]:
        """Ids of this installation's VolumeSnapshots (the reconciler and the audit
        compare them with the records); [] without snapshots configured."""
        if not self.config.snapshots_enabled:
            return []
        ns = self.config.namespace
        path = f"/apis/{SNAPSHOT_GROUP}/{SNAPSHOT_VERSION}/namespaces/{ns}/volumesnapshots"
        try:
            listed = self.api.list_metadata(
                path, self.config.selector(**{L_COMPONENT: COMPONENT_SNAPSHOT})
            )
        except ApiException as exc:
            raise BackendError(
                f"cannot list VolumeSnapshots: {exc.status} {exc.reason}", transient=True
            ) from exc
        ids = []
        for obj in listed:
            sid = ((obj.get("metadata") or {}).get("labels") or {}).get(L_SNAPSHOT, "")
            if _valid_id(sid):
                ids.append(sid)
        return sorted(ids)

    def _restore_image(self, spec: SandboxSpec) -> str:
        """The image a restore runs: the snapshot's, pinned by the digest its sandbox
        ran. The VolumeSnapshot must exist and be ready (SnapshotNotFound otherwise);
        another image is refused, as on the local backend."""
        name = snapshot_object_name(spec.snapshot_id)
        if not self.config.snapshots_enabled:
            raise SnapshotNotFound(f"no snapshot {spec.snapshot_id} on the kubernetes backend")
        obj = self._read_volume_snapshot(name)
        if obj is None or (obj.get("metadata") or {}).get("deletionTimestamp"):
            raise SnapshotNotFound(f"no snapshot {spec.snapshot_id} (VolumeSnapshot {name})")
        if (obj.get("status") or {}).get("readyToUse") is not True:
            raise SnapshotNotFound(f"VolumeSnapshot {name} is not readyToUse")
        annotations = (obj.get("metadata") or {}).get("annotations") or {}
        image = annotations.get(A_SNAPSHOT_IMAGE, "")
        if image != spec.image:
            raise BackendError(
                f"snapshot {spec.snapshot_id} is of image {image!r}, not {spec.image!r}"
            )
        digest = annotations.get(A_SNAPSHOT_DIGEST, "")
        return f"{image}@{digest}" if digest.startswith("sha256:") else image

    # ---- metrics (the pod's cgroups are the kubelet's: metrics-server is not read yet)

    def metrics(self, sandbox_id: str) -> SandboxMetrics:
        check_sandbox_id(sandbox_id)
        raise MetricsUnavailable("the kubernetes backend does not read sandbox metrics yet")

    # ---- provision ---------------------------------------------------------------

    def prepare(self) -> None:
        """Nothing to make ahead: the cluster's nodes hold no per-installation state
        that a first provision would build."""

    def provision(self, spec: SandboxSpec, progress: ProgressCallback | None = None) -> Endpoint:
        check_sandbox_id(spec.sandbox_id)
        spec = dataclasses.replace(spec, image=self._image_ref(spec.image))
        if spec.snapshot_id:  # checked before anything is created
            spec = dataclasses.replace(spec, image=self._restore_image(spec))
        self.informer.unsilence(spec.sandbox_id)
        self.ensure_namespace_policy()
        if self.config.informer_everywhere:
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
            # The pod first: its Secrets and egress policy are owned by it (owner
            # references to its uid), so the garbage collector deletes them with it and
            # no process needs to list secrets to find them. The kubelet waits for the
            # Secret volume (and retries the pull secret) until they exist, a moment later.
            pod = build_pod(self.config, spec)
            egress_allow.apply_pod_dns(pod, self.config, spec.egress_policy)
            created = self._create_or_adopt(self.pods, pod)
            owned.append((self.pods, pod.metadata.name))
            self._check_user_namespace(created)
            owner = owner_reference(created)
            if self.config.snapshots_enabled:
                # the state claim is the pod's too: deleting the pod (destroy, a pause,
                # a new generation) deletes it; its VolumeSnapshots are owned by nothing
                claim = build_state_claim(self.config, spec)
                claim.metadata.owner_references = [owner]
                # not in ``owned``: a rollback deletes the pod, and the claim goes with it
                self._create_or_adopt(self.claims, claim)
            pull_secret = build_pull_secret(self.config, spec)
            if pull_secret is not None:
                pull_secret.metadata.owner_references = [owner]
                self._create_or_adopt(self.secrets, pull_secret)
                owned.append((self.secrets, pull_secret.metadata.name))
            secret = build_secret(self.config, spec)
            secret.metadata.owner_references = [owner]
            self._create_or_adopt(self.secrets, secret)
            owned.append((self.secrets, secret.metadata.name))
            if spec.network_access:
                policy = egress_allow.egress_policy_for(self.config, spec) or build_egress_policy(
                    self.config, spec
                )
                policy.metadata.owner_references = [owner]
                self._create_or_adopt(self.policies, policy)
                owned.append((self.policies, policy.metadata.name))
                fqdn = egress_allow.build_cilium_policy(self.config, spec)
                if fqdn is not None and self.cilium is not None:
                    fqdn["metadata"]["ownerReferences"] = [_owner_json(owner)]
                    self._put(self.cilium, fqdn["metadata"]["name"], fqdn)
                    owned.append((self.cilium, fqdn["metadata"]["name"]))
            return self._wait_started(pod.metadata.name, spec.image, progress)
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
        """The default-deny policy exists before any sandbox pod does: applied once per
        process here; ``converge`` (every reconciler round) re-applies it."""
        if self._namespace_policy_ok:
            return
        self.converge_namespace_policy()
        self._namespace_policy_ok = True

    def converge(self) -> dict[str, int]:
        """The reconciler's hook: what must hold in the cluster whatever happened to
        it. Returns counts of what it had to restore."""
        return {"namespace_policy_restored": int(self.converge_namespace_policy())}

    def converge_namespace_policy(self) -> bool:
        """Server-side applies the namespace's default-deny policy (field manager
        ``hedgerow``, forced): created when missing, edited fields restored. A field
        apply does not own (a narrowed podSelector, an extra rule another manager
        added to a map) is replaced with the whole spec. Refuses an object of that name
        that is not this installation's. Returns whether anything had to change."""
        body = build_namespace_policy(self.config)
        name, ns = body.metadata.name, self.config.namespace
        desired = self.api.api_client.sanitize_for_serialization(body)
        try:
            existing = self.api.call(self.policies.read, name, ns)
        except ApiException as exc:
            if not is_status(exc, 404):
                raise BackendError(
                    f"cannot read the namespace policy: {exc.status} {exc.reason}", transient=True
                ) from exc
            existing = None
        if existing is not None:
            labels = existing.metadata.labels or {}
            # extra labels (kustomize's part-of, …) are fine; ours must all be there
            if any(labels.get(k) != v for k, v in body.metadata.labels.items()):
                raise BackendError(
                    f"network policy {name} exists but is not this "
                    "installation's; refusing to run sandboxes without it"
                )
            if self._spec_of(existing) == desired["spec"]:
                return False
        path = f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/{name}"
        try:
            applied = self.api.apply(path, desired, "V1NetworkPolicy")
            if self._spec_of(applied) != desired["spec"]:
                replacement = dict(desired)
                replacement["metadata"] = dict(
                    desired["metadata"],
                    resourceVersion=applied.metadata.resource_version,
                    labels={**(applied.metadata.labels or {}), **desired["metadata"]["labels"]},
                )
                self.api.call(self.api.net.replace_namespaced_network_policy, name, ns, replacement)
        except ApiException as exc:
            raise BackendError(
                f"cannot apply the namespace policy: {exc.status} {_message(exc)}", transient=True
            ) from exc
        log.warning("namespace policy %s %s", name, "restored" if existing else "created")
        return True

    def _spec_of(self, policy: Any) -> Any:
        return self.api.api_client.sanitize_for_serialization(policy.spec)

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

    def _wait_started(
        self, pod_name: str, image: str, progress: ProgressCallback | None = None
    ) -> Endpoint:
        deadline = time.monotonic() + self.config.ready_timeout_s
        view = None
        if self.informer.running:
            view = self.informer.wait(
                pod_name, min(self.config.wait_stall_s, deadline - time.monotonic())
            )
        if view is None or not view.settled:
            # not started yet, or the informer is stalled (a dead watch connection that
            # has not timed out): read the pod and watch it alone until the deadline
            view = self._wait_scoped(pod_name, deadline, view, progress)
        if view is None:
            raise BackendError(f"pod {pod_name} never appeared in the watch", transient=True)
        if view.running and view.ip and not view.deleting and not view.lost_code:
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
        if view.lost_code:
            raise BackendError(f"pod {pod_name} failed: {view.lost_message}")
        if view.problem or view.terminal:
            raise BackendError(f"pod {pod_name} failed: {view.problem or view.phase}")
        if view.deleting:
            raise BackendError(f"pod {pod_name} was deleted while starting")
        waiting = view.pending_reason or f"phase {view.phase}"
        raise BackendError(
            f"pod {pod_name} not started after {self.config.ready_timeout_s:.0f}s ({waiting})"
        )

    def _wait_scoped(
        self,
        name: str,
        deadline: float,
        last: PodView | None,
        progress: ProgressCallback | None,
    ) -> PodView | None:
        """Waits for one pod by itself: a GET, then a WATCH with the field selector
        ``metadata.name=<pod>`` from the version read (again after a 410 or when the
        watch ends). Image pulls that fail and back off are reported as progress
        (``pull_backoff`` with the registry's message) and waited out."""
        ns = self.config.namespace
        told = ""

        def seen(view: PodView) -> PodView:
            nonlocal told, last
            view = keep_registry_message(view, last)
            last = view
            self.informer.observe(view)
            if progress is not None and view.pull_reason and view.pull_message != told:
                told = view.pull_message
                progress({"phase": "pull_backoff", "message": f"{view.pull_reason}: {told}"[:500]})
            return view

        while (remaining := deadline - time.monotonic()) > 0:
            try:
                pod = self.api.call(self.pods.read, name, ns)
            except ApiException as exc:
                if is_status(exc, 404):
                    return dataclasses.replace(last, deleting=True) if last else None
                raise BackendError(
                    f"cannot read pod {name}: {exc.status} {exc.reason}", transient=True
                ) from exc
            view = seen(pod_view(self.api.api_client.sanitize_for_serialization(pod)))
            if view.settled:
                return view
            stream = RawWatch()
            try:
                for event in stream.stream(
                    self.api.core.list_namespaced_pod,
                    ns,
                    field_selector=f"metadata.name={name}",
                    resource_version=view.resource_version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=max(1, int(remaining)),
                    _request_timeout=int(remaining) + 10,
                ):
                    if event["type"] == "BOOKMARK":
                        continue
                    view = seen(pod_view(event["raw_object"]))
                    if event["type"] == "DELETED":
                        return dataclasses.replace(view, deleting=True)
                    if view.settled or time.monotonic() >= deadline:
                        return view
            except ApiException as exc:
                if not is_status(exc, 410):
                    log.warning("watch of pod %s failed: %s", name, exc)
            finally:
                stream.stop()
        return last

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
        policies; ``keep``: a generation to spare. Secrets are never listed (the Role
        grants no ``list secrets``): they are owned by their pod and go with it (the
        garbage collector), and an older generation's are also deleted by name."""
        selector = self.config.sandbox_selector(sandbox_id)
        kinds = (self.pods, self.policies, *((self.cilium,) if self.cilium else ()))
        if keep is None:
            # one request per kind, whatever the number of generations
            for kind in kinds:
                self.api.call(
                    kind.delete_collection,
                    self.config.namespace,
                    label_selector=selector,
                    **_grace(kind),
                )
            return
        older: set[int] = set()
        for kind in kinds:
            for meta in self.api.list_metadata(self._path(kind), selector):  # metadata only
                generation = generation_of((meta.get("metadata") or {}).get("labels"))
                if generation != keep:
                    self._delete(kind, meta["metadata"]["name"])
                    if generation is not None:
                        older.add(generation)
        for generation in sorted(older):
            for suffix in ("-token", "-pull"):
                self._delete(self.secrets, object_name(sandbox_id, generation, suffix))

    def _path(self, kind: Kind) -> str:
        ns = self.config.namespace
        if kind is self.policies:
            return f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"
        if kind is self.cilium:
            group = f"{egress_allow.CILIUM_GROUP}/{egress_allow.CILIUM_VERSION}"
            return f"/apis/{group}/namespaces/{ns}/{egress_allow.CILIUM_PLURAL}"
        return f"/api/v1/namespaces/{ns}/{'pods' if kind is self.pods else 'secrets'}"

    def _delete(self, kind: Kind, name: str, grace_s: int | None = None) -> None:
        grace = _grace(kind) if grace_s is None else {"grace_period_seconds": grace_s}
        try:
            self.api.call(kind.delete, name, self.config.namespace, **grace)
        except ApiException as exc:
            if not is_status(exc, 404):
                raise BackendError(
                    f"cannot delete {kind.name} {name}: {exc.status} {exc.reason}",
                    transient=True,
                ) from exc

    # ---- endpoint, inventory, reclaim ----------------------------------------------

    def endpoint(self, sandbox_id: str) -> Endpoint | None:
        check_sandbox_id(sandbox_id)
        if self.config.informer_everywhere:
            self.informer.ensure_started()
        if self.informer.running:
            live = [p for p in self.informer.for_sandbox(sandbox_id) if self.informer.usable(p)]
        else:  # no informer in this process: that sandbox's pods, by label
            live = [v for v in map(pod_view, self._sandbox_pods(sandbox_id)) if v.usable]
        if not live:
            return None
        best = max(live, key=lambda p: p.generation or 0)
        return Endpoint(
            best.ip, self.config.agent_port, self.isolation, best.node, best.image_digest
        )

    def inventory(self) -> list[InventoryItem]:
        """Pods and network policies of this installation, listed afresh (not from
        the informer's cache), paginated, policies as metadata only. Secrets are not
        listed (no process may ``list secrets``): each is owned by its pod, so the
        garbage collector removes it with the pod and it cannot outlive it.

        A pod whose containers ended is ``pod_exited``; one that is lost (evicted,
        disrupted, OOM-killed) ``pod_lost``: neither holds a running agent, both are
        resources to remove. A pod deleted less than ``terminating_grace_s`` ago is a
        deletion in progress, not a leak, and is left out; one deleted longer ago (its
        node is gone, its kubelet never confirms) is ``pod_terminating``, reclaimed by
        a forced deletion."""
        items: list[InventoryItem] = []
        selector = self.config.sandbox_selector()
        now = datetime.now(UTC)
        try:
            pods, _ = self.api.list_json(self._path(self.pods), labelSelector=selector)
            # metadata only, and never secrets: they are owned by their pod
            metadata = [
                (kind.name, self.api.list_metadata(self._path(kind), selector))
                for kind in (self.policies, *((self.cilium,) if self.cilium else ()))
            ]
        except ApiException as exc:
            raise BackendError(f"cannot list the inventory: {exc.status} {exc.reason}") from exc
        for pod in pods:  # the API server's JSON: no generated models (see list_json)
            meta = pod.get("metadata") or {}
            phase = (pod.get("status") or {}).get("phase")
            name = "pod"
            deleted = meta.get("deletionTimestamp")
            if deleted is not None:
                age = (now - _timestamp(deleted)).total_seconds()
                if age < self.config.terminating_grace_s:
                    continue
                name = "pod_terminating"
            elif phase in ("Failed", "Succeeded"):
                name = "pod_exited"
            elif pod.get("status") and pod_view(pod).lost_code:
                name = "pod_lost"
            node = (pod.get("spec") or {}).get("nodeName") or ""
            items.append(_item(name, meta.get("name") or "", meta.get("labels"), node))
        for kind, listed in metadata:
            for obj in listed:
                meta_d = obj.get("metadata") or {}
                items.append(_item(kind, meta_d.get("name", ""), meta_d.get("labels"), ""))
        return items

    def reclaim(self, item: InventoryItem) -> None:
        kinds = {"pod": self.pods, "pod_exited": self.pods, "pod_lost": self.pods}
        kinds.update({"network_policy": self.policies, "secret": self.secrets})
        if self.cilium is not None:
            kinds[self.cilium.name] = self.cilium
        if item.kind == "pod_terminating":
            # its kubelet never confirmed (node lost): force the deletion, or the name
            # and the API object stay forever
            self._delete(self.pods, item.name, grace_s=0)
            return
        kind = kinds.get(item.kind)
        if kind is None:
            raise BackendError(f"unknown inventory kind {item.kind!r}")
        self._delete(kind, item.name)

    # ---- egress (egress_allow.py, docs/egress.md "Kubernetes") --------------------

    def set_egress(self, sandbox_id: str, policy: EgressPolicy) -> None:
        """Changes a running sandbox's policy: its ``-egress`` NetworkPolicy (and
        CiliumNetworkPolicy) replaced, created or deleted, which also carries the
        policy the resolver reads on the next query; then the resolved addresses the
        new policy no longer allows are closed (narrowing cuts what it must). A pod
        created without the resolver as its nameserver cannot take an allowlist (a
        pod's DNS is fixed when it is created)."""
        check_sandbox_id(sandbox_id)
        egress_allow.check_supported(self.config, policy)
        pods = self._sandbox_pods(sandbox_id)
        live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
        if not live:
            raise BackendError(f"sandbox {sandbox_id} has no pod")
        pod = max(live, key=lambda p: generation_of(p["metadata"].get("labels")) or 0)
        meta = pod["metadata"]
        if policy.mode == "allow" and not egress_allow.uses_resolver(pod, self.config):
            raise BackendError(
                "this sandbox's pod was created without the resolver as its nameserver "
                "(a pod's DNS cannot change): an allowlist must be given at create"
            )
        target = egress_allow.Target(
            sandbox_id=sandbox_id,
            tenant_id=(meta.get("labels") or {}).get(L_TENANT, ""),
            generation=generation_of(meta.get("labels")) or 0,
            egress_policy=policy,
        )
        owner = client.V1OwnerReference(
            api_version="v1", kind="Pod", name=meta["name"], uid=meta["uid"]
        )
        name = object_name(sandbox_id, target.generation, "-egress")
        body = egress_allow.egress_policy_for(self.config, target)
        if body is None and policy.mode == "all":
            body = build_egress_policy(self.config, target)
        try:
            if body is None:
                self._delete(self.policies, name)
            else:
                body.metadata.owner_references = [owner]
                self._put(self.policies, name, body)
            if self.cilium is not None:
                fqdn = egress_allow.build_cilium_policy(self.config, target)
                fqdn_name = object_name(sandbox_id, target.generation, "-fqdn")
                if fqdn is None:
                    self._delete(self.cilium, fqdn_name)
                else:
                    fqdn["metadata"]["ownerReferences"] = [_owner_json(owner)]
                    self._put(self.cilium, fqdn_name, fqdn)
            egress_allow.AllowlistEgress(self.api, self.policies, self.config).close_unallowed(
                sandbox_id, policy
            )
        except ApiException as exc:
            raise BackendError(
                f"cannot change the egress of {sandbox_id}: {exc.status} {exc.reason}",
                transient=True,
            ) from exc

    def _put(self, kind: Kind, name: str, body: Any) -> None:
        """Replaces ``name`` with ``body`` (an unconditional PUT), or creates it."""
        try:
            self.api.call(kind.replace, name, self.config.namespace, body)
        except ApiException as exc:
            if not is_status(exc, 404):
                raise
            self.api.call(kind.create, self.config.namespace, body)

    def dns_log(self, sandbox_id: str, limit: int = 1000) -> list[dict[str, Any]]:
        """The sandbox's DNS queries as the in-cluster resolver logged them (Redis,
        dnslog.py), oldest first."""
        check_sandbox_id(sandbox_id)
        return dnslog.read(redis_client(), self.config.instance, sandbox_id, limit)

    # ---- events --------------------------------------------------------------------

    def watch(self, timeout_s: float) -> Iterator[BackendEvent]:
        self.informer.ensure_started()
        deadline = time.monotonic() + timeout_s
        while True:
            self.informer.sweep()  # pods not Ready beyond the bound produce no event
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                yield self.informer.events.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue

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
        r"network is unreachable|connection reset|toomanyrequests|too many requests|"
        r"rate limit", re.I)),
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


def owner_reference(pod: Any) -> client.V1OwnerReference:
    """Makes an object a dependent of the sandbox's pod: deleted with it by the
    garbage collector (background propagation), whoever deletes the pod."""
    return client.V1OwnerReference(
        api_version="v1", kind="Pod", name=pod.metadata.name, uid=pod.metadata.uid
    )


def _owner_json(owner: client.V1OwnerReference) -> dict[str, Any]:
    return {
        "apiVersion": owner.api_version,
        "kind": owner.kind,
        "name": owner.name,
        "uid": owner.uid,
    }


def _cilium_kind(api: KubeApi) -> Kind:
    """CiliumNetworkPolicies through the custom objects API, with the signatures of
    the other kinds (``name, namespace`` / ``namespace, body``)."""
    custom = api.custom
    g, v, p = egress_allow.CILIUM_GROUP, egress_allow.CILIUM_VERSION, egress_allow.CILIUM_PLURAL
    return Kind(
        "cilium_network_policy",
        lambda ns, body, **kw: custom.create_namespaced_custom_object(g, v, ns, p, body, **kw),
        lambda name, ns, **kw: custom.get_namespaced_custom_object(g, v, ns, p, name, **kw),
        lambda name, ns, **kw: custom.delete_namespaced_custom_object(g, v, ns, p, name, **kw),
        lambda ns, **kw: custom.list_namespaced_custom_object(g, v, ns, p, **kw),
        lambda ns, **kw: custom.delete_collection_namespaced_custom_object(g, v, ns, p, **kw),
        lambda name, ns, body, **kw: custom.replace_namespaced_custom_object(
            g, v, ns, p, name, body, **kw
        ),
    )


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


def _timestamp(value: str) -> datetime:
    """An API server timestamp (RFC 3339, ``2026-01-02T03:04:05Z``) as an aware time."""
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _item(kind: str, name: str, labels: dict[str, str] | None, node: str) -> InventoryItem:
    labels = labels or {}
    sid = labels.get(L_SANDBOX) or None
    valid = sid is not None and _valid_id(sid)
    return InventoryItem(kind, name, sid if valid else None, generation_of(labels), node)


def _valid_id(sandbox_id: str) -> bool:
    try:
        check_sandbox_id(sandbox_id)
    except BackendError:
        return False
    return True


def pod_name(sandbox_id: str, generation: int) -> str:
    return object_name(sandbox_id, generation)


__all__ = ["KubernetesBackend", "client", "pod_name"]
