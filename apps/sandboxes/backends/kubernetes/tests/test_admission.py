"""Admission in deploy/, offline: the ValidatingAdmissionPolicy's own CEL evaluated
(cel-python, with the Kubernetes string functions it uses) on the pods the backend
builds and on pods it must refuse; and the Pod Security Standards' rules for the
levels the namespaces enforce, checked on the generated sandbox pod and on the
control plane's pods. The API server's own admission is verified only on a real
cluster (docs/deploy-kubernetes.md)."""

from __future__ import annotations

import copy
from typing import Any

import celpy
import pytest
from celpy import celtypes
from celpy.adapter import json_to_cel

from apps.sandboxes.backends.base import RegistryCredentials
from apps.sandboxes.backends.kubernetes import KubernetesConfig
from apps.sandboxes.backends.kubernetes.specs import build_pod

from .conftest import new_spec
from .test_manifests import SERIALIZER, build

# ---- the ValidatingAdmissionPolicy, evaluated --------------------------------------


def _split(value: Any, sep: Any) -> Any:
    return celtypes.ListType([celtypes.StringType(p) for p in str(value).split(str(sep))])


def _trim(value: Any) -> Any:
    return celtypes.StringType(str(value).strip())


def _join(items: Any, sep: Any = "") -> Any:
    return celtypes.StringType(str(sep).join(str(i) for i in items))


FUNCTIONS = {"split": _split, "trim": _trim, "join": _join}  # Kubernetes' strings library


def evaluate(policy: dict[str, Any], pod: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """The messages of the validations this pod fails ([] = admitted)."""
    env = celpy.Environment()

    def run(expression: str, variables: dict[str, Any]) -> Any:
        program = env.program(env.compile(expression), functions=FUNCTIONS)  # type: ignore[arg-type]
        activation = json_to_cel({"object": pod, "params": params, "variables": variables})
        assert isinstance(activation, celtypes.MapType)
        return program.evaluate({str(k): v for k, v in activation.items()})

    variables: dict[str, Any] = {}
    for variable in policy["spec"].get("variables", []):
        value = run(variable["expression"], variables)
        variables[variable["name"]] = [str(v) for v in value] if isinstance(value, list) else value
    failed = []
    for check in policy["spec"]["validations"]:
        if not bool(run(check["expression"], variables)):
            message = check.get("message") or str(run(check["messageExpression"], variables))
            failed.append(message)
    return failed


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return build("deploy/overlays/example")


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def sandbox_pod(data: dict[str, str], snapshot_class: str = "", **spec: Any) -> dict[str, Any]:
    config = KubernetesConfig(
        instance=data["HEDGEROW_INSTANCE"],
        namespace=data["HEDGEROW_K8S_NAMESPACE"],
        injector_image=data["HEDGEROW_K8S_INJECTOR_IMAGE"],
        images=tuple(i.strip() for i in data["HEDGEROW_K8S_IMAGES"].split(",")),
        default_image=data["HEDGEROW_K8S_DEFAULT_IMAGE"],
        snapshot_class=snapshot_class,
        read_only_root=bool(snapshot_class),
    )
    pod: dict[str, Any] = SERIALIZER.sanitize_for_serialization(build_pod(config, new_spec(**spec)))
    return pod


def test_the_policy_binds_to_the_sandbox_namespace_with_the_config_map_as_params(
    docs: list[dict[str, Any]],
) -> None:
    policy = of_kind(docs, "ValidatingAdmissionPolicy")
    binding = of_kind(docs, "ValidatingAdmissionPolicyBinding")
    config_map = of_kind(docs, "ConfigMap")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": config_map["data"]["HEDGEROW_K8S_NAMESPACE"]
    }
    assert binding["spec"]["paramRef"] == {
        "name": config_map["metadata"]["name"],
        "namespace": config_map["metadata"]["namespace"],
        "parameterNotFoundAction": "Deny",
    }


def test_the_policy_admits_every_pod_the_backend_builds(docs: list[dict[str, Any]]) -> None:
    policy = of_kind(docs, "ValidatingAdmissionPolicy")
    data = of_kind(docs, "ConfigMap")["data"]
    params = {"data": data}
    for image in [i.strip() for i in data["HEDGEROW_K8S_IMAGES"].split(",")]:
        assert evaluate(policy, sandbox_pod(data, image=image), params) == []
    private = sandbox_pod(data, registry_credentials=RegistryCredentials("u", "p"))
    assert evaluate(policy, private, params) == []
    assert evaluate(policy, sandbox_pod(data, network_access=True), params) == []
    # snapshots: the state claim, and a restore's image pinned by the digest it ran
    with_state = sandbox_pod(data, snapshot_class="csi")
    assert [v["persistentVolumeClaim"] for v in with_state["spec"]["volumes"][-1:]] == [
        {"claimName": with_state["metadata"]["name"] + "-state"}
    ]
    assert evaluate(policy, with_state, params) == []
    image = data["HEDGEROW_K8S_DEFAULT_IMAGE"] + "@sha256:" + "a" * 64
    restore = sandbox_pod(data, snapshot_class="csi", image=image, snapshot_id="b" * 32)
    assert evaluate(policy, restore, params) == []


