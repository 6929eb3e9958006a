"""What each process's ServiceAccount must be allowed, asked of the API server at
start-up (one SelfSubjectAccessReview per verb), so a Role missing a verb stops the
process with the whole list instead of failing the first sandbox that needs it.

The sets are the calls each process makes, as tests/test_rbac.py records them against
the fake API server (and deploy/'s Roles grant exactly these).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kubernetes import client

from .api import KubeApi

Permission = tuple[str, str, str]  # (api group, resource, verb)

_POD_READ: frozenset[Permission] = frozenset({("", "pods", "list"), ("", "pods", "watch")})

REQUIRED: dict[str, frozenset[Permission]] = {
    # the web looks endpoints up (and may run an informer: HEDGEROW_K8S_INFORMER_EVERYWHERE)
    "web": _POD_READ,
    # the watcher runs the namespace's informer
    "watcher": _POD_READ,
    # Celery workers provision, destroy, converge, inventory, reclaim, allow egress,
    # snapshot and restore
    "worker": _POD_READ
    | {
        ("", "pods", "get"),
        ("", "pods", "create"),
        ("", "pods", "delete"),
        ("", "pods", "deletecollection"),
        ("", "secrets", "create"),
        ("", "secrets", "get"),
        ("", "secrets", "delete"),
    }
    | {
        ("networking.k8s.io", "networkpolicies", verb)
        for verb in ("create", "get", "list", "patch", "update", "delete", "deletecollection")
    }
    # snapshots (docs/snapshots.md "Kubernetes"): the state claims and VolumeSnapshots
    | {("", "persistentvolumeclaims", verb) for verb in ("create", "get")}
    | {
        ("snapshot.storage.k8s.io", "volumesnapshots", v)
        for v in ("create", "get", "list", "delete")
    },
    # the in-cluster resolver (egress allowlists): finds the pod asking, reads its
    # policy, opens and closes the addresses it hands out
    "resolver": frozenset({("", "pods", "list")})
    | {
        ("networking.k8s.io", "networkpolicies", verb)
        for verb in ("create", "get", "list", "delete")
    },
}

ROLES = tuple(REQUIRED)

# with HEDGEROW_K8S_CNI=cilium the worker also keeps each allowlist sandbox's
# CiliumNetworkPolicy (deploy/overlays/cilium grants these)
CILIUM_WORKER: frozenset[Permission] = frozenset(
    ("cilium.io", "ciliumnetworkpolicies", verb)
    for verb in ("create", "list", "update", "delete", "deletecollection")
)


def required(role: str, cni: str = "") -> frozenset[Permission]:
    """What ``role`` needs with this CNI setting."""
    extra = CILIUM_WORKER if role == "worker" and cni == "cilium" else frozenset()
    return REQUIRED[role] | extra


def process_role(configured: str, argv: Sequence[str] | None = None) -> str:
    """The role this process plays: HEDGEROW_K8S_PROCESS_ROLE, else read from its
    command line (``celery … worker`` → worker, ``manage.py hedgerow_watch`` → watcher,
    anything else → web)."""
    if configured:
        if configured not in REQUIRED:
            raise ValueError(
                f"HEDGEROW_K8S_PROCESS_ROLE {configured!r} is not one of {', '.join(ROLES)}"
            )
        return configured
    args = list(sys.argv if argv is None else argv)
    if "hedgerow_watch" in args:
        return "watcher"
    if "hedgerow_k8s_resolver" in args:
        return "resolver"
    if any("celery" in a for a in args[:2]) and "worker" in args:
        return "worker"
    return "web"


def missing_permissions(api: KubeApi, role: str) -> list[Permission]:
    """The permissions of ``role`` the API server says this process's credentials lack
    in the sandbox namespace (sorted; [] = all granted)."""
    authz = client.AuthorizationV1Api(api.api_client)
    missing = []
    for group, resource, verb in sorted(required(role, api.config.cni)):
        review = client.V1SelfSubjectAccessReview(
            spec=client.V1SelfSubjectAccessReviewSpec(
                resource_attributes=client.V1ResourceAttributes(
                    namespace=api.config.namespace, group=group, resource=resource, verb=verb
                )
            )
        )
        answer = api.call(authz.create_self_subject_access_review, review)
        if not (answer.status and answer.status.allowed):
            missing.append((group, resource, verb))
    return missing


def describe(permission: Permission) -> str:
    group, resource, verb = permission
    return f"{verb} {resource}" + (f".{group}" if group else "")


def permission_refusal(api: KubeApi, role: str) -> str | None:
    """The refusal message when ``role``'s ServiceAccount lacks any permission."""
    missing = missing_permissions(api, role)
    if not missing:
        return None
    return (
        f"the {role} process's ServiceAccount lacks {len(missing)} permission(s) in "
        f"namespace {api.config.namespace!r}: {', '.join(describe(p) for p in missing)}. "
        "Grant them in its Role (deploy/base/rbac.yaml), or skip this check with "
        "HEDGEROW_K8S_SKIP_PERMISSION_CHECK=1; see docs/deploy-kubernetes.md "
        '"Permissions checked at start-up"'
    )
