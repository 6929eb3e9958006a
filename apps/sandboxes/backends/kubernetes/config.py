"""Configuration, object names and labels for the Kubernetes backend.

Every object the backend makes carries the same labels (managed-by, instance, tenant,
sandbox, generation, component): they are how the informer, the inventory and the
adoption rule find and recognise them. Names embed the sandbox id and generation, so
a replacement pod (new generation) never collides with one still terminating.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any

from apps.sandboxes.backends.base import BackendError

MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "hedgerow"
L_INSTANCE = "hedgerow.dev/instance"
L_TENANT = "hedgerow.dev/tenant"
L_SANDBOX = "hedgerow.dev/sandbox"
L_GENERATION = "hedgerow.dev/generation"
L_COMPONENT = "hedgerow.dev/component"
L_SNAPSHOT = "hedgerow.dev/snapshot"  # on a VolumeSnapshot: the snapshot's id
A_LABELS = "hedgerow.dev/labels"
A_PIDS_LIMIT = "hedgerow.dev/pids-limit"
# What node autoscalers may do with a sandbox pod (docs/deploy-kubernetes.md
# "Autoscalers"): a sandbox cannot move, so evicting it to shrink a node pool ends it.
A_SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
A_DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
AGENT_CLIENT_LABEL = "hedgerow.dev/agent-client"

COMPONENT_SANDBOX = "sandbox"
COMPONENT_NAMESPACE_POLICY = "namespace-policy"
COMPONENT_SNAPSHOT = "snapshot"
# annotations of a VolumeSnapshot: what the snapshot was taken of
A_SNAPSHOT_SANDBOX = "hedgerow.dev/sandbox"
A_SNAPSHOT_IMAGE = "hedgerow.dev/image"
A_SNAPSHOT_DIGEST = "hedgerow.dev/image-digest"

BUNDLE_SOURCE = "/hedgerow-bundle"  # where Dockerfile.agent-injector puts the bundle
BUNDLE_MOUNT = "/opt/hedgerow"  # emptyDir in the pod; the bundle is BUNDLE_MOUNT/bundle
TOKEN_MOUNT = "/run/hedgerow"  # memory-backed emptyDir the agent unlinks its token from
SECRET_MOUNT = "/var/run/hedgerow-secret"  # the Secret, mounted in the init container only
WORKSPACE = "/workspace"

# Cluster-internal and link-local ranges a sandbox with network access must still not
# reach: pod/service CIDRs of every common distribution sit inside the RFC 1918 and
# CGNAT blocks, and 169.254.0.0/16 holds the cloud metadata service (169.254.169.254).
DEFAULT_EGRESS_EXCEPT_V4 = (
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "169.254.0.0/16",
    "127.0.0.0/8",
)
DEFAULT_EGRESS_EXCEPT_V6 = ("fc00::/7", "fe80::/10", "::1/128")
# As root, package managers need these; everything else (NET_RAW, MKNOD, SYS_CHROOT,
# SETFCAP, NET_BIND_SERVICE, AUDIT_WRITE, SETPCAP) is dropped.
DEFAULT_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID")
# Who the sandbox's main container runs as (HEDGEROW_K8S_RUN_AS_USER, see
# docs/deploy-kubernetes.md): "auto" = the image's own user when a user namespace or a
# runtime class (gVisor/Kata) keeps pod root from being node root, else NONROOT_UID;
# "image" = the image's user always; "nonroot" = the image's user, which must not be
# root (kubelet refuses a root image); a number = that uid (and gid).
RUN_AS_MODES = ("auto", "image", "nonroot")
CNIS = ("", "cilium")  # the CNIs whose own egress policies the backend can render
NONROOT_UID = 65532  # the conventional "nonroot" uid (distroless); no host account has it

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_SANDBOX_ID = re.compile(r"^[0-9a-f]{32}$")
_UID = re.compile(r"^[1-9][0-9]{0,8}$")
_IMAGE_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}$")


@dataclass(frozen=True)
class KubernetesConfig:
    instance: str
    namespace: str = "hedgerow-sandboxes"
    controlplane_namespace: str = "hedgerow"
    injector_image: str = "hedgerow-agent-injector:latest"
    images: tuple[str, ...] = ("python:3.12-slim", "debian:bookworm-slim", "ubuntu:24.04")
    default_image: str = "python:3.12-slim"  # what the API's default image "host" maps to
    agent_port: int = 7777
    runtime_class: str = ""  # "gvisor", "kata", … ; "" = the cluster default
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    image_pull_secrets: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = DEFAULT_CAPABILITIES
    egress_except: tuple[str, ...] = DEFAULT_EGRESS_EXCEPT_V4 + DEFAULT_EGRESS_EXCEPT_V6
    dns_namespace: str = "kube-system"  # where cluster DNS runs (egress to it on port 53)
    dns_pod_labels: dict[str, str] = field(default_factory=lambda: {"k8s-app": "kube-dns"})
    # Egress allowlists (egress_allow.py, docs/egress.md "Kubernetes"): the ClusterIP of
    # the installation's in-cluster resolver; "" refuses allowlists.
    resolver_ip: str = ""
    # the port the resolver's pods listen on (the Service maps 53 to it): a
    # NetworkPolicy sees the pod after the Service's DNAT, so it allows this port too
    resolver_port: int = 5353
    # "cilium": allowlists also get a CiliumNetworkPolicy with toFQDNs rules (the CNI
    # learns the addresses from the DNS answers itself); "": NetworkPolicies only
    cni: str = ""
    ready_timeout_s: float = 120.0  # pod scheduled + image pulled + agent started
    max_concurrency: int = 8  # API calls in flight per process
    # API requests per second per process on average, and at once (a token bucket;
    # api.py); 0 qps: no rate limit (only max_concurrency)
    api_qps: float = 20.0
    api_burst: int = 40
    api_retries: int = 5  # attempts on 429/5xx/connection errors, exponential backoff
    api_timeout_s: float = 30.0
    watch_timeout_s: int = 240  # server-side timeout of one WATCH request; then resume
    terminating_grace_s: float = 60.0  # a deleting pod younger than this is not a leak
    # hostUsers: false — pod root is an unprivileged uid range on the node (needs
    # Kubernetes >= 1.30 with UserNamespacesSupport, on by default from 1.33; a cluster
    # that drops or refuses it fails provisioning with UserNamespacesUnavailable)
    user_namespaces: bool = True
    run_as_user: str = "auto"  # RUN_AS_MODES or a uid, see above
    read_only_root: bool = False  # readOnlyRootFilesystem; /workspace and /tmp stay writable
    # ---- runtime behaviour (docs/deploy-kubernetes.md "Runtime behaviour") ----------
    list_page_size: int = 500  # LISTs are paginated (limit/continue) by this many
    # a provision whose pod the informer has not shown started within this long reads
    # the pod itself (GET) and watches it alone (fieldSelector metadata.name)
    wait_stall_s: float = 10.0
    # a running pod whose Ready condition stays False this long (node unreachable,
    # agent unhealthy) is lost
    not_ready_lost_s: float = 60.0
    # tolerationSeconds for the node.kubernetes.io/not-ready and /unreachable taints:
    # how long a pod stays bound to a lost node before it is evicted (kube default 300)
    node_lost_toleration_s: int = 30
    # DNS of sandboxes with network access: resolvers as CIDRs egress may reach on port
    # 53 (NodeLocal DNSCache 169.254.20.10/32, GKE Cloud DNS 169.254.169.254/32, …);
    # with nameservers, pods get dnsPolicy None and exactly these resolvers. Neither:
    # the cluster DNS pods (dns_namespace/dns_pod_labels).
    dns_cidrs: tuple[str, ...] = ()
    dns_nameservers: tuple[str, ...] = ()
    # sources outside the cluster (a control plane run with a kubeconfig) allowed to
    # reach agents on agent_port, beside the control plane's own pods
    agent_ingress_cidrs: tuple[str, ...] = ()
    # One LIST+WATCH of the namespace per installation: only the process that consumes
    # the backend's events (the watcher) runs the informer; workers and web processes
    # wait on their own pod (GET + a watch of that pod) and read endpoints with a
    # sandbox-scoped LIST. True: every process runs an informer of its own.
    informer_everywhere: bool = False
    # ---- operability (docs/deploy-kubernetes.md "Autoscalers", "Disk") -------------
    # True: sandbox pods carry safe-to-evict "false" (cluster-autoscaler) and
    # do-not-disrupt "true" (Karpenter): a node holding a sandbox is not drained to
    # consolidate. False: safe-to-evict "true", sandboxes may be ended to shrink the pool.
    protect_from_disruption: bool = True
    # sizeLimit of the emptyDir the agent bundle is copied into; counted in the main
    # container's ephemeral-storage on top of the sandbox's disk
    bundle_size_mib: int = 256
    # ---- snapshots (docs/snapshots.md "Kubernetes") --------------------------------
    # The VolumeSnapshotClass of captures; "" = no snapshots (``snapshots_unsupported``,
    # and /workspace and /tmp stay emptyDirs). Set: every sandbox's /workspace and /tmp
    # live on one PersistentVolumeClaim of ``snapshot_storage_class`` ("" = the
    # cluster's default), which a capture snapshots (CSI) and a restore is created from.
    snapshot_class: str = ""
    snapshot_storage_class: str = ""
    # how long a capture waits for its VolumeSnapshot's readyToUse before it fails
    # (``snapshot_timeout``, the object deleted), and how often it reads it meanwhile
    snapshot_ready_timeout_s: float = 300.0
    snapshot_poll_s: float = 0.5

    def __post_init__(self) -> None:
        if not _LABEL_VALUE.match(self.instance) or not self.instance:
            raise BackendError(f"instance {self.instance!r} is not a valid Kubernetes label")
        for ns in (self.namespace, self.controlplane_namespace):
            if not _DNS_LABEL.match(ns):
                raise BackendError(f"namespace {ns!r} is not a DNS label")
        if self.max_concurrency < 1 or self.api_retries < 1:
            raise BackendError("max_concurrency and api_retries must be >= 1")
        if self.api_qps < 0 or self.api_burst < 1:
            raise BackendError("api_qps must be >= 0 and api_burst >= 1")
        for cidr in (*self.dns_cidrs, *self.agent_ingress_cidrs, *self.dns_nameservers):
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError as exc:
                raise BackendError(f"{cidr!r} is not an IP address or CIDR") from exc
        if self.resolver_ip:
            try:
                ipaddress.IPv4Address(self.resolver_ip)
            except ValueError as exc:
                raise BackendError(
                    f"resolver_ip {self.resolver_ip!r} is not an IPv4 address"
                ) from exc
        if self.cni not in CNIS:
            raise BackendError(f"cni {self.cni!r} must be one of {', '.join(map(repr, CNIS))}")
        if self.run_as_user not in RUN_AS_MODES and not _UID.match(self.run_as_user):
            raise BackendError(
                f"run_as_user {self.run_as_user!r} must be one of {', '.join(RUN_AS_MODES)} "
                "or a uid >= 1 (use 'image' to run as the image's user, root included)"
            )
        for name in (self.snapshot_class, self.snapshot_storage_class):
            if name and not _DNS_SUBDOMAIN.match(name):
                raise BackendError(f"{name!r} is not a valid class name (DNS subdomain)")
        if self.snapshot_ready_timeout_s <= 0 or self.snapshot_poll_s <= 0:
            raise BackendError("snapshot_ready_timeout_s and snapshot_poll_s must be > 0")

    @property
    def snapshots_enabled(self) -> bool:
        return bool(self.snapshot_class)

    def main_user(self) -> tuple[int | None, bool]:
        """(runAsUser, runAsNonRoot) for the sandbox container; None = the image's user.

        Task images mostly run as root and need it (apt, pip into the system). Inside a
        user namespace, or under gVisor/Kata, that root is not root on the node, so the
        image's user is kept. Without either, root in the pod is root on the node (with
        the capabilities above), so "auto" runs the sandbox as NONROOT_UID instead."""
        if self.run_as_user == "image":
            return None, False
        if self.run_as_user == "nonroot":
            return None, True
        if self.run_as_user == "auto":
            if self.user_namespaces or self.runtime_class:
                return None, False
            return NONROOT_UID, True
        return int(self.run_as_user), True

    # ---- names and labels ---------------------------------------------------------

    def selector(self, **extra: str) -> str:
        """Label selector for this installation's sandbox objects."""
        parts = {MANAGED_BY: MANAGED_BY_VALUE, L_INSTANCE: self.instance}
        parts.update(extra)
        return ",".join(f"{k}={v}" for k, v in parts.items())

    def sandbox_selector(self, sandbox_id: str | None = None) -> str:
        extra = {L_COMPONENT: COMPONENT_SANDBOX}
        if sandbox_id is not None:
            extra[L_SANDBOX] = sandbox_id
        return self.selector(**extra)

    @property
    def namespace_policy_name(self) -> str:
        return f"hedgerow-{self.instance.lower().replace('_', '-')}-default"[:63].rstrip("-")


