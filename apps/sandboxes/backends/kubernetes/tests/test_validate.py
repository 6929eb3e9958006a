"""kubernetes-validate (the OpenAPI JSON schemas of each Kubernetes release, strict:
unknown fields fail) on every manifest deploy/ renders and on every object the
backend generates, against the oldest release the guide supports for the whole
install (1.30: ValidatingAdmissionPolicy v1) and the newest the package knows."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import kubernetes_validate
import pytest

from apps.core.egress import parse_egress
from apps.sandboxes.backends.base import RegistryCredentials
from apps.sandboxes.backends.kubernetes import KubernetesConfig
from apps.sandboxes.backends.kubernetes.egress_allow import apply_pod_dns, egress_policy_for
from apps.sandboxes.backends.kubernetes.specs import (
    build_egress_policy,
    build_namespace_policy,
    build_pod,
    build_pull_secret,
    build_secret,
)

from .conftest import new_spec
from .test_manifests import OVERLAYS, SERIALIZER, build

VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


def validate(doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_manifest_validates(overlay: str, version: str) -> None:
    docs = build(overlay)
    assert len(docs) > 20
    for doc in docs:
        validate(doc, version)


CONFIGS: dict[str, Callable[[], KubernetesConfig]] = {
    "default": lambda: KubernetesConfig(instance="prod"),
    "gvisor": lambda: KubernetesConfig(
        instance="prod", runtime_class="gvisor", user_namespaces=False
    ),
    "hardened": lambda: KubernetesConfig(
        instance="prod",
        run_as_user="nonroot",
        read_only_root=True,
        node_selector={"pool": "sandboxes"},
        tolerations=[{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
        image_pull_secrets=("regcred",),
        dns_nameservers=("10.0.0.53",),
        agent_ingress_cidrs=("192.0.2.0/24",),
        protect_from_disruption=False,
    ),
    "dns-cidrs": lambda: KubernetesConfig(
        instance="prod", run_as_user="2000", dns_cidrs=("169.254.20.10/32",)
    ),
}


def generated(config: KubernetesConfig) -> list[Any]:
    spec = new_spec(network_access=True, registry_credentials=RegistryCredentials("u", "p"))
    allow = new_spec(
        network_access=True,
        egress=parse_egress({"allow": ["pkg.example.org", "192.0.2.0/24:443"]}),
    )
    resolving = dataclasses.replace(config, resolver_ip="10.96.0.53")
    allowlist_pod = build_pod(resolving, allow)
    apply_pod_dns(allowlist_pod, resolving, allow.egress_policy)
    return [
        build_pod(config, spec),
        allowlist_pod,
        build_secret(config, spec),
        build_pull_secret(config, spec),
        build_egress_policy(config, spec),
        build_namespace_policy(config),
        egress_policy_for(resolving, allow),
    ]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_generated_object_validates(name: str, version: str) -> None:
    objects = [o for o in generated(CONFIGS[name]()) if o is not None]
    assert {o.kind for o in objects} == {"Pod", "Secret", "NetworkPolicy"}
    for obj in objects:
        validate(SERIALIZER.sanitize_for_serialization(obj), version)


def test_a_field_the_schema_does_not_know_fails() -> None:
    pod = SERIALIZER.sanitize_for_serialization(build_pod(CONFIGS["default"](), new_spec()))
    pod["spec"]["containers"][0]["securityContex"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="securityContex"):
        validate(pod, VERSIONS[-1])
