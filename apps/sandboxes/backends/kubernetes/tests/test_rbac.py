"""Least privilege, proved by walking the API: every request each process's backend
makes against the FAKE API server (method and path → API group, resource, verb) must
be granted by the Role bound to that process's ServiceAccount in deploy/, each Role
grants nothing its processes do not use, and nothing grants `list secrets`."""

from __future__ import annotations

import functools
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from apps.sandboxes.backends.base import BackendError, RegistryCredentials
from apps.sandboxes.backends.kubernetes import KubernetesBackend
from apps.sandboxes.backends.kubernetes.config import sandbox_labels
from apps.sandboxes.backends.kubernetes.egress_allow import AllowlistEgress
from apps.sandboxes.backends.kubernetes.permissions import REQUIRED

from .conftest import NS, eventually, new_spec
from .fakekube import FakeKube, request_verb
from .test_manifests import build

Verb = tuple[str, str, str]  # (api group, resource, verb)


def verb_of(method: str, path: str, query: dict[str, list[str]]) -> Verb:
    return request_verb(method, path, query)


def walk(fake: FakeKube, action: Callable[[], object]) -> set[Verb]:
    start = len(fake.requests)
    action()
    with fake.cond:  # watches included
        return {verb_of(*call) for call in fake.requests[start:]}


def worker_calls(fake: FakeKube, make_backend: Callable[..., KubernetesBackend]) -> set[Verb]:
    """Everything a Celery worker runs: provision (with network, a private image, a
    retried task that adopts, a new generation, a pod that takes its time), destroy,
    the reconciler's convergence and inventory, reclaim, allowlist egress."""
    backend = make_backend(resolver_ip="10.96.0.53")
    used: set[Verb] = set()
    fake.auto_start = True
    spec = new_spec(
        network_access=True,
        registry_credentials=RegistryCredentials("u", "p"),
        image="busybox:stable",
    )
    used |= walk(fake, lambda: backend.provision(spec))
    used |= walk(fake, lambda: backend.provision(spec))  # a redelivered task: adopts
    used |= walk(
        fake, lambda: backend.provision(new_spec(sandbox_id=spec.sandbox_id, generation=2))
    )
    fake.auto_start = False
    slow = new_spec()
    name = f"hr-{slow.sandbox_id}-1"

    def kubelet() -> None:  # starts the pod once the worker watches it
        eventually(lambda: fake.count("GET", "/pods", fieldSelector=f"metadata.name={name}"))
        fake.set_pod_status(NS, name, phase="Running", pod_ip="10.9.9.9", running=True)

    thread = threading.Thread(target=kubelet, daemon=True)
    thread.start()
    used |= walk(fake, lambda: backend.provision(slow))  # GET, then a name-scoped watch
    thread.join()
    net = client.NetworkingV1Api(backend.api.api_client)
    net.patch_namespaced_network_policy(
        "hedgerow-t1-default", NS, {"spec": {"podSelector": {"matchLabels": {"x": "y"}}}}
    )
    used |= walk(fake, backend.converge)  # server-side apply, then a replace
    items: list[Any] = []
    used |= walk(fake, lambda: items.extend(backend.inventory()))
    for item in items:
        used |= walk(fake, functools.partial(backend.reclaim, item))
    egress = AllowlistEgress(backend.api, backend.policies, backend.config)
    labels = sandbox_labels(
        backend.config, tenant_id="42", sandbox_id=slow.sandbox_id, generation=1
    )
    used |= walk(
        fake,
        lambda: egress.resolved(
            labels=labels,
            sandbox_id=slow.sandbox_id,
            generation=1,
            name="pkg.example.org",
            answers=[("203.0.113.7", 0)],
            grace_s=0,
            now=1.0,
        ),
    )
    used |= walk(fake, egress.sweep)
    used |= walk(fake, lambda: backend.destroy(spec.sandbox_id))
    used |= snapshot_calls(fake, make_backend)
    return used


def snapshot_calls(fake: FakeKube, make_backend: Callable[..., KubernetesBackend]) -> set[Verb]:
    """With a VolumeSnapshotClass: provision (a state claim), capture, restore (a claim
    from the snapshot, retried: adopts), the reconciler's listing, delete, destroy."""
    backend = make_backend(snapshot_class="csi", read_only_root=True, snapshot_poll_s=0.01)
    fake.auto_start = True
    used: set[Verb] = set()
    spec = new_spec()
    used |= walk(fake, lambda: backend.provision(spec))
    snap = uuid.uuid4().hex
    used |= walk(fake, lambda: backend.snapshot(spec.sandbox_id, snap))
    child = new_spec(snapshot_id=snap)
    used |= walk(fake, lambda: backend.provision(child))
    used |= walk(fake, lambda: backend.provision(child))  # a redelivered task: adopts
    used |= walk(fake, backend.snapshots)
    used |= walk(fake, lambda: backend.delete_snapshot(snap))
    for sid in (spec.sandbox_id, child.sandbox_id):
        used |= walk(fake, functools.partial(backend.destroy, sid))
    fake.auto_start = False
    return used


