"""The backend's create/delete/list/watch/adopt logic: the real ``kubernetes`` client
against the in-process FAKE API server (see fakekube.py)."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from apps.sandboxes.backends.base import (
    BackendError,
    ImageUnavailable,
    RegistryCredentials,
    UnknownImage,
)
from apps.sandboxes.backends.kubernetes import KubernetesBackend
from apps.sandboxes.backends.kubernetes.specs import (
    build_egress_policy,
    build_namespace_policy,
    build_secret,
)

from .conftest import NS, eventually, kubelet_later, make_config, new_spec
from .fakekube import FakeKube


def names(fake: FakeKube, resource: str) -> set[str]:
    return {name for (r, _ns, name) in fake.objects if r == resource}


def test_it_provisions_a_secret_and_pod_and_returns_the_pod_ip(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    spec = new_spec()
    endpoint = backend.provision(spec)
    assert endpoint.host.startswith("10.42.0.")
    assert endpoint.port == 7777
    assert endpoint.isolation == "pod"
    assert endpoint.node == "node-a"
    assert names(fake, "pods") == {f"hr-{spec.sandbox_id}-1"}
    assert names(fake, "secrets") == {f"hr-{spec.sandbox_id}-1-token"}
    # no network access: the namespace default-deny policy and nothing else
    assert names(fake, "networkpolicies") == {"hedgerow-t1-default"}
    stored = fake.objects[("pods", NS, f"hr-{spec.sandbox_id}-1")]
    assert stored["spec"]["automountServiceAccountToken"] is False
    assert spec.agent_token not in str(stored)
    assert backend.endpoint(spec.sandbox_id) == endpoint


def test_it_takes_readiness_from_the_watch_not_from_polling(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(informer_everywhere=True)  # this process runs an informer
    spec = new_spec()
    kubelet_later(fake, f"hr-{spec.sandbox_id}-1", phase="Running", pod_ip="10.9.9.9", running=True)
    assert backend.provision(spec).host == "10.9.9.9"
    # one LIST to start the informer, a WATCH from its resourceVersion, no GET of the pod
    assert fake.count("GET", "/pods", watch="true") >= 1
    assert backend.informer.relists == 1
    assert fake.count("GET", f"/pods/hr-{spec.sandbox_id}-1") == 0
    watches = fake.watch_queries()
    assert all(q.get("resourceVersion", [""])[0] for q in watches)


def test_it_creates_an_egress_policy_only_when_network_access_is_requested(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    spec = new_spec(network_access=True)
    backend.provision(spec)
    assert names(fake, "networkpolicies") == {
        "hedgerow-t1-default",
        f"hr-{spec.sandbox_id}-1-egress",
    }
    backend.destroy(spec.sandbox_id)
    assert names(fake, "networkpolicies") == {"hedgerow-t1-default"}


def test_an_image_pull_error_until_the_timeout_removes_what_it_created(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(ready_timeout_s=1.0, wait_stall_s=0.2)
    spec = new_spec(network_access=True)
    kubelet_later(fake, f"hr-{spec.sandbox_id}-1", phase="Pending", waiting_reason="ErrImagePull")
    with pytest.raises(BackendError, match="ErrImagePull"):
        backend.provision(spec)
    assert names(fake, "pods") == set()
    assert names(fake, "secrets") == set()
    assert names(fake, "networkpolicies") == {"hedgerow-t1-default"}


def test_it_reports_why_a_pod_never_started(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(ready_timeout_s=1.0)
    spec = new_spec()
    kubelet_later(
        fake,
        f"hr-{spec.sandbox_id}-1",
        phase="Pending",
        unschedulable="0/3 nodes are available: 3 Insufficient cpu.",
    )
    with pytest.raises(BackendError, match="Unschedulable: 0/3 nodes"):
        backend.provision(spec)
    assert names(fake, "pods") == set()


def test_it_destroys_every_generation_and_is_idempotent(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    keep = new_spec()
    backend.provision(keep)
    spec = new_spec(network_access=True)
    backend.provision(spec)
    backend.destroy(spec.sandbox_id)
    backend.destroy(spec.sandbox_id)
    leftovers = [n for r in ("pods", "secrets", "networkpolicies") for n in names(fake, r)]
    assert not [n for n in leftovers if spec.sandbox_id in n]
    assert f"hr-{keep.sandbox_id}-1" in names(fake, "pods")
    assert backend.endpoint(spec.sandbox_id) is None


def test_it_replaces_an_older_generation(fake: FakeKube, backend: KubernetesBackend) -> None:
    fake.auto_start = True
    first = new_spec(generation=1)
    backend.provision(first)
    # a Secret made before owner references (an older Hedgerow): deleted by its name
    legacy = build_secret(make_config(), first)
    legacy.metadata.name = f"hr-{first.sandbox_id}-1-pull"
    client.CoreV1Api(backend.api.api_client).create_namespaced_secret(NS, legacy)
    second = new_spec(sandbox_id=first.sandbox_id, generation=2, agent_token="tok-2")
    endpoint = backend.provision(second)
    assert names(fake, "pods") == {f"hr-{first.sandbox_id}-2"}
    assert names(fake, "secrets") == {f"hr-{first.sandbox_id}-2-token"}
    eventually(lambda: backend.endpoint(first.sandbox_id) == endpoint)


def test_it_adopts_objects_of_the_same_tenant_sandbox_and_generation(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    spec = new_spec()
    first = backend.provision(spec)
    uid = fake.objects[("pods", NS, f"hr-{spec.sandbox_id}-1")]["metadata"]["uid"]
    # a redelivered provision task: same sandbox and generation
    again = backend.provision(spec)
    assert again == first
    assert fake.objects[("pods", NS, f"hr-{spec.sandbox_id}-1")]["metadata"]["uid"] == uid
    assert fake.count("POST", "/pods") == 2  # tried, got 409, adopted
    assert len(names(fake, "pods")) == 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("hedgerow.dev/tenant", "7"),
        ("hedgerow.dev/sandbox", "0" * 32),
        ("hedgerow.dev/instance", "x"),
    ],
)
def test_it_refuses_to_share_an_object_owned_by_someone_else(
    fake: FakeKube, backend: KubernetesBackend, field: str, value: str
) -> None:
    spec = new_spec()
    squatter = build_secret(make_config(), spec)
    squatter.metadata.labels[field] = value
    api = client.CoreV1Api(backend.api.api_client)
    api.create_namespaced_secret(NS, squatter)
    with pytest.raises(BackendError, match="refusing to share"):
        backend.provision(spec)
    # the other owner's object is untouched and no pod was started beside it
    kept = fake.objects[("secrets", NS, f"hr-{spec.sandbox_id}-1-token")]
    assert kept["metadata"]["labels"][field] == value
    assert names(fake, "pods") == set()


def test_it_refuses_to_run_sandboxes_without_its_namespace_policy(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    foreign = build_namespace_policy(make_config())
    foreign.metadata.labels = {"owner": "someone-else"}
    client.NetworkingV1Api(backend.api.api_client).create_namespaced_network_policy(NS, foreign)
    with pytest.raises(BackendError, match="is not this installation"):
        backend.provision(new_spec())
    assert names(fake, "pods") == set()


def test_it_reports_a_pod_deleted_behind_its_back_as_gone(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    spec = new_spec()
    backend.provision(spec)
    fake.delete("pods", NS, f"hr-{spec.sandbox_id}-1")
    events = eventually(lambda: [e for e in backend.watch(0.2) if e.kind == "gone"], timeout=10)
    assert events[0].sandbox_id == spec.sandbox_id
    assert events[0].generation == 1
    assert backend.endpoint(spec.sandbox_id) is None


def test_it_reports_a_failed_pod_and_inventories_it_as_exited(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    spec = new_spec()
    backend.provision(spec)
    fake.set_pod_status(NS, f"hr-{spec.sandbox_id}-1", phase="Failed", exit_code=137)
    events = eventually(lambda: [e for e in backend.watch(0.2) if e.kind == "failed"])
    assert events[0].sandbox_id == spec.sandbox_id
    assert "137" in events[0].reason
    kinds = {i.kind for i in backend.inventory() if i.sandbox_id == spec.sandbox_id}
    assert kinds == {"pod_exited"}  # secrets are never listed: they go with their pod


def test_it_does_not_report_its_own_destroy(fake: FakeKube, backend: KubernetesBackend) -> None:
    fake.auto_start = True
    spec, other = new_spec(), new_spec()
    backend.provision(spec)
    backend.provision(other)
    list(backend.watch(0.3))  # drain the ready events
    backend.destroy(spec.sandbox_id)
    fake.delete("pods", NS, f"hr-{other.sandbox_id}-1")
    events = eventually(lambda: [e for e in backend.watch(0.3) if e.kind == "gone"])
    assert {e.sandbox_id for e in events} == {other.sandbox_id}


def test_it_relists_on_410_and_prunes_what_vanished(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    kept, lost = new_spec(), new_spec()
    backend.provision(kept)
    backend.provision(lost)
    list(backend.watch(0.3))
    # deleted while the event history was compacted away: only a re-list can tell
    fake.vanish("pods", NS, f"hr-{lost.sandbox_id}-1")
    events = eventually(lambda: [e for e in backend.watch(0.3) if e.kind == "gone"])
    assert [e.sandbox_id for e in events] == [lost.sandbox_id]
    assert events[0].reason == "pod vanished while not watched"
    assert backend.informer.relists == 2
    assert backend.endpoint(lost.sandbox_id) is None
    assert backend.endpoint(kept.sandbox_id) is not None
    # and the informer keeps working from the new resourceVersion
    fake.delete("pods", NS, f"hr-{kept.sandbox_id}-1")
    eventually(lambda: backend.endpoint(kept.sandbox_id) is None)


def test_it_resumes_the_watch_without_relisting_when_it_merely_times_out(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    backend.informer.ensure_started()  # the watcher's informer
    backend.provision(new_spec())
    eventually(lambda: fake.count("GET", "/pods", watch="true") >= 3, timeout=15)
    assert backend.informer.relists == 1
    versions = [int(q["resourceVersion"][0]) for q in fake.watch_queries()]
    assert versions == sorted(versions)
    assert versions[-1] >= fake.rv - 1  # bookmarks carried the version forward


def test_it_inventories_pods_and_policies_of_this_installation_only(
    fake: FakeKube, backend: KubernetesBackend, make_backend: Callable[..., KubernetesBackend]
) -> None:
    fake.auto_start = True
    spec = new_spec(network_access=True, generation=4)
    backend.provision(spec)
    other_install = make_backend(instance="t2")
    other_install.provision(new_spec())
    items = backend.inventory()
    assert {(i.kind, i.name, i.sandbox_id, i.generation) for i in items} == {
        ("pod", f"hr-{spec.sandbox_id}-4", spec.sandbox_id, 4),
        ("network_policy", f"hr-{spec.sandbox_id}-4-egress", spec.sandbox_id, 4),
    }
    assert [i.node for i in items if i.kind == "pod"] == ["node-a"]
    assert not [c for c in fake.calls() if c[0] == "GET" and c[1].endswith("/secrets")]


def test_a_sandboxs_secret_and_policy_are_owned_by_its_pod_and_go_with_it(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    spec = new_spec(network_access=True)
    backend.provision(spec)
    pod = fake.objects[("pods", NS, f"hr-{spec.sandbox_id}-1")]
    owner = {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"]}
    owner["uid"] = pod["metadata"]["uid"]
    for key in (("secrets", NS, f"hr-{spec.sandbox_id}-1-token"),):
        assert fake.objects[key]["metadata"]["ownerReferences"] == [owner]
    policy = fake.objects[("networkpolicies", NS, f"hr-{spec.sandbox_id}-1-egress")]
    assert policy["metadata"]["ownerReferences"] == [owner]
    # whoever deletes the pod (an operator's kubectl, the taint manager), the garbage
    # collector removes what it owns: nothing of the sandbox outlives it
    fake.delete("pods", NS, pod["metadata"]["name"])
    assert names(fake, "secrets") == set()
    assert names(fake, "networkpolicies") == {"hedgerow-t1-default"}


def test_it_leaves_a_pod_still_terminating_out_of_the_leak_inventory(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    fake.graceful_pods = True
    fake.dead_nodes.add("node-a")  # the kubelet does not confirm while we look
    spec = new_spec()
    backend.provision(spec)
    backend.destroy(spec.sandbox_id)
    assert f"hr-{spec.sandbox_id}-1" in names(fake, "pods")  # still terminating
    assert backend.inventory() == []


def test_it_reclaims_an_orphan_by_name(fake: FakeKube, backend: KubernetesBackend) -> None:
    spec = new_spec(network_access=True)
    orphan = build_egress_policy(make_config(), spec)
    orphan.metadata.labels["hedgerow.dev/sandbox"] = "not-a-sandbox-id"
    client.NetworkingV1Api(backend.api.api_client).create_namespaced_network_policy(NS, orphan)
    (item,) = backend.inventory()
    assert item.sandbox_id is None and item.kind == "network_policy"
    backend.reclaim(item)
    backend.reclaim(item)  # idempotent
    assert names(fake, "networkpolicies") == set()


def test_it_retries_transient_api_errors_with_backoff(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    backend.inventory()  # informer not involved: these are the backend's own calls
    fake.fail_next(503, 429)
    assert backend.inventory() == []
    assert backend.api.retries_done == 2


def test_it_gives_up_with_a_transient_error_after_its_retries(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.fail_next(503, 503, 503)
    with pytest.raises(BackendError) as caught:
        backend.inventory()
    assert caught.value.transient is True


def test_it_maps_the_default_image_and_refuses_unknown_ones(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    assert {i.name for i in backend.images()} == {"host", "python:3.12-slim", "busybox:stable"}
    spec = new_spec(image="host")
    backend.provision(spec)
    stored: dict[str, Any] = fake.objects[("pods", NS, f"hr-{spec.sandbox_id}-1")]
    assert stored["spec"]["containers"][0]["image"] == "python:3.12-slim"
    with pytest.raises(UnknownImage):
        backend.provision(new_spec(image="evil/miner:latest"))


def test_it_turns_a_refused_destroy_into_a_retryable_error(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.auto_start = True
    spec = new_spec()
    backend.provision(spec)
    fake.fail_next(403)  # e.g. RBAC not applied yet: the destroy task must retry
    with pytest.raises(BackendError) as caught:
        backend.destroy(spec.sandbox_id)
    assert caught.value.transient is True
    assert f"hr-{spec.sandbox_id}-1" in names(fake, "pods")
    backend.destroy(spec.sandbox_id)
    assert names(fake, "pods") == set()


# ---- images (issue 15): digest from imageID, tenant logins, typed pull failures ------

DIGEST = "sha256:" + "5e" * 32


def test_it_fills_the_image_digest_from_the_pods_image_id(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    spec = new_spec()
    name = f"hr-{spec.sandbox_id}-1"
    image_id = f"docker.io/library/python@{DIGEST}"
    kubelet_later(fake, name, phase="Running", pod_ip="10.9.9.8", running=True, image_id=image_id)
    endpoint = backend.provision(spec)
    assert endpoint.image_digest == DIGEST
    assert backend.endpoint(spec.sandbox_id) == endpoint  # adopted: the digest again
    # a runtime that reports only the config id ("sha256:…" without a repository) names
    # no manifest digest: recorded as unknown, never as a wrong one
    other = new_spec()
    kubelet_later(
        fake, f"hr-{other.sandbox_id}-1", phase="Running", pod_ip="10.9.9.7", running=True,
        image_id="sha256:" + "c0" * 32,
    )  # fmt: skip
    assert backend.provision(other).image_digest == ""


def test_it_passes_the_tenants_registry_login_as_the_pods_image_pull_secret(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    image = "registry.example:5000/team/app:1"
    backend = make_backend(images=(image,), image_pull_secrets=("cluster-wide",))
    fake.auto_start = True
    password = "s3cret-" + "x" * 8
    spec = new_spec(image=image, registry_credentials=RegistryCredentials("bot", password))
    backend.provision(spec)
    pull = f"hr-{spec.sandbox_id}-1-pull"
    assert names(fake, "secrets") == {f"hr-{spec.sandbox_id}-1-token", pull}
    secret: dict[str, Any] = fake.objects[("secrets", NS, pull)]
    assert secret["type"] == "kubernetes.io/dockerconfigjson"
    assert secret["metadata"]["labels"]["hedgerow.dev/sandbox"] == spec.sandbox_id
    auths = json.loads(base64.b64decode(secret["data"][".dockerconfigjson"]))["auths"]
    assert auths == {
        "registry.example:5000": {
            "username": "bot",
            "password": password,
            "auth": base64.b64encode(f"bot:{password}".encode()).decode(),
        }
    }
    pod: dict[str, Any] = fake.objects[("pods", NS, f"hr-{spec.sandbox_id}-1")]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "cluster-wide"}, {"name": pull}]
    assert password not in json.dumps(pod)
    assert password not in caplog.text  # not even at DEBUG (the client's own logging)
    backend.destroy(spec.sandbox_id)  # deleted with the pod
    assert names(fake, "secrets") == set()
    # a public image: no pull secret of the sandbox's own
    public = new_spec(image=image)
    backend.provision(public)
    assert names(fake, "secrets") == {f"hr-{public.sandbox_id}-1-token"}
    stored = fake.objects[("pods", NS, f"hr-{public.sandbox_id}-1")]
    assert stored["spec"]["imagePullSecrets"] == [{"name": "cluster-wide"}]


@pytest.mark.parametrize(
    ("reason", "message", "code"),
    [
        (
            "ErrImagePull",
            'failed to pull and unpack image "registry.example/team/app:1": failed to '
            'resolve reference "registry.example/team/app:1": unexpected status from HEAD '
            "request to https://registry.example/v2/team/app/manifests/1: 401 Unauthorized",
            "registry_unauthorized",
        ),
        (
            "ErrImagePull",
            'rpc error: code = NotFound desc = failed to pull and unpack image "registry.'
            'example/team/app:1": registry.example/team/app:1: not found',
            "image_not_found",
        ),
        (
            "ErrImagePull",
            "dial tcp: lookup registry.example on 10.96.0.10:53: no such host",
            "registry_unreachable",
        ),
        ("ImagePullBackOff", 'Back-off pulling image "registry.example/x:1"', "unknown_image"),
        ("InvalidImageName", 'couldn\'t parse image reference "x"', "image_reference_invalid"),
    ],
)
def test_an_image_pull_failure_is_a_typed_startup_failure_with_the_registrys_message(
    fake: FakeKube,
    make_backend: Callable[..., KubernetesBackend],
    reason: str,
    message: str,
    code: str,
) -> None:
    image = "registry.example/team/app:1"
    # the kubelet retries pulls: the failure is final at the ready timeout
    backend = make_backend(images=(image,), ready_timeout_s=1.0, wait_stall_s=0.2)
    spec = new_spec(image=image, registry_credentials=RegistryCredentials("bot", "pw"))
    kubelet_later(
        fake, f"hr-{spec.sandbox_id}-1", phase="Pending", waiting_reason=reason,
        waiting_message=message,
    )  # fmt: skip
    with pytest.raises(ImageUnavailable) as caught:
        backend.provision(spec)
    assert (caught.value.code, caught.value.reference) == (code, image)
    assert reason in str(caught.value) and message in str(caught.value)
    # nothing left: pod, token and pull secrets are rolled back
    assert names(fake, "pods") == set() and names(fake, "secrets") == set()
