"""Fixtures: the real ``kubernetes`` client against the in-process FAKE API server."""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

from apps.sandboxes.backends.base import SandboxSpec
from apps.sandboxes.backends.kubernetes import KubeApi, KubernetesBackend, KubernetesConfig

from .fakekube import FakeKube

NS = "sandboxes"


@functools.cache
def service_account_grants() -> dict[str, frozenset[tuple[str, str, str]]]:
    """Each ServiceAccount of deploy/ → what its Roles grant (rendered once)."""
    from .test_manifests import build
    from .test_rbac import granted

    docs = build("deploy/overlays/example")
    return {
        d["spec"]["template"]["spec"]["serviceAccountName"]: frozenset(
            granted(docs, d["metadata"]["name"])
        )
        for d in docs
        if d["kind"] == "Deployment"
    }


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    """The fake API server, enforcing deploy/'s Roles for the backends make_backend
    builds (they run as the worker's ServiceAccount unless told otherwise)."""
    kube = FakeKube().start()
    kube.grants = {name: set(verbs) for name, verbs in service_account_grants().items()}
    yield kube
    kube.stop()
    assert kube.forbidden == [], "a request deploy/'s Roles do not grant"


def make_config(**overrides: Any) -> KubernetesConfig:
    fields: dict[str, Any] = {
        "instance": "t1",
        "namespace": NS,
        "controlplane_namespace": "hedgerow",
        "injector_image": "registry.example/hedgerow-agent-injector:1",
        "images": ("python:3.12-slim", "busybox:stable"),
        "default_image": "python:3.12-slim",
        "ready_timeout_s": 10.0,
        "watch_timeout_s": 1,
        "api_retries": 3,
        # no request rate: these tests make bursts of calls on purpose; the limiter has
        # its own tests (test_rate_limit.py)
        "api_qps": 0.0,
    }
    fields.update(overrides)
    return KubernetesConfig(**fields)


@pytest.fixture
def make_backend(fake: FakeKube) -> Iterator[Callable[..., KubernetesBackend]]:
    made: list[KubernetesBackend] = []

    def make(account: str = "hedgerow-worker", **overrides: Any) -> KubernetesBackend:
        configuration = client.Configuration()
        configuration.host = fake.url
        configuration.api_key = {"authorization": f"Bearer {account}"}
        configuration.retries = False  # as in production: KubeApi does the retrying
        config = make_config(**overrides)
        backend = KubernetesBackend(
            config, KubeApi(client.ApiClient(configuration), config, backoff_s=0.01)
        )
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


@pytest.fixture
def backend(make_backend: Callable[..., KubernetesBackend]) -> KubernetesBackend:
    return make_backend()


def new_spec(**overrides: Any) -> SandboxSpec:
    fields: dict[str, Any] = {
        "sandbox_id": uuid.uuid4().hex,
        "tenant_id": "42",
        "generation": 1,
        "image": "python:3.12-slim",
        "cpu_millis": 500,
        "memory_mib": 256,
        "network_access": False,
        "agent_token": "tok-" + uuid.uuid4().hex,
        "labels": {"run": "r1"},
    }
    fields.update(overrides)
    return SandboxSpec(**fields)


def eventually(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def kubelet_later(fake: FakeKube, name: str, **status: Any) -> threading.Thread:
    """Once pod ``name`` exists, writes ``status`` as the kubelet would."""

    def run() -> None:
        eventually(lambda: ("pods", NS, name) in fake.objects)
        fake.set_pod_status(NS, name, **status)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