_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def startup_refusals(
    config: KubernetesConfig, *, allow_no_boundary: bool, allow_unpinned_injector: bool
) -> list[str]:
    """Why this configuration must not run sandboxes ([] = it may). Checked when the
    process starts (apps.sandboxes.apps) and when the backend is built."""
    refusals = []
    if not config.user_namespaces and not config.runtime_class and not allow_no_boundary:
        refusals.append(
            "sandbox pods would run with neither a user namespace "
            "(HEDGEROW_K8S_USER_NAMESPACES=false) nor a runtime class "
            "(HEDGEROW_K8S_RUNTIME_CLASS empty): root in a sandbox would be root on the "
            "node, held only by capabilities and seccomp. Turn user namespaces on, set a "
            "runtime class (gVisor, Kata), or accept it explicitly with "
            'HEDGEROW_K8S_ALLOW_NO_BOUNDARY=1; see docs/deploy-kubernetes.md "Pod security"'
        )
    if not _DIGEST.search(config.injector_image) and not allow_unpinned_injector:
        refusals.append(
            f"HEDGEROW_K8S_INJECTOR_IMAGE {config.injector_image!r} is not pinned by digest: "
            "the agent every sandbox runs would be whatever the tag points at when a node "
            "pulls it. Use <image>@sha256:<digest> (docker buildx imagetools inspect "
            "<image>:<tag> prints it), or accept a tag explicitly with "
            "HEDGEROW_K8S_ALLOW_UNPINNED_INJECTOR=1"
        )
    if config.snapshots_enabled and not config.read_only_root:
        refusals.append(
            f"HEDGEROW_K8S_SNAPSHOT_CLASS is {config.snapshot_class!r} but the sandbox root "
            "is writable (HEDGEROW_K8S_READ_ONLY_ROOT=false): a snapshot captures the "
            "state volume (/workspace, /tmp) only, so writes to the image's own paths "
            "would be lost silently on restore. Set HEDGEROW_K8S_READ_ONLY_ROOT=true; see "
            'docs/snapshots.md "Kubernetes"'
        )
    return refusals