def _volume(pod: dict[str, Any], volume: dict[str, Any]) -> dict[str, Any]:
    pod["spec"]["volumes"].append(volume)
    return pod


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (lambda p: p["spec"]["containers"][0].update(image="evil:latest"), "HEDGEROW_K8S_IMAGES"),
        (lambda p: p["spec"]["initContainers"][0].update(image="busybox"), "agent injector"),
        (lambda p: p["spec"].update(automountServiceAccountToken=True), "automountService"),
        (lambda p: p["spec"].pop("automountServiceAccountToken"), "automountServiceAccount"),
        (lambda p: _volume(p, {"name": "h", "hostPath": {"path": "/"}}), "only emptyDirs"),
        (lambda p: _volume(p, {"name": "c", "configMap": {"name": "x"}}), "only emptyDirs"),
        (lambda p: _volume(p, {"name": "s", "secret": {"secretName": "db"}}), "only emptyDirs"),
        (
            lambda p: _volume(
                p, {"name": "o", "persistentVolumeClaim": {"claimName": "hr-x-state"}}
            ),
            "only emptyDirs",
        ),
        (
            lambda p: p["spec"]["containers"][0].update(image="evil@sha256:" + "a" * 64),
            "HEDGEROW_K8S_IMAGES",
        ),
        (
            lambda p: p["spec"].update(ephemeralContainers=[{"name": "d", "image": "busybox"}]),
            "ephemeral",
        ),
    ],
)
def test_the_policy_refuses_what_the_backend_never_builds(
    docs: list[dict[str, Any]], change: Any, refusal: str
) -> None:
    policy = of_kind(docs, "ValidatingAdmissionPolicy")
    data = of_kind(docs, "ConfigMap")["data"]
    pod = sandbox_pod(data)
    change(pod)
    (failed,) = evaluate(policy, pod, {"data": data})
    assert refusal in failed


# ---- Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards)

BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def baseline_violations(spec: dict[str, Any]) -> set[str]:
    found = set()
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            found.add(field)
    if any("hostPath" in v for v in spec.get("volumes", [])):
        found.add("hostPath")
    if spec.get("securityContext", {}).get("seccompProfile", {}).get("type") == "Unconfined":
        found.add("seccomp")
    if spec.get("securityContext", {}).get("sysctls"):
        found.add("sysctls")
    for c in containers(spec):
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            found.add("privileged")
        if set(sc.get("capabilities", {}).get("add") or []) - BASELINE_CAPABILITIES:
            found.add("capabilities")
        if sc.get("procMount", "Default") != "Default":
            found.add("procMount")
        if sc.get("seccompProfile", {}).get("type") == "Unconfined":
            found.add("seccomp")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.add("hostPorts")
    return found


def restricted_violations(spec: dict[str, Any]) -> set[str]:
    found = baseline_violations(spec)
    pod_sc = spec.get("securityContext", {})
    for volume in spec.get("volumes", []):
        if not set(volume) - {"name"} <= RESTRICTED_VOLUMES:
            found.add("volume types")
    for c in containers(spec):
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            found.add("allowPrivilegeEscalation")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            found.add("runAsNonRoot")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            found.add("runAsUser=0")
        if "ALL" not in (sc.get("capabilities", {}).get("drop") or []):
            found.add("capabilities drop ALL")
        if set(sc.get("capabilities", {}).get("add") or []) - {"NET_BIND_SERVICE"}:
            found.add("capabilities")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.add("seccomp")
    return found


def test_the_checker_sees_what_each_level_forbids() -> None:
    privileged = {
        "hostPID": True,
        "volumes": [{"name": "r", "hostPath": {"path": "/"}}],
        "containers": [{"securityContext": {"privileged": True}}],
    }
    assert baseline_violations(privileged) == {"hostPID", "hostPath", "privileged"}
    assert "runAsNonRoot" in restricted_violations({"containers": [{}]})


@pytest.mark.parametrize(
    "overrides",
    [{}, {"run_as_user": "nonroot"}, {"runtime_class": "gvisor", "user_namespaces": False}],
)
def test_sandbox_pods_pass_baseline_and_miss_restricted_only_where_documented(
    overrides: dict[str, Any],
) -> None:
    config = KubernetesConfig(instance="prod", **overrides)
    pod = SERIALIZER.sanitize_for_serialization(build_pod(config, new_spec()))
    assert baseline_violations(pod["spec"]) == set()
    # namespaces.yaml says why the sandbox namespace is baseline: the default
    # capabilities a root sandbox keeps, and the image's user (root) kept, plus the
    # injector running as root without capabilities to read the 0400 Secret
    missing = restricted_violations(pod["spec"])
    assert missing <= {"capabilities", "runAsNonRoot", "runAsUser=0"}
    assert "capabilities" in missing


def test_control_plane_pods_pass_restricted(docs: list[dict[str, Any]]) -> None:
    workloads = [d for d in docs if d["kind"] in ("Deployment", "Job")]
    assert len(workloads) == 6  # web, worker, beat, watcher, resolver, migrate
    for workload in workloads:
        spec = copy.deepcopy(workload["spec"]["template"]["spec"])
        assert restricted_violations(spec) == set(), workload["metadata"]["name"]
