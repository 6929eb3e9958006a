"""The FAKE API server behaves like kube-apiserver where the backend depends on it: the
official client against it, for each behaviour the backend's tests rely on."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from apps.sandboxes.backends.kubernetes.api import FIELD_MANAGER, METADATA_LIST_ACCEPT

from .conftest import NS, eventually
from .fakekube import FakeKube


@pytest.fixture
def api(fake: FakeKube) -> Iterator[client.ApiClient]:
    configuration = client.Configuration()
    configuration.host = fake.url
    configuration.retries = False
    with client.ApiClient(configuration) as api_client:
        yield api_client


def pod(name: str, node: str = "node-a", **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "x", **labels}},
        "spec": {"nodeName": node, "containers": [{"name": "sandbox", "image": "busybox"}]},
    }


def test_lists_paginate_with_limit_and_continue_and_expire(
    fake: FakeKube, api: client.ApiClient
) -> None:
    core = client.CoreV1Api(api)
    for i in range(5):
        core.create_namespaced_pod(NS, pod(f"p{i}"))
    first = core.list_namespaced_pod(NS, limit=2)
    assert [p.metadata.name for p in first.items] == ["p0", "p1"]
    assert first.metadata.remaining_item_count == 3
    second = core.list_namespaced_pod(NS, limit=2, _continue=first.metadata._continue)
    assert [p.metadata.name for p in second.items] == ["p2", "p3"]
    fake.rv += 1
    fake.compact()
    with pytest.raises(ApiException) as gone:
        core.list_namespaced_pod(NS, limit=2, _continue=second.metadata._continue)
    assert gone.value.status == 410


def test_field_selectors_filter_lists_and_watches(fake: FakeKube, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(NS, pod("a", node="node-a"))
    core.create_namespaced_pod(NS, pod("b", node="node-b"))
    by_node = core.list_namespaced_pod(NS, field_selector="spec.nodeName=node-b")
    assert [p.metadata.name for p in by_node.items] == ["b"]
    not_a = core.list_namespaced_pod(NS, field_selector="metadata.name!=a")
    assert [p.metadata.name for p in not_a.items] == ["b"]
    with pytest.raises(ApiException) as bad:
        core.list_namespaced_pod(NS, field_selector="spec.schedulerName=x")
    assert bad.value.status == 400
    events = watch.Watch().stream(
        core.list_namespaced_pod,
        NS,
        field_selector="metadata.name=b",
        resource_version="0",
        timeout_seconds=1,
    )
    assert {e["object"].metadata.name for e in events} == {"b"}


def test_a_graceful_pod_deletion_completes_when_the_kubelet_confirms(
    fake: FakeKube, api: client.ApiClient
) -> None:
    fake.graceful_pods = True
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(NS, pod("live", node="node-a"))
    core.create_namespaced_pod(NS, pod("orphan", node="node-dead"))
    core.create_namespaced_pod(NS, pod("forced", node="node-dead"))
    fake.dead_nodes.add("node-dead")
    deleting = core.delete_namespaced_pod("live", NS, grace_period_seconds=1)
    assert deleting.metadata.deletion_timestamp is not None
    assert deleting.metadata.deletion_grace_period_seconds == 1
    core.delete_namespaced_pod("orphan", NS, grace_period_seconds=1)
    core.delete_namespaced_pod("forced", NS, grace_period_seconds=0)
    assert ("pods", NS, "forced") not in fake.objects  # force deletion: at once
    eventually(lambda: ("pods", NS, "live") not in fake.objects)  # confirmed after 1 s
    # a pod on an unreachable node stays Terminating
    assert fake.objects[("pods", NS, "orphan")]["metadata"]["deletionTimestamp"]


def test_finalizers_hold_a_deleted_object_until_they_are_removed(
    fake: FakeKube, api: client.ApiClient
) -> None:
    core = client.CoreV1Api(api)
    secret = {"metadata": {"name": "s", "finalizers": ["example.com/hold"]}, "data": {}}
    core.create_namespaced_secret(NS, secret)
    core.delete_namespaced_secret("s", NS)
    held = core.read_namespaced_secret("s", NS)
    assert held.metadata.deletion_timestamp is not None
    core.patch_namespaced_secret("s", NS, {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_secret("s", NS)
    assert gone.value.status == 404


def _apply(api: client.ApiClient, body: dict[str, Any], **query: str) -> Any:
    return api.call_api(
        f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/np",
        "PATCH",
        query_params=list(query.items()),
        header_params={"Content-Type": "application/apply-patch+yaml"},
        body=body,
        response_type="V1NetworkPolicy",
        _return_http_data_only=True,
    )


def test_server_side_apply_creates_merges_and_respects_other_managers(
    fake: FakeKube, api: client.ApiClient
) -> None:
    body: dict[str, Any] = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "np", "labels": {"a": "1"}},
        "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": []},
    }
    with pytest.raises(ApiException) as no_manager:
        _apply(api, body)
    assert no_manager.value.status == 400
    created = _apply(api, body, fieldManager=FIELD_MANAGER)
    assert created.metadata.labels == {"a": "1"}
    net = client.NetworkingV1Api(api)
    net.patch_namespaced_network_policy("np", NS, {"metadata": {"labels": {"b": "2"}}})
    with pytest.raises(ApiException) as conflict:
        _apply(api, body, fieldManager=FIELD_MANAGER)
    assert conflict.value.status == 409
    forced = _apply(api, body | {"spec": {**body["spec"], "egress": [{}]}},
                    fieldManager=FIELD_MANAGER, force="true")  # fmt: skip
    assert forced.metadata.labels == {"a": "1", "b": "2"}  # maps merge
    assert len(forced.spec.egress) == 1  # lists replace


def test_metadata_only_lists_carry_no_data(fake: FakeKube, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    token = base64.b64encode(b"secret-token").decode()
    core.create_namespaced_secret(NS, {"metadata": {"name": "s"}, "data": {"token": token}})
    listed = api.call_api(
        f"/api/v1/namespaces/{NS}/secrets",
        "GET",
        header_params={"Accept": METADATA_LIST_ACCEPT},
        response_type="object",
        _return_http_data_only=True,
    )
    assert listed["kind"] == "PartialObjectMetadataList"
    assert [i["metadata"]["name"] for i in listed["items"]] == ["s"]
    assert token not in str(listed)


def test_a_stalled_request_runs_into_the_clients_timeout(
    fake: FakeKube, api: client.ApiClient
) -> None:
    fake.stall_next(3.0)
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        client.CoreV1Api(api).list_namespaced_pod(NS, _request_timeout=(1, 0.3))


@pytest.mark.parametrize("as_status", [False, True])
def test_a_too_old_watch_gets_410_as_an_event_or_as_the_status(
    fake: FakeKube, api: client.ApiClient, as_status: bool
) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(NS, pod("a"))
    fake.rv += 1
    fake.compact()
    fake.gone_as_status = as_status
    with pytest.raises(ApiException) as gone:
        for _ in watch.Watch().stream(
            core.list_namespaced_pod, NS, resource_version="101", timeout_seconds=1
        ):
            pass
    assert gone.value.status == 410


def test_bookmarks_come_at_their_interval_and_before_the_watch_ends(
    fake: FakeKube, api: client.ApiClient
) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(NS, pod("a"))

    def bookmarks(timeout: int) -> int:
        stream = watch.Watch().stream(
            core.list_namespaced_pod,
            NS,
            resource_version=str(fake.rv),
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
        )
        return sum(1 for e in stream if e["type"] == "BOOKMARK")

    assert bookmarks(1) == 1  # at the default interval (60 s): only the closing one
    fake.bookmark_interval_s = 0.2
    assert bookmarks(2) >= 3
