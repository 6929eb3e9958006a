"""HEDGEROW_BACKEND=kubernetes: settings → a working backend (kubeconfig pointing at the
FAKE API server), and bad settings fail loudly."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from apps.sandboxes.apps import SandboxesConfig
from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.kubernetes import build_kubernetes_backend, config_from_settings

from .conftest import NS, new_spec
from .fakekube import FakeKube

PINNED = "registry.example/hedgerow-agent-injector@sha256:" + "ab" * 32


def kubeconfig(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters: [{{name: fake, cluster: {{server: '{url}'}}}}]\n"
        "users: [{name: fake, user: {token: fake-token}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: fake}}]\n"
    )
    return path


def test_it_builds_the_backend_from_settings_and_a_kubeconfig(
    fake: FakeKube, tmp_path: Path
) -> None:
    fake.auto_start = True
    with override_settings(
        HEDGEROW_INSTANCE="s1",
        HEDGEROW_K8S_KUBECONFIG=str(kubeconfig(tmp_path, fake.url)),
        HEDGEROW_K8S_AGENT_INGRESS_CIDRS=["192.0.2.0/24"],  # outside the cluster
        HEDGEROW_K8S_NAMESPACE=NS,
        HEDGEROW_K8S_IMAGES=["busybox:stable"],
        HEDGEROW_K8S_DEFAULT_IMAGE="busybox:stable",
        HEDGEROW_K8S_RUNTIME_CLASS="gvisor",
        HEDGEROW_K8S_NODE_SELECTOR='{"pool": "sandboxes"}',
        HEDGEROW_K8S_INJECTOR_IMAGE=PINNED,
    ):
        backend = build_kubernetes_backend()
    try:
        endpoint = backend.provision(new_spec(image="host"))
        assert endpoint.isolation == "pod+gvisor"
        (pod,) = [o for (r, _, _), o in fake.objects.items() if r == "pods"]
        assert pod["spec"]["runtimeClassName"] == "gvisor"
        assert pod["spec"]["nodeSelector"] == {"pool": "sandboxes"}
        assert pod["spec"]["containers"][0]["image"] == "busybox:stable"
        assert pod["metadata"]["labels"]["hedgerow.dev/instance"] == "s1"
        assert fake.count("POST", "/pods") == 1
    finally:
        backend.close()


@pytest.mark.parametrize(
    "name,value",
    [("HEDGEROW_K8S_NODE_SELECTOR", "pool=sandboxes"), ("HEDGEROW_K8S_TOLERATIONS", "{}")],
)
def test_it_fails_loudly_on_malformed_json_settings(name: str, value: str) -> None:
    with override_settings(**{name: value}), pytest.raises(ImproperlyConfigured, match=name):
        config_from_settings()


def test_it_reads_the_pod_boundary_from_settings_with_user_namespaces_on_by_default() -> None:
    config = config_from_settings()
    assert (config.user_namespaces, config.run_as_user, config.read_only_root) == (
        True,
        "auto",
        False,
    )
    with override_settings(
        HEDGEROW_K8S_USER_NAMESPACES=False,
        HEDGEROW_K8S_RUN_AS_USER="2000",
        HEDGEROW_K8S_READ_ONLY_ROOT=True,
    ):
        config = config_from_settings()
    assert (config.user_namespaces, config.run_as_user, config.read_only_root) == (
        False,
        "2000",
        True,
    )
    assert config.main_user() == (2000, True)
    with override_settings(HEDGEROW_K8S_RUN_AS_USER=""):  # an empty ConfigMap value
        assert config_from_settings().run_as_user == "auto"
    with (
        override_settings(HEDGEROW_K8S_RUN_AS_USER="root"),
        pytest.raises(BackendError, match="run_as_user"),
    ):
        config_from_settings()


def start_kubernetes_process(**overrides: object) -> None:
    """What every process does at start (AppConfig.ready) with these settings."""
    import apps.sandboxes as package

    with override_settings(HEDGEROW_BACKEND="kubernetes", **overrides):
        SandboxesConfig("sandboxes", package).ready()


def test_it_refuses_to_start_without_a_pod_boundary_unless_told_to() -> None:
    no_boundary = {"HEDGEROW_K8S_USER_NAMESPACES": False, "HEDGEROW_K8S_RUNTIME_CLASS": ""}
    with pytest.raises(ImproperlyConfigured) as refused:
        start_kubernetes_process(HEDGEROW_K8S_INJECTOR_IMAGE=PINNED, **no_boundary)
    message = str(refused.value)
    assert "refuses to start" in message and "neither a user namespace" in message
    assert "HEDGEROW_K8S_ALLOW_NO_BOUNDARY=1" in message
    assert "not pinned" not in message  # only what is wrong
    with override_settings(HEDGEROW_K8S_INJECTOR_IMAGE=PINNED, **no_boundary):
        with pytest.raises(ImproperlyConfigured, match="neither a user namespace"):
            build_kubernetes_backend()  # the backend itself refuses too
    # either boundary, or the explicit opt-in, starts
    start_kubernetes_process(HEDGEROW_K8S_INJECTOR_IMAGE=PINNED)
    start_kubernetes_process(
        HEDGEROW_K8S_INJECTOR_IMAGE=PINNED,
        HEDGEROW_K8S_USER_NAMESPACES=False,
        HEDGEROW_K8S_RUNTIME_CLASS="gvisor",
    )
    start_kubernetes_process(
        HEDGEROW_K8S_INJECTOR_IMAGE=PINNED, HEDGEROW_K8S_ALLOW_NO_BOUNDARY=True, **no_boundary
    )


@pytest.mark.parametrize(
    "image",
    [
        "registry.example/hedgerow-agent-injector:latest",
        "registry.example/hedgerow-agent-injector:1.0.0",
        "registry.example/hedgerow-agent-injector",
        "registry.example/hedgerow-agent-injector@sha256:abc",  # not a digest
    ],
)
def test_it_refuses_an_injector_image_not_pinned_by_digest_unless_told_to(image: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="not pinned by digest") as refused:
        start_kubernetes_process(HEDGEROW_K8S_INJECTOR_IMAGE=image)
    assert "HEDGEROW_K8S_ALLOW_UNPINNED_INJECTOR=1" in str(refused.value)
    start_kubernetes_process(
        HEDGEROW_K8S_INJECTOR_IMAGE=image, HEDGEROW_K8S_ALLOW_UNPINNED_INJECTOR=True
    )
    start_kubernetes_process(HEDGEROW_K8S_INJECTOR_IMAGE=image.split("@")[0] + PINNED[-72:])


def test_it_reads_the_disruption_setting() -> None:
    assert config_from_settings().protect_from_disruption is True
    with override_settings(HEDGEROW_K8S_PROTECT_FROM_DISRUPTION=False):
        assert config_from_settings().protect_from_disruption is False
