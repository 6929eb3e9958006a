"""The objects one sandbox is made of, built with the official client's models.

* a Secret holding the agent token (never in the pod spec);
* a Pod: the user's image unmodified, an init container that copies the agent bundle
  (and the token) into emptyDirs, the main container starting the agent from the
  bundle through the launcher, probes on the agent's /health, requests = limits;
* a per-sandbox egress NetworkPolicy when network access is requested;
* with snapshots configured, a PersistentVolumeClaim holding /workspace and /tmp (from
  a VolumeSnapshot's data for a restore), and the VolumeSnapshots of captures;
* one namespace-wide NetworkPolicy (per installation) that denies all egress and all
  ingress except from the control plane's pods to the agent port.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Protocol

from kubernetes import client

from apps.sandboxes.backends.base import SandboxSpec

from .config import (
    A_DO_NOT_DISRUPT,
    A_LABELS,
    A_PIDS_LIMIT,
    A_SAFE_TO_EVICT,
    A_SNAPSHOT_DIGEST,
    A_SNAPSHOT_IMAGE,
    A_SNAPSHOT_SANDBOX,
    AGENT_CLIENT_LABEL,
    BUNDLE_MOUNT,
    BUNDLE_SOURCE,
    COMPONENT_NAMESPACE_POLICY,
    COMPONENT_SNAPSHOT,
    L_COMPONENT,
    L_GENERATION,
    L_INSTANCE,
    L_SANDBOX,
    L_SNAPSHOT,
    MANAGED_BY,
    MANAGED_BY_VALUE,
    SECRET_MOUNT,
    TOKEN_MOUNT,
    WORKSPACE,
    KubernetesConfig,
    check_image_ref,
    object_name,
    sandbox_labels,
    snapshot_object_name,
)

BUNDLE_VOLUME = "hedgerow-agent"
TOKEN_VOLUME = "hedgerow-token"
SECRET_VOLUME = "hedgerow-secret"
WORKSPACE_VOLUME = "workspace"
TMP_VOLUME = "tmp"
STATE_VOLUME = "state"  # with snapshots: the claim /workspace and /tmp are subPaths of
STATE_MOUNT = "/hedgerow-state"  # where the init container sees the whole claim
SNAPSHOT_GROUP = "snapshot.storage.k8s.io"
SNAPSHOT_VERSION = "v1"
TMP = "/tmp"  # an emptyDir of the pod's own, not the node's /tmp
TOKEN_KEY = "token"
BUNDLE_DIR = f"{BUNDLE_MOUNT}/bundle"


def launcher_argv(bundle: str, *args: str) -> list[str]:
    """Starts the bundled interpreter through the bundled loader: works with no shell,
    no Python and any libc in the image (see bundle/hedgerow_launcher.py)."""
    return [
        f"{bundle}/lib/ld.so",
        "--library-path",
        f"{bundle}/lib",
        f"{bundle}/bin/python3",
        "-I",
        "-m",
        "hedgerow_launcher",
        *args,
    ]


class Identity(Protocol):
    """What names and labels an object: a SandboxSpec, or egress_allow.Target."""

    @property
    def sandbox_id(self) -> str: ...
    @property
    def tenant_id(self) -> str: ...
    @property
    def generation(self) -> int: ...


def _meta(config: KubernetesConfig, spec: Identity, suffix: str = "") -> client.V1ObjectMeta:
    return client.V1ObjectMeta(
        name=object_name(spec.sandbox_id, spec.generation, suffix),
        namespace=config.namespace,
        labels=sandbox_labels(
            config,
            tenant_id=spec.tenant_id,
            sandbox_id=spec.sandbox_id,
            generation=spec.generation,
        ),
    )


def secret_name(spec: SandboxSpec) -> str:
    return object_name(spec.sandbox_id, spec.generation, "-token")


def egress_policy_name(spec: SandboxSpec) -> str:
    return object_name(spec.sandbox_id, spec.generation, "-egress")


def build_secret(config: KubernetesConfig, spec: SandboxSpec) -> client.V1Secret:
    meta = _meta(config, spec, "-token")
    return client.V1Secret(
        api_version="v1",
        kind="Secret",
        metadata=meta,
        type="Opaque",
        immutable=True,
        data={TOKEN_KEY: base64.b64encode(spec.agent_token.encode()).decode()},
    )


def pull_secret_name(spec: SandboxSpec) -> str:
    return object_name(spec.sandbox_id, spec.generation, "-pull")


def image_registry(image: str) -> str:
    """The registry host of an image reference, by Docker's rule: the first path
    component when it has a dot or a port or is ``localhost``; else Docker Hub."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


