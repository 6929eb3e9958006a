"""How the backend behaves when a real cluster misbehaves (issue 25, correctness): pods
of real clusters' shapes (``fixtures/pods/*.json``) driving the informer — eviction,
node loss, OOM kills, pull back-off — a stalled informer, the namespace policy drifting,
slow API servers, pagination. The real ``kubernetes`` client against the FAKE API server
(fakekube.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from kubernetes import client

from apps.sandboxes.backends.base import BackendError, BackendEvent, ImageUnavailable
from apps.sandboxes.backends.kubernetes import KubernetesBackend, build_kubernetes_backend
from apps.sandboxes.backends.kubernetes.specs import (
    build_egress_policy,
    build_namespace_policy,
    build_pod,
)

from .conftest import NS, eventually, kubelet_later, make_config, new_spec
from .fakekube import FakeKube, load_fixture
from .test_settings import kubeconfig

SERIALIZER = client.ApiClient()


def pod_name(spec: Any) -> str:
    return f"hr-{spec.sandbox_id}-1"


def events_of(backend: KubernetesBackend, sandbox_id: str) -> Callable[[], list[BackendEvent]]:
    seen: list[BackendEvent] = []

    def poll() -> list[BackendEvent]:
        seen.extend(e for e in backend.watch(0.2) if e.sandbox_id == sandbox_id)
        return [e for e in seen if e.kind in ("gone", "failed")]

    return poll


def ready_sandbox(fake: FakeKube, backend: KubernetesBackend) -> Any:
    fake.auto_start = True
    spec = new_spec()
    backend.provision(spec)
    fake.auto_start = False
    list(backend.watch(0.2))  # its ready event
    return spec


# ---- 1. node loss, eviction, disruption, deletions Hedgerow did not make ------------


def test_an_evicted_pod_ends_its_sandbox_as_evicted_with_the_kubelets_message(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    spec = ready_sandbox(fake, backend)
    fake.load_status(NS, pod_name(spec), "evicted")
    (event,) = eventually(events_of(backend, spec.sandbox_id))
    assert (event.kind, event.code) == ("failed", "evicted")
    assert "low on resource: ephemeral-storage" in event.reason
    assert "ContainerStatusUnknown" not in event.reason  # not "exited 137"
    assert backend.endpoint(spec.sandbox_id) is None


def test_a_pod_on_a_lost_node_ends_its_sandbox_although_it_stays_terminating(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    spec = ready_sandbox(fake, backend)
    # the taint manager evicts it (DisruptionTarget) and deletes it; the kubelet is
    # unreachable, so the pod never goes away and still says Running
    fixture = load_fixture("node_lost")
    stored = fake.load_status(NS, pod_name(spec), fixture)
    assert stored["status"]["phase"] == "Running" and stored["metadata"]["deletionTimestamp"]
    (event,) = eventually(events_of(backend, spec.sandbox_id))
    assert (event.kind, event.code) == ("gone", "node_lost")
    assert "DeletionByTaintManager" in event.reason
    assert backend.endpoint(spec.sandbox_id) is None


def test_a_pod_deleted_by_someone_else_ends_its_sandbox_before_it_is_gone(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    spec = ready_sandbox(fake, backend)
    fake.graceful_pods = True
    fake.dead_nodes.add("node-a")  # its kubelet never confirms: Terminating forever
    client.CoreV1Api(backend.api.api_client).delete_namespaced_pod(pod_name(spec), NS)
    (event,) = eventually(events_of(backend, spec.sandbox_id))
    assert (event.kind, event.code) == ("gone", "pod_deleted")
    assert ("pods", NS, pod_name(spec)) in fake.objects  # still there, Terminating
    assert backend.endpoint(spec.sandbox_id) is None


def test_its_own_graceful_destroy_is_not_reported(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    spec, other = ready_sandbox(fake, backend), ready_sandbox(fake, backend)
    fake.graceful_pods = True
    fake.dead_nodes.add("node-a")
    backend.destroy(spec.sandbox_id)
    fake.load_status(NS, pod_name(other), "evicted")  # something that is reported
    eventually(events_of(backend, other.sandbox_id))
    assert [e for e in backend.watch(0.3) if e.sandbox_id == spec.sandbox_id] == []


def test_a_pod_not_ready_beyond_the_bound_is_lost_with_its_node(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(not_ready_lost_s=0.5)
    spec = ready_sandbox(fake, backend)
    # the node controller marks the pod not Ready (NodeNotReady) and nothing else
    # happens: no further event will come for this pod
    fake.load_status(NS, pod_name(spec), "node_not_ready")
    (event,) = eventually(events_of(backend, spec.sandbox_id))
    assert (event.kind, event.code) == ("gone", "node_lost")
    assert "node-b is not ready" in event.reason
    assert backend.endpoint(spec.sandbox_id) is None


def test_a_pod_not_ready_for_a_moment_keeps_its_sandbox(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(not_ready_lost_s=30.0)
    spec = ready_sandbox(fake, backend)
    fake.load_status(NS, pod_name(spec), "node_not_ready")
    eventually(lambda: (backend.informer.get(pod_name(spec)) or _none()).not_ready_reason)
    assert [e for e in backend.watch(0.5) if e.kind != "ready"] == []
    fake.load_status(NS, pod_name(spec), "running")  # the node came back
    assert eventually(lambda: backend.endpoint(spec.sandbox_id)) is not None


def test_it_tolerates_a_lost_node_briefly_not_for_the_default_five_minutes(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    spec = ready_sandbox(fake, backend)
    tolerations = fake.objects[("pods", NS, pod_name(spec))]["spec"]["tolerations"]
    assert {(t["key"], t["effect"], t["tolerationSeconds"]) for t in tolerations} == {
        ("node.kubernetes.io/not-ready", "NoExecute", 30),
        ("node.kubernetes.io/unreachable", "NoExecute", 30),
    }


def test_the_inventory_counts_a_pod_stuck_terminating_as_not_running_and_forces_it_out(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(terminating_grace_s=0.0)
    spec = ready_sandbox(fake, backend)
    fake.graceful_pods = True
    fake.dead_nodes.add("node-a")
    backend.destroy(spec.sandbox_id)
    (item,) = [i for i in backend.inventory() if i.kind.startswith("pod")]
    assert item.kind == "pod_terminating"  # not "pod": the reconciler will not count it running
    backend.reclaim(item)  # a forced deletion: the kubelet will never confirm
    assert ("pods", NS, pod_name(spec)) not in fake.objects
    assert fake.count("DELETE", f"/pods/{pod_name(spec)}", gracePeriodSeconds="0") == 1


# ---- 6. OOM kill: typed ---------------------------------------------------------------


def test_an_oom_kill_is_resource_exhausted_memory(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    spec = ready_sandbox(fake, backend)
    fake.load_status(NS, pod_name(spec), "oom_killed")
    (event,) = eventually(events_of(backend, spec.sandbox_id))
    assert (event.kind, event.code) == ("failed", "resource_exhausted")
    assert event.reason.startswith("resource_exhausted: memory: ")
    assert "256Mi" in event.reason  # the sandbox's own limit, from its pod spec
    kinds = {i.kind for i in backend.inventory() if i.sandbox_id == spec.sandbox_id}
    assert "pod_exited" in kinds


# ---- 2. image pulls back off until the ready timeout ----------------------------------


def test_only_the_watcher_lists_and_watches_the_namespace(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    # issue 20: one LIST+WATCH per installation. A worker's provision and a web
    # process's endpoint look at their own sandbox only.
    worker = make_backend()
    fake.auto_start = True
    spec = new_spec()
    endpoint = worker.provision(spec)
    assert worker.endpoint(spec.sandbox_id) == endpoint
    assert not worker.informer.running
    namespace_wide = [
        q
        for m, p, q in fake.requests
        if m == "GET" and p.endswith("/pods") and "sandbox=" not in q["labelSelector"][0]
    ]
    assert namespace_wide == []
    assert fake.count("GET", f"/pods/{pod_name(spec)}") == 1
    # the watcher's process: its informer serves the same answers from one watch
    watcher = make_backend()
    list(watcher.watch(0.1))
    assert watcher.informer.running
    assert watcher.endpoint(spec.sandbox_id) == endpoint


def test_an_image_pull_that_fails_then_succeeds_is_waited_out(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(ready_timeout_s=30.0)
    spec = new_spec()
    name = pod_name(spec)
    progress: list[dict[str, Any]] = []

    def kubelet() -> None:
        eventually(lambda: ("pods", NS, name) in fake.objects)
        for fixture, reason in (
            ("err_image_pull", "ErrImagePull"),
            ("image_pull_backoff", "ImagePullBackOff"),
        ):
            fake.load_status(NS, name, fixture)
            eventually(lambda: pull_reason_seen(backend, name) == reason)  # noqa: B023
        fake.load_status(NS, name, "running")

    thread = threading.Thread(target=kubelet, daemon=True)
    thread.start()
    endpoint = backend.provision(spec, progress.append)
    thread.join(10)
    assert endpoint.host == "10.244.1.23"  # podIP of the running fixture
    assert endpoint.image_digest == "sha256:" + "5e" * 32


def test_a_pull_failing_until_the_timeout_is_typed_with_the_registrys_message(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(ready_timeout_s=2.0, wait_stall_s=0.2)
    spec = new_spec(network_access=True)
    name = pod_name(spec)
    progress: list[dict[str, Any]] = []

    def kubelet() -> None:
        eventually(lambda: ("pods", NS, name) in fake.objects)
        fake.load_status(NS, name, "err_image_pull")
        eventually(lambda: any(p.get("phase") == "pull_backoff" for p in progress))
        fake.load_status(NS, name, "image_pull_backoff")  # says only "Back-off pulling"

    threading.Thread(target=kubelet, daemon=True).start()
    with pytest.raises(ImageUnavailable) as caught:
        backend.provision(spec, progress.append)
    # the registry's words from the ErrImagePull, not the back-off's
    assert "toomanyrequests" in str(caught.value)
    assert caught.value.code == "registry_unreachable"  # rate limited: try again later
    assert any("429 Too Many Requests" in p.get("message", "") for p in progress)
    assert {r for (r, _ns, n) in fake.objects if spec.sandbox_id in n} == set()


def test_an_invalid_image_name_still_fails_at_once(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(ready_timeout_s=30.0)
    spec = new_spec()
    kubelet_later(
        fake, pod_name(spec), phase="Pending", waiting_reason="InvalidImageName",
        waiting_message='couldn\'t parse image reference "x"',
    )  # fmt: skip
    with pytest.raises(ImageUnavailable) as caught:
        backend.provision(spec)
    assert caught.value.code == "image_reference_invalid"


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("create_container_config_error", "container has runAsNonRoot and image will run as root"),
        ("unschedulable", "Unschedulable: 0/3 nodes are available"),
    ],
)
def test_startup_failures_of_real_pods_are_reported_in_their_words(
    fake: FakeKube,
    make_backend: Callable[..., KubernetesBackend],
    fixture: str,
    expected: str,
) -> None:
    backend = make_backend(ready_timeout_s=1.5, wait_stall_s=0.2)
    spec = new_spec()

    def kubelet() -> None:
        eventually(lambda: ("pods", NS, pod_name(spec)) in fake.objects)
        fake.load_status(NS, pod_name(spec), fixture)

    threading.Thread(target=kubelet, daemon=True).start()
    with pytest.raises(BackendError, match=expected):
        backend.provision(spec)
    assert ("pods", NS, pod_name(spec)) not in fake.objects


# ---- 3. a stalled informer: name-scoped wait with a GET fallback -----------------------


def test_a_stalled_informer_does_not_fail_a_healthy_pod(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(watch_timeout_s=60, wait_stall_s=0.3, ready_timeout_s=20.0)
    backend.informer.ensure_started()
    eventually(lambda: fake.watch_queries())
    watches_before = len(fake.watch_queries())
    fake.stall_open_watches()  # the informer's connection delivers nothing any more
    spec = new_spec()

    def kubelet() -> None:  # starts the pod once the backend has read it pending
        eventually(lambda: fake.count("GET", f"/pods/{pod_name(spec)}"))
        fake.set_pod_status(NS, pod_name(spec), phase="Running", pod_ip="10.9.9.9", running=True)

    threading.Thread(target=kubelet, daemon=True).start()
    endpoint = backend.provision(spec)
    assert endpoint.host == "10.9.9.9"
    assert backend.informer.get(pod_name(spec)) is not None  # fed back into the cache
    # it read the pod itself, then watched it alone
    assert fake.count("GET", f"/pods/{pod_name(spec)}") >= 1
    scoped = [q for q in fake.watch_queries()[watches_before:] if "fieldSelector" in q]
    assert scoped and all(q["fieldSelector"] == [f"metadata.name={pod_name(spec)}"] for q in scoped)


def test_a_healthy_informer_needs_no_get(fake: FakeKube, backend: KubernetesBackend) -> None:
    backend.informer.ensure_started()  # in the watcher's process
    fake.auto_start = True
    spec = new_spec()
    backend.provision(spec)
    assert fake.count("GET", f"/pods/{pod_name(spec)}") == 0


# ---- 4. the namespace policy is converged by server-side apply ------------------------


def _policy(fake: FakeKube, name: str = "hedgerow-t1-default") -> dict[str, Any]:
    return fake.objects[("networkpolicies", NS, name)]


def test_the_namespace_policy_is_reapplied_when_deleted_or_edited(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    backend.provision(new_spec())
    desired = SERIALIZER.sanitize_for_serialization(build_namespace_policy(make_config()))
    assert backend.converge() == {"namespace_policy_restored": 0}
    # someone opens egress for every sandbox pod …
    net = client.NetworkingV1Api(backend.api.api_client)
    net.patch_namespaced_network_policy(
        "hedgerow-t1-default",
        NS,
        {"spec": {"egress": [{}], "podSelector": {"matchLabels": {"x": "y"}}}},
    )
    assert _policy(fake)["spec"] != desired["spec"]
    assert backend.converge() == {"namespace_policy_restored": 1}
    assert _policy(fake)["spec"] == desired["spec"]
    assert fake.count("PATCH", "/networkpolicies/hedgerow-t1-default", fieldManager="hedgerow") >= 1
    # … or deletes it
    net.delete_namespaced_network_policy("hedgerow-t1-default", NS)
    assert backend.converge() == {"namespace_policy_restored": 1}
    assert _policy(fake)["spec"] == desired["spec"]


def test_converging_refuses_a_policy_of_that_name_owned_by_someone_else(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    foreign = build_namespace_policy(make_config())
    foreign.metadata.labels = {"owner": "someone-else"}
    client.NetworkingV1Api(backend.api.api_client).create_namespaced_network_policy(NS, foreign)
    with pytest.raises(BackendError, match="is not this installation"):
        backend.converge()
    assert _policy(fake)["metadata"]["labels"] == {"owner": "someone-else"}


# ---- the API wrapper: timeouts, pagination, metadata-only listings ---------------------


def test_a_stalled_api_request_times_out_and_is_retried(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(api_timeout_s=0.5)
    fake.stall_next(5.0)  # the first request hangs far past the timeout
    assert backend.inventory() == []
    assert backend.api.retries_done == 1


def test_lists_are_paginated_and_secrets_never_listed(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(list_page_size=2)
    fake.auto_start = True
    specs = [new_spec() for _ in range(5)]
    for spec in specs:
        backend.provision(spec)
    items = backend.inventory()
    assert sorted(i.sandbox_id or "" for i in items if i.kind == "pod") == sorted(
        s.sandbox_id for s in specs
    )
    assert not [i for i in items if i.kind == "secret"]
    pod_pages = [
        q
        for m, p, q in fake.calls()
        if m == "GET" and p.endswith("/pods") and "sandbox=" not in q["labelSelector"][0]
    ]
    assert {q.get("limit", [""])[0] for q in pod_pages} == {"2"}
    assert sum(1 for q in pod_pages if "continue" in q) >= 2
    assert not [p for m, p, _a in fake.accepts if m == "GET" and p.endswith("/secrets")]


def test_the_informer_relists_from_the_start_when_a_continue_token_expires(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(list_page_size=1)
    fake.auto_start = True
    first = make_backend(instance="t1")  # makes the pods; its informer is not ours
    specs = [new_spec() for _ in range(3)]
    for spec in specs:
        first.provision(spec)
    original = fake.page

    def expire_after_first_page(resource: str, ns: str, query: Any) -> Any:
        if "continue" in query and not expired:
            expired.append(True)
            fake.rv += 1  # etcd moved on, then compacted past the list's revision
            fake.compact()
        return original(resource, ns, query)

    expired: list[bool] = []
    fake.page = expire_after_first_page  # type: ignore[method-assign]
    backend.informer.ensure_started()
    assert expired == [True]
    assert {v.sandbox_id for v in backend.informer.pods.values()} == {s.sandbox_id for s in specs}


def test_a_410_as_the_watch_responses_status_relists(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    backend.informer.ensure_started()
    fake.auto_start = True
    fake.gone_as_status = True
    kept, lost = new_spec(), new_spec()
    backend.provision(kept)
    backend.provision(lost)
    fake.vanish("pods", NS, pod_name(lost))
    events = eventually(lambda: [e for e in backend.watch(0.3) if e.kind == "gone"])
    assert [e.sandbox_id for e in events] == [lost.sandbox_id]
    assert backend.informer.relists == 2


# ---- 5. a control plane outside the cluster ------------------------------------------


def test_outside_the_cluster_it_refuses_to_start_without_a_route_to_the_agents(
    fake: FakeKube, tmp_path: Path
) -> None:
    path = kubeconfig(tmp_path, fake.url)
    pinned = "registry.example/hedgerow-agent-injector@sha256:" + "ab" * 32
    with (
        override_settings(
            HEDGEROW_K8S_KUBECONFIG=str(path),
            HEDGEROW_K8S_NAMESPACE=NS,
            HEDGEROW_K8S_INJECTOR_IMAGE=pinned,
        ),
        pytest.raises(ImproperlyConfigured, match="HEDGEROW_K8S_AGENT_INGRESS_CIDRS"),
    ):
        build_kubernetes_backend()
    with override_settings(
        HEDGEROW_INSTANCE="out",
        HEDGEROW_K8S_KUBECONFIG=str(path),
        HEDGEROW_K8S_NAMESPACE=NS,
        HEDGEROW_K8S_AGENT_INGRESS_CIDRS=["203.0.113.7/32"],
        HEDGEROW_K8S_INJECTOR_IMAGE=pinned,
    ):
        backend = build_kubernetes_backend()
    try:
        backend.ensure_namespace_policy()
    finally:
        backend.close()
    (ingress,) = _policy(fake, "hedgerow-out-default")["spec"]["ingress"]
    assert {"ipBlock": {"cidr": "203.0.113.7/32"}} in ingress["from"]
    assert ingress["ports"] == [{"protocol": "TCP", "port": 7777}]


# ---- DNS: the resolvers are configurable ------------------------------------------------


def test_dns_goes_to_the_configured_resolvers_instead_of_kube_dns() -> None:
    config = make_config(dns_cidrs=("169.254.20.10/32",), dns_nameservers=("10.0.0.53",))
    spec = new_spec(network_access=True)
    policy = SERIALIZER.sanitize_for_serialization(build_egress_policy(config, spec))
    _internet, dns = policy["spec"]["egress"]
    assert dns["to"] == [
        {"ipBlock": {"cidr": "169.254.20.10/32"}},
        {"ipBlock": {"cidr": "10.0.0.53/32"}},
    ]
    assert dns["ports"] == [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
    pod = SERIALIZER.sanitize_for_serialization(build_pod(config, spec))["spec"]
    assert pod["dnsPolicy"] == "None"
    assert pod["dnsConfig"] == {"nameservers": ["10.0.0.53"]}
    # by default: the cluster DNS pods, and the pod's DNS as the cluster sets it
    default = make_config()
    policy = SERIALIZER.sanitize_for_serialization(build_egress_policy(default, spec))
    assert "namespaceSelector" in policy["spec"]["egress"][1]["to"][0]
    assert (
        "dnsPolicy" not in SERIALIZER.sanitize_for_serialization(build_pod(default, spec))["spec"]
    )
    with pytest.raises(BackendError, match="not an IP address"):
        make_config(dns_cidrs=("kube-dns",))


def pull_reason_seen(backend: KubernetesBackend, name: str) -> str:
    view = backend.informer.get(name)
    return view.pull_reason if view else ""


def _none() -> Any:
    class Nothing:
        pull_reason = ""

    return Nothing()
