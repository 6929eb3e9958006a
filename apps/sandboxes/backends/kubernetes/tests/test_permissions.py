"""Permissions checked at start-up: each process asks the API server
(SelfSubjectAccessReview) for every verb its role uses and refuses to start, naming
each one missing, unless HEDGEROW_K8S_SKIP_PERMISSION_CHECK=1. The fake answers the
reviews from the Roles of deploy/ it enforces (conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from apps.sandboxes.backends.kubernetes import KubernetesBackend, build_kubernetes_backend
from apps.sandboxes.backends.kubernetes.permissions import REQUIRED, process_role

from .conftest import NS, service_account_grants
from .fakekube import FakeKube

PINNED = "registry.example/hedgerow-agent-injector@sha256:" + "ab" * 32


@contextmanager
def as_process(
    fake: FakeKube, tmp_path: Path, account: str, role: str, **extra: Any
) -> Iterator[None]:
    """Settings of a process running as ``account`` (its token) in ``role``."""
    path = tmp_path / f"kubeconfig-{account}"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters: [{{name: fake, cluster: {{server: '{fake.url}'}}}}]\n"
        f"users: [{{name: fake, user: {{token: {account}}}}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: fake}}]\n"
    )
    with override_settings(
        HEDGEROW_K8S_KUBECONFIG=str(path),
        HEDGEROW_K8S_AGENT_INGRESS_CIDRS=["192.0.2.0/24"],
        HEDGEROW_K8S_NAMESPACE=NS,
        HEDGEROW_K8S_INJECTOR_IMAGE=PINNED,
        HEDGEROW_K8S_PROCESS_ROLE=role,
        **extra,
    ):
        yield


def build(fake: FakeKube, tmp_path: Path, account: str, role: str, **extra: Any) -> None:
    with as_process(fake, tmp_path, account, role, **extra):
        backend: KubernetesBackend = build_kubernetes_backend()
    backend.close()


@pytest.mark.parametrize("role", ["web", "watcher", "worker"])
def test_a_process_whose_role_grants_everything_starts(
    fake: FakeKube, tmp_path: Path, role: str
) -> None:
    account = f"hedgerow-{role}"
    build(fake, tmp_path, account, role)
    asked = {
        (a["group"], a["resource"], a["verb"])
        for token, review in fake.access_reviews
        for a in [review["spec"]["resourceAttributes"]]
        if token == account and a["namespace"] == NS
    }
    assert asked == REQUIRED[role] <= service_account_grants()[account]
    assert len(fake.access_reviews) == len(REQUIRED[role])  # one review per permission


def test_a_role_missing_patch_networkpolicies_refuses_naming_every_missing_verb(
    fake: FakeKube, tmp_path: Path
) -> None:
    fake.grants["hedgerow-worker"] -= {
        ("networking.k8s.io", "networkpolicies", "patch"),
        ("", "secrets", "delete"),
    }
    with pytest.raises(ImproperlyConfigured) as refused:
        build(fake, tmp_path, "hedgerow-worker", "worker")
    message = str(refused.value)
    assert "worker process's ServiceAccount lacks 2 permission(s)" in message
    assert "patch networkpolicies.networking.k8s.io" in message
    assert "delete secrets" in message
    assert "HEDGEROW_K8S_SKIP_PERMISSION_CHECK=1" in message
    # asked, not tried: nothing was created or forbidden on the way
    assert fake.forbidden == []
    assert not fake.objects
    # the web's Role is read-only: as a worker it lacks every write, and says so
    with pytest.raises(ImproperlyConfigured, match="lacks 19 permission") as web:
        build(fake, tmp_path, "hedgerow-web", "worker")
    assert "create pods" in str(web.value)


def test_the_opt_out_starts_without_asking(fake: FakeKube, tmp_path: Path) -> None:
    fake.grants["hedgerow-worker"] -= {("networking.k8s.io", "networkpolicies", "patch")}
    build(fake, tmp_path, "hedgerow-worker", "worker", HEDGEROW_K8S_SKIP_PERMISSION_CHECK=True)
    assert fake.access_reviews == []


def test_the_role_comes_from_the_setting_or_the_command_line() -> None:
    assert process_role("", ["/usr/bin/celery", "-A", "controlplane", "worker"]) == "worker"
    assert process_role("", ["manage.py", "hedgerow_watch"]) == "watcher"
    assert process_role("", ["-m", "controlplane.serve", "x"]) == "web"
    assert process_role("watcher", ["celery", "worker"]) == "watcher"
    with pytest.raises(ValueError, match="HEDGEROW_K8S_PROCESS_ROLE 'beat'"):
        process_role("beat", [])


def test_an_unknown_role_refuses_to_start(fake: FakeKube, tmp_path: Path) -> None:
    with pytest.raises(ImproperlyConfigured, match="not one of web, watcher, worker"):
        build(fake, tmp_path, "hedgerow-worker", "scheduler")
    assert fake.access_reviews == []