def build_pull_secret(config: KubernetesConfig, spec: SandboxSpec) -> client.V1Secret | None:
    """The tenant's login for the image's registry as the pod's own imagePullSecret
    (``kubernetes.io/dockerconfigjson``), labelled like the pod so it is created,
    listed and deleted with it; None for a public image. Never logged: the backend
    names it, never prints its data."""
    creds = spec.registry_credentials
    if creds is None:
        return None
    registry = image_registry(spec.image)
    auth = base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode()
    entry = {"username": creds.username, "password": creds.password, "auth": auth}
    auths = {registry: entry}
    if registry == "docker.io":  # the key Docker Hub logins traditionally have
        auths["https://index.docker.io/v1/"] = entry
    config_json = json.dumps({"auths": auths}, sort_keys=True).encode()
    return client.V1Secret(
        api_version="v1",
        kind="Secret",
        metadata=_meta(config, spec, "-pull"),
        type="kubernetes.io/dockerconfigjson",
        immutable=True,
        data={".dockerconfigjson": base64.b64encode(config_json).decode()},
    )


def _resources(config: KubernetesConfig, spec: SandboxSpec) -> client.V1ResourceRequirements:
    # requests = limits: Guaranteed QoS, so a sandbox is never squeezed by a neighbour
    # and its cost is exactly what it asked for. The agent bundle's emptyDir lives on
    # the node's disk too and counts in the pod's usage: its sizeLimit is added to the
    # sandbox's disk, so the scheduler reserves it and the tenant keeps the whole disk.
    amounts = {
        "cpu": f"{spec.cpu_millis}m",
        "memory": f"{spec.memory_mib}Mi",
        "ephemeral-storage": f"{spec.disk_mib + config.bundle_size_mib}Mi",
    }
    return client.V1ResourceRequirements(requests=dict(amounts), limits=dict(amounts))


def _probe(config: KubernetesConfig, *, period: int, failures: int) -> client.V1Probe:
    return client.V1Probe(
        http_get=client.V1HTTPGetAction(path="/health", port="agent", scheme="HTTP"),
        period_seconds=period,
        timeout_seconds=2,
        failure_threshold=failures,
        success_threshold=1,
    )


def _security(config: KubernetesConfig, *, add: tuple[str, ...]) -> client.V1SecurityContext:
    uid, non_root = config.main_user()
    return client.V1SecurityContext(
        allow_privilege_escalation=False,  # no_new_privs: setuid binaries grant nothing
        privileged=False,
        capabilities=client.V1Capabilities(drop=["ALL"], add=list(add) or None),
        seccomp_profile=client.V1SeccompProfile(type="RuntimeDefault"),
        # the runtime's masked and read-only /proc paths (/proc/sys, /proc/kcore, …)
        proc_mount="Default",
        read_only_root_filesystem=config.read_only_root,
        run_as_user=uid,
        run_as_group=uid,  # never the image's group 0 when the uid is forced
        run_as_non_root=non_root or None,
    )


