"""Pod, Secret and NetworkPolicy specs, field by field, as the API server receives them."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from kubernetes import client

from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.kubernetes.config import DEFAULT_CAPABILITIES
from apps.sandboxes.backends.kubernetes.specs import (
    build_egress_policy,
    build_namespace_policy,
    build_pod,
    build_secret,
)

from .conftest import make_config, new_spec

SERIALIZER = client.ApiClient()

# a pod on a lost node is evicted after 30 s, not the default 300 (issue 25)
NODE_LOST = [
    {
        "key": f"node.kubernetes.io/{taint}",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 30,
    }
    for taint in ("not-ready", "unreachable")
]


def wire(obj: Any) -> dict[str, Any]:
    """The JSON the client sends (camelCase, None fields dropped)."""
    data: dict[str, Any] = SERIALIZER.sanitize_for_serialization(obj)
    return data


def labels_of(spec: Any) -> dict[str, str]:
    return {
        "app.kubernetes.io/managed-by": "hedgerow",
        "hedgerow.dev/instance": "t1",
        "hedgerow.dev/tenant": "42",
        "hedgerow.dev/sandbox": spec.sandbox_id,
        "hedgerow.dev/generation": "1",
        "hedgerow.dev/component": "sandbox",
    }


def test_it_runs_the_users_image_unmodified_with_the_agent_started_from_the_bundle() -> None:
    spec = new_spec(image="busybox:stable")
    pod = wire(build_pod(make_config(), spec))
    main = pod["spec"]["containers"][0]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["sandbox"]
    assert main["image"] == "busybox:stable"
    # the bundled loader starts the bundled interpreter: no shell or python needed
    assert main["command"] == [
        "/opt/hedgerow/bundle/lib/ld.so",
        "--library-path",
        "/opt/hedgerow/bundle/lib",
        "/opt/hedgerow/bundle/bin/python3",
        "-I",
        "-m",
        "hedgerow_launcher",
        "run",
        "--",
        "--listen",
        "0.0.0.0:7777",
        "--token-file",
        "/run/hedgerow/token",
        "--unlink-token",
        "--workdir",
        "/workspace",
    ]
    assert main["args"] == []  # the image's CMD must not be appended to our command
    assert "env" not in main and "envFrom" not in main  # the image's environment, untouched
    assert main["ports"] == [{"containerPort": 7777, "name": "agent"}]
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert mounts["hedgerow-agent"] == {
        "name": "hedgerow-agent",
        "mountPath": "/opt/hedgerow",
        "readOnly": True,
    }
    assert mounts["hedgerow-token"]["mountPath"] == "/run/hedgerow"
    assert "hedgerow-secret" not in mounts  # the Secret is mounted in the init container only
    assert mounts["workspace"]["mountPath"] == "/workspace"


def test_it_copies_the_bundle_and_token_in_an_init_container() -> None:
    spec = new_spec()
    pod = wire(build_pod(make_config(), spec))
    (init,) = pod["spec"]["initContainers"]
    assert init["image"] == "registry.example/hedgerow-agent-injector:1"
    assert init["command"][:4] == [
        "/hedgerow-bundle/lib/ld.so",
        "--library-path",
        "/hedgerow-bundle/lib",
        "/hedgerow-bundle/bin/python3",
    ]
    assert init["command"][7:] == [
        "inject",
        "--to",
        "/opt/hedgerow/bundle",
        "--token-from",
        "/var/run/hedgerow-secret/token",
        "--token-to",
        "/run/hedgerow/token",
    ]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert mounts == {
        "hedgerow-agent": "/opt/hedgerow",
        "hedgerow-token": "/run/hedgerow",
        "hedgerow-secret": "/var/run/hedgerow-secret",
    }
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["hedgerow-agent"]["emptyDir"] == {"sizeLimit": "256Mi"}
    assert volumes["hedgerow-token"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Mi"}
    assert volumes["hedgerow-secret"]["secret"] == {
        "secretName": f"hr-{spec.sandbox_id}-1-token",
        "defaultMode": 0o400,
        "optional": False,
    }


def test_it_keeps_the_agent_token_out_of_the_pod_spec() -> None:
    spec = new_spec()
    pod_json = json.dumps(wire(build_pod(make_config(), spec)))
    assert spec.agent_token not in pod_json
    assert base64.b64encode(spec.agent_token.encode()).decode() not in pod_json
    secret = wire(build_secret(make_config(), spec))
    assert secret["metadata"]["name"] == f"hr-{spec.sandbox_id}-1-token"
    assert secret["type"] == "Opaque"
    assert secret["immutable"] is True
    assert base64.b64decode(secret["data"]["token"]).decode() == spec.agent_token
    assert secret["metadata"]["labels"] == labels_of(spec)


def test_it_sets_requests_equal_to_limits_with_an_ephemeral_storage_limit() -> None:
    spec = new_spec(cpu_millis=1500, memory_mib=2048, disk_mib=4096, pids_limit=300)
    pod = wire(build_pod(make_config(), spec))
    resources = pod["spec"]["containers"][0]["resources"]
    # the bundle's emptyDir (256Mi) is counted on top of the sandbox's disk
    expected = {"cpu": "1500m", "memory": "2048Mi", "ephemeral-storage": "4352Mi"}
    assert resources == {"requests": expected, "limits": expected}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["workspace"]["emptyDir"] == {"sizeLimit": "4096Mi"}
    # no pod-level pids field exists: recorded for the operator, enforced by kubelet
    assert pod["metadata"]["annotations"]["hedgerow.dev/pids-limit"] == "300"
    # autoscalers must not drain a node holding a sandbox (it cannot move): deliberate
    annotations = pod["metadata"]["annotations"]
    assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    assert annotations["karpenter.sh/do-not-disrupt"] == "true"
    loose = wire(build_pod(make_config(protect_from_disruption=False), spec))["metadata"]
    assert loose["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "true"
    assert "karpenter.sh/do-not-disrupt" not in loose["annotations"]
    init = pod["spec"]["initContainers"][0]["resources"]
    assert init["requests"] == init["limits"]


def test_it_hardens_the_pod() -> None:
    pod = wire(build_pod(make_config(), new_spec()))
    ps = pod["spec"]
    assert ps["automountServiceAccountToken"] is False
    assert ps["enableServiceLinks"] is False
    assert ps["restartPolicy"] == "Never"
    assert ps["hostNetwork"] is False and ps["hostPID"] is False and ps["hostIPC"] is False
    assert ps["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    sc = ps["containers"][0]["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["capabilities"] == {"drop": ["ALL"], "add": list(DEFAULT_CAPABILITIES)}
    assert "NET_RAW" not in DEFAULT_CAPABILITIES and "SYS_ADMIN" not in DEFAULT_CAPABILITIES
    assert "runtimeClassName" not in ps and "nodeSelector" not in ps
    assert ps["tolerations"] == NODE_LOST  # nothing else by default


def test_it_probes_the_agents_health_endpoint() -> None:
    main = wire(build_pod(make_config(ready_timeout_s=90), new_spec()))["spec"]["containers"][0]
    for probe in (main["startupProbe"], main["readinessProbe"]):
        assert probe["httpGet"] == {"path": "/health", "port": "agent", "scheme": "HTTP"}
    assert main["startupProbe"]["periodSeconds"] == 1
    assert main["startupProbe"]["failureThreshold"] == 90  # one attempt a second
    assert "livenessProbe" not in main  # a dead agent ends the pod by itself


def test_it_applies_runtime_class_scheduling_and_pull_secrets_from_config() -> None:
    config = make_config(
        runtime_class="gvisor",
        node_selector={"pool": "sandboxes"},
        tolerations=[{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
        image_pull_secrets=("regcred",),
        capabilities=("CHOWN",),
    )
    ps = wire(build_pod(config, new_spec()))["spec"]
    assert ps["runtimeClassName"] == "gvisor"
    assert ps["nodeSelector"] == {"pool": "sandboxes"}
    assert ps["tolerations"] == [
        {"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"},
        *NODE_LOST,
    ]
    assert ps["imagePullSecrets"] == [{"name": "regcred"}]
    assert ps["containers"][0]["securityContext"]["capabilities"]["add"] == ["CHOWN"]


def test_it_labels_every_object_with_tenant_sandbox_generation_and_managed_by() -> None:
    spec = new_spec(network_access=True)
    config = make_config()
    pod = wire(build_pod(config, spec))
    assert pod["metadata"]["name"] == f"hr-{spec.sandbox_id}-1"
    assert pod["metadata"]["namespace"] == "sandboxes"
    assert json.loads(pod["metadata"]["annotations"]["hedgerow.dev/labels"]) == {"run": "r1"}
    for obj in (pod, wire(build_secret(config, spec)), wire(build_egress_policy(config, spec))):
        assert obj["metadata"]["labels"] == labels_of(spec)


def test_it_denies_all_traffic_except_control_plane_to_the_agent_port() -> None:
    policy = wire(build_namespace_policy(make_config()))
    assert policy["metadata"]["name"] == "hedgerow-t1-default"
    assert policy["metadata"]["labels"]["hedgerow.dev/component"] == "namespace-policy"
    spec = policy["spec"]
    assert spec["podSelector"] == {}  # every pod of the namespace
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["egress"] == []  # deny all egress
    assert spec["ingress"] == [
        {
            "from": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "hedgerow"}
                    },
                    "podSelector": {"matchLabels": {"hedgerow.dev/agent-client": "true"}},
                }
            ],
            "ports": [{"protocol": "TCP", "port": 7777}],
        }
    ]


def test_it_allows_egress_to_the_internet_but_not_the_cluster_or_metadata() -> None:
    spec = new_spec(network_access=True, generation=3)
    policy = wire(build_egress_policy(make_config(), spec))
    assert policy["metadata"]["name"] == f"hr-{spec.sandbox_id}-3-egress"
    ps = policy["spec"]
    assert ps["podSelector"] == {
        "matchLabels": {
            "hedgerow.dev/instance": "t1",
            "hedgerow.dev/sandbox": spec.sandbox_id,
            "hedgerow.dev/generation": "3",
        }
    }
    assert ps["policyTypes"] == ["Egress"]
    assert "ingress" not in ps  # ingress stays with the namespace policy
    internet, dns = ps["egress"]
    v4, v6 = internet["to"]
    assert v4["ipBlock"]["cidr"] == "0.0.0.0/0"
    for blocked in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"):
        assert blocked in v4["ipBlock"]["except"]
    assert v6["ipBlock"]["cidr"] == "::/0"
    assert "fc00::/7" in v6["ipBlock"]["except"]
    assert "ports" not in internet
    assert dns["to"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
    }
    assert dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert dns["ports"] == [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]


def test_it_refuses_names_kubernetes_would_reject() -> None:
    with pytest.raises(BackendError):
        build_pod(make_config(), new_spec(image="bad image; rm -rf"))
    with pytest.raises(BackendError):
        build_pod(make_config(), new_spec(sandbox_id="NOT-hex"))
    with pytest.raises(BackendError):
        build_pod(make_config(), new_spec(tenant_id="a tenant"))
    with pytest.raises(BackendError):
        make_config(instance="bad instance")