def reader_calls(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend], *, watcher: bool
) -> set[Verb]:
    """The web process looks endpoints up (a warm-pool claim); the watcher runs the
    namespace's informer. Either may run an informer (HEDGEROW_K8S_INFORMER_EVERYWHERE)."""
    fake.auto_start = True
    worker = make_backend()
    spec = new_spec()
    worker.provision(spec)
    used: set[Verb] = set()
    for everywhere in (False, True):
        account = "hedgerow-watcher" if watcher else "hedgerow-web"
        backend = make_backend(account, informer_everywhere=everywhere)  # 403 beyond its Role
        informer = watcher or everywhere

        def act(backend: KubernetesBackend = backend, informer: bool = informer) -> None:
            watches = fake.count("GET", "/pods", watch="true")
            if watcher:
                list(backend.watch(0.1))
            else:
                assert backend.endpoint(spec.sandbox_id) is not None
            if informer:  # its WATCH follows the LIST, from its own thread
                eventually(lambda: fake.count("GET", "/pods", watch="true") > watches)

        used |= walk(fake, act)
        backend.close()
    return used


def granted(docs: list[dict[str, Any]], deployment: str) -> set[Verb]:
    """What the Roles bound to this workload's ServiceAccount grant (none without a
    mounted token)."""
    (workload,) = [
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == deployment
    ]
    pod = workload["spec"]["template"]["spec"]
    if pod.get("automountServiceAccountToken") is False:
        return set()
    account = pod["serviceAccountName"]
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Role"}
    rules = [
        rule
        for binding in docs
        if binding["kind"] == "RoleBinding"
        and {"kind": "ServiceAccount", "name": account, "namespace": "hedgerow"}
        in binding["subjects"]
        for rule in roles[binding["roleRef"]["name"]]["rules"]
    ]
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return build("deploy/overlays/example")


def test_the_worker_is_granted_exactly_what_it_calls(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend], docs: list[dict[str, Any]]
) -> None:
    used = worker_calls(fake, make_backend)
    assert used == granted(docs, "hedgerow-worker")
    assert used == REQUIRED["worker"]  # what the worker asks for at start-up
    assert not {v for v in used if v[1] == "secrets" and v[2] not in ("create", "get", "delete")}


@pytest.mark.parametrize(
    ("deployment", "watcher"), [("hedgerow-web", False), ("hedgerow-watcher", True)]
)
def test_the_web_and_the_watcher_only_read_pods(
    fake: FakeKube,
    make_backend: Callable[..., KubernetesBackend],
    docs: list[dict[str, Any]],
    deployment: str,
    watcher: bool,
) -> None:
    used = reader_calls(fake, make_backend, watcher=watcher)
    assert (
        used
        <= granted(docs, deployment)
        == {
            ("", "pods", "get"),
            ("", "pods", "list"),
            ("", "pods", "watch"),
        }
    )
    assert ("", "pods", "list") in used and ("", "pods", "watch") in used
    assert used == REQUIRED["watcher" if watcher else "web"]  # asked for at start-up


def test_beat_and_migrate_get_no_token_and_nothing_lists_secrets(
    docs: list[dict[str, Any]],
) -> None:
    for name in ("hedgerow-beat", "hedgerow-migrate"):
        (workload,) = [
            d
            for d in docs
            if d["kind"] in ("Deployment", "Job") and d["metadata"]["name"].startswith(name)
        ]
        pod = workload["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        (account,) = [
            d
            for d in docs
            if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == pod["serviceAccountName"]
        ]
        assert account["automountServiceAccountToken"] is False
        assert not [
            b
            for b in docs
            if b["kind"] == "RoleBinding"
            and any(s["name"] == account["metadata"]["name"] for s in b["subjects"])
        ]
    for role in (d for d in docs if d["kind"] in ("Role", "ClusterRole")):
        for rule in role["rules"]:
            if "secrets" in rule["resources"] or "*" in rule["resources"]:
                assert not {"list", "watch", "deletecollection", "*"} & set(rule["verbs"]), role
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    # every ServiceAccount's token is opt-in, per pod
    for account in (d for d in docs if d["kind"] == "ServiceAccount"):
        assert account["automountServiceAccountToken"] is False


def test_the_walk_sees_a_verb_no_role_grants() -> None:
    """The mapping the tests rely on: a request the Role does not cover shows."""
    assert verb_of("GET", f"/api/v1/namespaces/{NS}/secrets", {}) == ("", "secrets", "list")
    assert verb_of("DELETE", f"/api/v1/namespaces/{NS}/secrets", {}) == (
        "",
        "secrets",
        "deletecollection",
    )
    assert verb_of("GET", f"/api/v1/namespaces/{NS}/pods", {"watch": ["true"]}) == (
        "",
        "pods",
        "watch",
    )


def test_the_fake_refuses_what_a_role_does_not_grant(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    """The web's account cannot provision: the API server's 403, as a typed error."""
    web = make_backend("hedgerow-web")
    with pytest.raises(BackendError, match="403"):
        web.provision(new_spec())
    assert {f[1:] for f in fake.forbidden} == {("networking.k8s.io", "networkpolicies", "get")}
    fake.forbidden.clear()  # seen: the fixture fails a test on any other 403