def build_pod(config: KubernetesConfig, spec: SandboxSpec) -> client.V1Pod:
    check_image_ref(spec.image)
    meta = _meta(config, spec)
    meta.annotations = {
        A_LABELS: json.dumps(spec.labels, sort_keys=True),
        # Kubernetes has no per-pod pids field: the node's kubelet podPidsLimit applies
        # (docs/deploy-kubernetes.md); the request is recorded for operators.
        A_PIDS_LIMIT: str(spec.pids_limit),
        **disruption_annotations(config),
    }
    init = client.V1Container(
        name="hedgerow-agent-inject",
        image=config.injector_image,
        image_pull_policy="IfNotPresent",
        command=launcher_argv(
            BUNDLE_SOURCE,
            "inject",
            "--to",
            BUNDLE_DIR,
            "--token-from",
            f"{SECRET_MOUNT}/{TOKEN_KEY}",
            "--token-to",
            f"{TOKEN_MOUNT}/{TOKEN_KEY}",
            # the state claim's subPaths, made with the emptyDirs' modes (the kubelet
            # would make missing ones root's, unwritable by a non-root sandbox)
            *(("--state-dir", STATE_MOUNT) if config.snapshots_enabled else ()),
        ),
        resources=client.V1ResourceRequirements(
            requests={"cpu": "100m", "memory": "64Mi", "ephemeral-storage": "16Mi"},
            limits={"cpu": "100m", "memory": "64Mi", "ephemeral-storage": "16Mi"},
        ),
        security_context=client.V1SecurityContext(
            allow_privilege_escalation=False,
            privileged=False,
            read_only_root_filesystem=True,
            # root without capabilities: can read the root-owned 0400 Secret file and
            # write into the emptyDirs, nothing more
            run_as_user=0,
            run_as_non_root=False,
            capabilities=client.V1Capabilities(drop=["ALL"]),
            seccomp_profile=client.V1SeccompProfile(type="RuntimeDefault"),
            proc_mount="Default",
        ),
        volume_mounts=[
            client.V1VolumeMount(name=BUNDLE_VOLUME, mount_path=BUNDLE_MOUNT),
            client.V1VolumeMount(name=TOKEN_VOLUME, mount_path=TOKEN_MOUNT),
            client.V1VolumeMount(name=SECRET_VOLUME, mount_path=SECRET_MOUNT, read_only=True),
            *(
                [client.V1VolumeMount(name=STATE_VOLUME, mount_path=STATE_MOUNT)]
                if config.snapshots_enabled
                else []
            ),
        ],
    )
    main = client.V1Container(
        name="sandbox",
        image=spec.image,
        image_pull_policy="IfNotPresent",
        # The image's ENTRYPOINT/CMD are replaced by the launcher (an init that keeps
        # the pod alive as long as the agent lives); `env` is deliberately unset so the
        # image's own environment is what commands see.
        command=launcher_argv(
            BUNDLE_DIR,
            "run",
            "--",
            "--listen",
            f"0.0.0.0:{config.agent_port}",
            "--token-file",
            f"{TOKEN_MOUNT}/{TOKEN_KEY}",
            "--unlink-token",
            "--workdir",
            WORKSPACE,
        ),
        args=[],
        ports=[client.V1ContainerPort(name="agent", container_port=config.agent_port)],
        resources=_resources(config, spec),
        startup_probe=_probe(config, period=1, failures=max(int(config.ready_timeout_s), 1)),
        readiness_probe=_probe(config, period=5, failures=3),
        security_context=_security(config, add=config.capabilities),
        volume_mounts=[
            client.V1VolumeMount(name=BUNDLE_VOLUME, mount_path=BUNDLE_MOUNT, read_only=True),
            client.V1VolumeMount(name=TOKEN_VOLUME, mount_path=TOKEN_MOUNT),
            *_state_mounts(config),
        ],
        working_dir=WORKSPACE,
    )
    pod_spec = client.V1PodSpec(
        init_containers=[init],
        containers=[main],
        restart_policy="Never",  # a dead agent ends the pod: the watcher marks it lost
        automount_service_account_token=False,
        enable_service_links=False,
        host_network=False,
        host_pid=False,
        host_ipc=False,
        share_process_namespace=False,
        # a user namespace per pod: root in the sandbox is an unprivileged uid range on
        # the node; the backend checks the API server kept the field (UserNamespacesUnavailable)
        host_users=False if config.user_namespaces else None,
        termination_grace_period_seconds=2,
        security_context=client.V1PodSecurityContext(
            seccomp_profile=client.V1SeccompProfile(type="RuntimeDefault"),
        ),
        runtime_class_name=config.runtime_class or None,
        node_selector=dict(config.node_selector) or None,
        tolerations=[client.V1Toleration(**t) for t in config.tolerations]
        + node_lost_tolerations(config)
        or None,
        # the resolvers of docs/deploy-kubernetes.md "DNS", instead of the cluster's
        dns_policy="None" if config.dns_nameservers else None,
        dns_config=client.V1PodDNSConfig(nameservers=list(config.dns_nameservers))
        if config.dns_nameservers
        else None,
        image_pull_secrets=[
            client.V1LocalObjectReference(name=n)
            for n in (
                *config.image_pull_secrets,
                *([pull_secret_name(spec)] if spec.registry_credentials is not None else []),
            )
        ]
        or None,
        volumes=[
            client.V1Volume(
                name=BUNDLE_VOLUME,
                empty_dir=client.V1EmptyDirVolumeSource(size_limit=f"{config.bundle_size_mib}Mi"),
            ),
            client.V1Volume(
                name=TOKEN_VOLUME,
                empty_dir=client.V1EmptyDirVolumeSource(medium="Memory", size_limit="1Mi"),
            ),
            client.V1Volume(
                name=SECRET_VOLUME,
                secret=client.V1SecretVolumeSource(
                    secret_name=secret_name(spec), default_mode=0o400, optional=False
                ),
            ),
            *_state_volumes(config, spec),
        ],
    )
    return client.V1Pod(api_version="v1", kind="Pod", metadata=meta, spec=pod_spec)


