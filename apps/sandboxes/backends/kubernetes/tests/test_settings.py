"""HEDGEROW_BACKEND=kubernetes: settings → a working backend (kubeconfig pointing at the
FAKE API server), and bad settings fail loudly."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from apps.sandboxes.backends.base import BackendError
from apps.sandboxes.backends.kubernetes import build_kubernetes_backend, config_from_settings

from .conftest import NS, new_spec
from .fakekube import FakeKube


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