class UserNamespacesUnavailable(BackendError):
    """The cluster did not give the pod the user namespace it asked for (hostUsers:
    false): the API server refused the field or dropped it. Never run without it
    silently: the operator either enables the feature or sets
    HEDGEROW_K8S_USER_NAMESPACES=false knowingly."""

    code = "user_namespaces_unavailable"

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"{self.code}: the Kubernetes API server did not accept hostUsers: false "
            f"({detail}); enable user namespaces (Kubernetes >= 1.30, feature gate "
            "UserNamespacesSupport) or set HEDGEROW_K8S_USER_NAMESPACES=false, see "
            "docs/deploy-kubernetes.md"
        )


def object_name(sandbox_id: str, generation: int, suffix: str = "") -> str:
    check_sandbox_id(sandbox_id)
    return f"hr-{sandbox_id}-{generation}{suffix}"


def check_sandbox_id(sandbox_id: str) -> None:
    if not _SANDBOX_ID.match(sandbox_id):
        raise BackendError(f"invalid sandbox id {sandbox_id!r} (32 lowercase hex digits)")


def snapshot_object_name(snapshot_id: str) -> str:
    """The VolumeSnapshot of snapshot ``snapshot_id`` (32 hex digits, like a sandbox id)."""
    check_sandbox_id(snapshot_id)
    return f"hr-snap-{snapshot_id}"