def _state_mounts(config: KubernetesConfig) -> list[client.V1VolumeMount]:
    if config.snapshots_enabled:  # one claim, so one VolumeSnapshot captures both
        return [
            client.V1VolumeMount(name=STATE_VOLUME, mount_path=WORKSPACE, sub_path="workspace"),
            client.V1VolumeMount(name=STATE_VOLUME, mount_path=TMP, sub_path="tmp"),
        ]
    return [
        client.V1VolumeMount(name=WORKSPACE_VOLUME, mount_path=WORKSPACE),
        client.V1VolumeMount(name=TMP_VOLUME, mount_path=TMP),
    ]


def _state_volumes(config: KubernetesConfig, spec: SandboxSpec) -> list[client.V1Volume]:
    if config.snapshots_enabled:
        return [
            client.V1Volume(
                name=STATE_VOLUME,
                persistent_volume_claim=client.V1PersistentVolumeClaimVolumeSource(
                    claim_name=state_claim_name(spec)
                ),
            )
        ]
    # Writable even with a read-only root. Each is capped at the sandbox's disk by its
    # sizeLimit, and together (with the container's own writes) by the
    # ephemeral-storage limit: kubelet evicts the pod beyond either.
    return [
        client.V1Volume(
            name=WORKSPACE_VOLUME,
            empty_dir=client.V1EmptyDirVolumeSource(size_limit=f"{spec.disk_mib}Mi"),
        ),
        client.V1Volume(
            name=TMP_VOLUME,
            empty_dir=client.V1EmptyDirVolumeSource(size_limit=f"{spec.disk_mib}Mi"),
        ),
    ]


def state_claim_name(spec: SandboxSpec) -> str:
    return object_name(spec.sandbox_id, spec.generation, "-state")


