"""The sandbox pod's boundary: user namespace, who the sandbox runs as, read-only root,
bounded writable volumes — in the spec the API server receives, and against an API
server (the FAKE, see fakekube.py) that refuses or drops ``hostUsers``.

What only a real cluster shows (a runtime that ignores hostUsers, kubelet's eviction at
the disk limits, gVisor/Kata) is checked by ``make k8s-smoke``, not here."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.kubernetes import KubernetesBackend
from apps.sandboxes.backends.kubernetes.config import NONROOT_UID, UserNamespacesUnavailable
from apps.sandboxes.backends.kubernetes.specs import build_pod

from .conftest import NS, make_config, new_spec
from .fakekube import FakeKube

SERIALIZER = client.ApiClient()


def pod_json(**config: Any) -> dict[str, Any]:
    spec = config.pop("spec", None) or new_spec()
    data: dict[str, Any] = SERIALIZER.sanitize_for_serialization(
        build_pod(make_config(**config), spec)
    )
    return data


def main_container(pod: dict[str, Any]) -> dict[str, Any]:
    (main,) = pod["spec"]["containers"]
    return main  # type: ignore[no-any-return]


def test_it_asks_for_a_user_namespace_and_every_restriction_by_default() -> None:
    pod = pod_json()
    ps = pod["spec"]
    assert ps["hostUsers"] is False  # pod root is an unprivileged uid range on the node
    assert ps["automountServiceAccountToken"] is False
    assert ps["hostNetwork"] is False and ps["hostPID"] is False and ps["hostIPC"] is False
    assert ps["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not [v for v in ps["volumes"] if "hostPath" in v]
    for container in ps["containers"] + ps["initContainers"]:
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["privileged"] is False
        assert sc["procMount"] == "Default"  # /proc/sys read-only, /proc/kcore etc. masked
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = main_container(pod)["securityContext"]
    # inside the user namespace the image's own user (often root) is kept
    assert "runAsUser" not in sc and "runAsGroup" not in sc and "runAsNonRoot" not in sc
    assert "readOnlyRootFilesystem" not in sc or sc["readOnlyRootFilesystem"] is False


def test_it_leaves_host_users_out_when_user_namespaces_are_turned_off() -> None:
    assert "hostUsers" not in pod_json(user_namespaces=False)["spec"]


@pytest.mark.parametrize(
    "config,expected",
    [
        # a runtime class contains pod root: the image's user (a user namespace does
        # too: the default, in the test above)
        ({"user_namespaces": False, "runtime_class": "gvisor"}, {}),
        # neither: root in the pod would be root on the node, so "auto" is non-root
        (
            {"user_namespaces": False},
            {"runAsUser": NONROOT_UID, "runAsGroup": NONROOT_UID, "runAsNonRoot": True},
        ),
        ({"user_namespaces": False, "run_as_user": "image"}, {}),  # the operator's choice
        ({"run_as_user": "nonroot"}, {"runAsNonRoot": True}),  # kubelet refuses root images
        ({"run_as_user": "1000"}, {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True}),
    ],
)
def test_it_runs_the_sandbox_as_root_only_where_pod_root_is_not_node_root(
    config: dict[str, Any], expected: dict[str, Any]
) -> None:
    sc = main_container(pod_json(**config))["securityContext"]
    assert {k: sc[k] for k in ("runAsUser", "runAsGroup", "runAsNonRoot") if k in sc} == expected


@pytest.mark.parametrize("value", ["0", "root", "-1", "1e3", "", "12345678901"])
def test_it_refuses_a_run_as_user_it_cannot_honour(value: str) -> None:
    with pytest.raises(BackendError, match="run_as_user"):
        make_config(run_as_user=value)


def test_it_offers_a_read_only_root_with_writable_workspace_and_tmp() -> None:
    pod = pod_json(read_only_root=True)
    main = main_container(pod)
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    writable = {
        m["mountPath"]: volumes[m["name"]]
        for m in main["volumeMounts"]
        if not m.get("readOnly") and m["mountPath"] != "/run/hedgerow"  # the token tmpfs
    }
    assert set(writable) == {"/workspace", "/tmp"}
    assert all("emptyDir" in v for v in writable.values())


def test_it_bounds_every_writable_volume_and_the_containers_by_the_sandboxs_disk() -> None:
    pod = pod_json(spec=new_spec(disk_mib=1536))
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    main = main_container(pod)
    by_path = {m["mountPath"]: volumes[m["name"]] for m in main["volumeMounts"]}
    assert by_path["/workspace"]["emptyDir"] == {"sizeLimit": "1536Mi"}
    assert by_path["/tmp"]["emptyDir"] == {"sizeLimit": "1536Mi"}
    # every emptyDir of the pod has a size limit: none can fill the node's disk
    assert all(v["emptyDir"].get("sizeLimit") for v in volumes.values() if "emptyDir" in v)
    # and the pod as a whole (writable layer + logs + emptyDirs) has ephemeral-storage
    for container in pod["spec"]["containers"] + pod["spec"]["initContainers"]:
        resources = container["resources"]
        assert (
            resources["requests"]["ephemeral-storage"] == resources["limits"]["ephemeral-storage"]
        )
    # the sandbox's disk plus the agent bundle's emptyDir (its sizeLimit), which lives
    # on the same node disk: the scheduler reserves both, the tenant keeps the whole disk
    assert volumes["hedgerow-agent"]["emptyDir"] == {"sizeLimit": "256Mi"}
    assert main["resources"]["limits"]["ephemeral-storage"] == f"{1536 + 256}Mi"


# ---- the API server's side -------------------------------------------------------


def names(fake: FakeKube, resource: str) -> set[str]:
    return {name for (r, _ns, name) in fake.objects if r == resource}


def test_it_refuses_to_run_a_pod_whose_user_namespace_the_api_server_dropped(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    # Kubernetes 1.25-1.32 with the UserNamespacesSupport gate off accepts the pod and
    # silently clears hostUsers: the pod would run with pod root as node root.
    fake.gated_pod_fields = {"hostUsers"}
    fake.auto_start = True
    with pytest.raises(UserNamespacesUnavailable, match="user_namespaces_unavailable") as info:
        backend.provision(new_spec(network_access=True))
    assert info.value.transient is False  # retrying cannot help: a setting must change
    assert "HEDGEROW_K8S_USER_NAMESPACES" in str(info.value)
    assert fake.count("POST", "/pods") == 1
    # the pod that was created without its user namespace is gone, and so is the rest
    assert names(fake, "pods") == set()
    assert names(fake, "secrets") == set()
    assert names(fake, "networkpolicies") == {"hedgerow-t1-default"}


def test_it_reports_an_api_server_that_does_not_know_host_users(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    fake.unknown_pod_fields = {"hostUsers"}
    refused = re.escape('unknown field "spec.hostUsers"')
    with pytest.raises(UserNamespacesUnavailable, match=refused):
        backend.provision(new_spec())
    # the pod was sent with strict field validation, so it was refused, not created
    assert fake.count("POST", "/pods", fieldValidation="Strict") == 1
    assert names(fake, "pods") == set()
    assert names(fake, "secrets") == set()


def test_it_runs_without_user_namespaces_only_when_the_operator_turns_them_off(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    fake.unknown_pod_fields = {"hostUsers"}
    fake.auto_start = True
    backend = make_backend(user_namespaces=False)
    spec = new_spec()
    backend.provision(spec)
    stored = fake.objects[("pods", NS, f"hr-{spec.sandbox_id}-1")]
    assert "hostUsers" not in stored["spec"]
    # no user namespace and no runtime class: the sandbox is not root
    sc = stored["spec"]["containers"][0]["securityContext"]
    assert (sc["runAsUser"], sc["runAsNonRoot"]) == (NONROOT_UID, True)


def test_it_refuses_to_adopt_a_pod_left_without_its_user_namespace(
    fake: FakeKube, backend: KubernetesBackend
) -> None:
    # a redelivered provision finds the pod an earlier attempt made on a server that
    # dropped hostUsers: adopting it would run the sandbox without a user namespace
    spec = new_spec()
    fake.gated_pod_fields = {"hostUsers"}
    fake.create("pods", NS, SERIALIZER.sanitize_for_serialization(build_pod(make_config(), spec)))
    fake.gated_pod_fields = set()
    with pytest.raises(UserNamespacesUnavailable):
        backend.provision(spec)
    assert names(fake, "pods") == set()