def check_image_ref(image: str) -> None:
    if not _IMAGE_REF.match(image):
        raise BackendError(f"invalid image reference {image!r}")


def sandbox_labels(
    config: KubernetesConfig, *, tenant_id: str, sandbox_id: str, generation: int
) -> dict[str, str]:
    tenant = tenant_id if _LABEL_VALUE.match(tenant_id) else ""
    if not tenant:
        raise BackendError(f"tenant id {tenant_id!r} cannot be a label value")
    return {
        MANAGED_BY: MANAGED_BY_VALUE,
        L_INSTANCE: config.instance,
        L_TENANT: tenant,
        L_SANDBOX: sandbox_id,
        L_GENERATION: str(generation),
        L_COMPONENT: COMPONENT_SANDBOX,
    }


def identity(labels: dict[str, str] | None) -> tuple[str, str, str, str, str]:
    """What must match for an existing object to be adopted rather than refused."""
    labels = labels or {}
    return (
        labels.get(MANAGED_BY, ""),
        labels.get(L_INSTANCE, ""),
        labels.get(L_TENANT, ""),
        labels.get(L_SANDBOX, ""),
        labels.get(L_GENERATION, ""),
    )


def generation_of(labels: dict[str, str] | None) -> int | None:
    raw = (labels or {}).get(L_GENERATION, "")
    return int(raw) if raw.isdigit() else None