def build_state_claim(
    config: KubernetesConfig, spec: SandboxSpec
) -> client.V1PersistentVolumeClaim:
    """The sandbox's /workspace and /tmp (snapshots configured): ReadWriteOnce, the
    sandbox's disk in size; a restore's is provisioned from the snapshot's
    VolumeSnapshot (``dataSource``), so the storage system copies (or clones) it."""
    source = None
    if spec.snapshot_id:
        source = client.V1TypedLocalObjectReference(
            api_group=SNAPSHOT_GROUP,
            kind="VolumeSnapshot",
            name=snapshot_object_name(spec.snapshot_id),
        )
    return client.V1PersistentVolumeClaim(
        api_version="v1",
        kind="PersistentVolumeClaim",
        metadata=_meta(config, spec, "-state"),
        spec=client.V1PersistentVolumeClaimSpec(
            access_modes=["ReadWriteOnce"],
            storage_class_name=config.snapshot_storage_class or None,
            resources=client.V1VolumeResourceRequirements(
                requests={"storage": f"{spec.disk_mib}Mi"}
            ),
            data_source=source,
        ),
    )


def build_volume_snapshot(
    config: KubernetesConfig,
    *,
    snapshot_id: str,
    sandbox_id: str,
    claim: str,
    image: str,
    image_digest: str,
) -> dict[str, Any]:
    """A ``snapshot.storage.k8s.io/v1`` VolumeSnapshot of the claim (a custom resource:
    the client has no model for it). Labelled with the installation and the snapshot
    id, owned by nothing: it outlives the sandbox's pod and claim (a pause), and the
    reconciler lists it against the snapshot records."""
    return {
        "apiVersion": f"{SNAPSHOT_GROUP}/{SNAPSHOT_VERSION}",
        "kind": "VolumeSnapshot",
        "metadata": {
            "name": snapshot_object_name(snapshot_id),
            "namespace": config.namespace,
            "labels": {
                MANAGED_BY: MANAGED_BY_VALUE,
                L_INSTANCE: config.instance,
                L_COMPONENT: COMPONENT_SNAPSHOT,
                L_SNAPSHOT: snapshot_id,
            },
            "annotations": {
                A_SNAPSHOT_SANDBOX: sandbox_id,
                A_SNAPSHOT_IMAGE: image,
                A_SNAPSHOT_DIGEST: image_digest,
            },
        },
        "spec": {
            "volumeSnapshotClassName": config.snapshot_class,
            "source": {"persistentVolumeClaimName": claim},
        },
    }


def disruption_annotations(config: KubernetesConfig) -> dict[str, str]:
    """Set deliberately either way: a sandbox cannot be moved, so a node autoscaler
    (cluster-autoscaler, Karpenter) that drains its node to consolidate ends it."""
    if config.protect_from_disruption:
        return {A_SAFE_TO_EVICT: "false", A_DO_NOT_DISRUPT: "true"}
    return {A_SAFE_TO_EVICT: "true"}


NODE_LOST_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def node_lost_tolerations(config: KubernetesConfig) -> list[client.V1Toleration]:
    """How long a sandbox pod stays bound to a node that stopped answering before the
    taint manager evicts it (DefaultTolerationSeconds would give 300 s): short, so its
    sandbox is marked lost (``node_lost``) instead of looking ready. An operator's own
    toleration for the same taint wins."""
    theirs = {t.get("key") for t in config.tolerations}
    return [
        client.V1Toleration(
            key=taint,
            operator="Exists",
            effect="NoExecute",
            toleration_seconds=config.node_lost_toleration_s,
        )
        for taint in NODE_LOST_TAINTS
        if taint not in theirs
    ]


def dns_peers(config: KubernetesConfig) -> list[client.V1NetworkPolicyPeer]:
    """Where a sandbox with network access may send DNS: the configured resolvers
    (``dns_cidrs``, ``dns_nameservers``), else the cluster DNS pods."""
    blocks = [*config.dns_cidrs, *(_host_cidr(ip) for ip in config.dns_nameservers)]
    if blocks:
        return [client.V1NetworkPolicyPeer(ip_block=client.V1IPBlock(cidr=c)) for c in blocks]
    return [
        client.V1NetworkPolicyPeer(
            namespace_selector=client.V1LabelSelector(
                match_labels={"kubernetes.io/metadata.name": config.dns_namespace}
            ),
            pod_selector=client.V1LabelSelector(match_labels=dict(config.dns_pod_labels)),
        )
    ]


def _host_cidr(address: str) -> str:
    return address if "/" in address else f"{address}/{128 if ':' in address else 32}"


def build_egress_policy(config: KubernetesConfig, spec: Identity) -> client.V1NetworkPolicy:
    """Allows this sandbox (this generation) to reach the internet and cluster DNS only."""
    meta = _meta(config, spec, "-egress")
    v4 = [c for c in config.egress_except if ":" not in c]
    v6 = [c for c in config.egress_except if ":" in c]
    dns_ports = [
        client.V1NetworkPolicyPort(protocol="UDP", port=53),
        client.V1NetworkPolicyPort(protocol="TCP", port=53),
    ]
    return client.V1NetworkPolicy(
        api_version="networking.k8s.io/v1",
        kind="NetworkPolicy",
        metadata=meta,
        spec=client.V1NetworkPolicySpec(
            pod_selector=client.V1LabelSelector(
                match_labels={
                    L_INSTANCE: config.instance,
                    L_SANDBOX: spec.sandbox_id,
                    L_GENERATION: str(spec.generation),
                }
            ),
            policy_types=["Egress"],
            egress=[
                client.V1NetworkPolicyEgressRule(
                    to=[
                        client.V1NetworkPolicyPeer(
                            ip_block=client.V1IPBlock(cidr="0.0.0.0/0", _except=v4 or None)
                        ),
                        client.V1NetworkPolicyPeer(
                            ip_block=client.V1IPBlock(cidr="::/0", _except=v6 or None)
                        ),
                    ]
                ),
                client.V1NetworkPolicyEgressRule(to=dns_peers(config), ports=dns_ports),
            ],
        ),
    )


def build_namespace_policy(config: KubernetesConfig) -> client.V1NetworkPolicy:
    """Every pod in the sandbox namespace: no egress at all, and ingress only from the
    control plane's agent clients to the agent port — one sandbox can never reach
    another's agent, whatever egress policy it has."""
    return client.V1NetworkPolicy(
        api_version="networking.k8s.io/v1",
        kind="NetworkPolicy",
        metadata=client.V1ObjectMeta(
            name=config.namespace_policy_name,
            namespace=config.namespace,
            labels={
                MANAGED_BY: MANAGED_BY_VALUE,
                L_INSTANCE: config.instance,
                L_COMPONENT: COMPONENT_NAMESPACE_POLICY,
            },
        ),
        spec=client.V1NetworkPolicySpec(
            pod_selector=client.V1LabelSelector(),  # {} = every pod in the namespace
            policy_types=["Ingress", "Egress"],
            ingress=[
                client.V1NetworkPolicyIngressRule(
                    _from=[
                        client.V1NetworkPolicyPeer(
                            namespace_selector=client.V1LabelSelector(
                                match_labels={
                                    "kubernetes.io/metadata.name": config.controlplane_namespace
                                }
                            ),
                            pod_selector=client.V1LabelSelector(
                                match_labels={AGENT_CLIENT_LABEL: "true"}
                            ),
                        ),
                        # a control plane outside the cluster (docs/deploy-kubernetes.md
                        # "Control plane outside the cluster")
                        *(
                            client.V1NetworkPolicyPeer(ip_block=client.V1IPBlock(cidr=cidr))
                            for cidr in config.agent_ingress_cidrs
                        ),
                    ],
                    ports=[client.V1NetworkPolicyPort(protocol="TCP", port=config.agent_port)],
                )
            ],
            egress=[],
        ),
    )
