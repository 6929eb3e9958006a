"""The informer's LIST and WATCH and the reconciler's inventory read the API server's
JSON, not the generated client's models (deserialising 10,000 pods into them cost 16 s
of CPU per list, see docs/benchmarks.md). What a pod means must not change with that:
the views of the real-pod fixtures are compared with ``views.json``, which the
model-based reader produced before the change, and a pod read by GET (a model, turned
back into JSON) gives the same view as the same pod listed."""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from apps.sandboxes.backends.kubernetes import KubernetesBackend
from apps.sandboxes.backends.kubernetes.config import L_GENERATION, L_SANDBOX
from apps.sandboxes.backends.kubernetes.informer import pod_view

from .conftest import eventually, new_spec
from .fakekube import FIXTURES, FakeKube, load_fixture

FIXTURE_NAMES = sorted(p.stem for p in (FIXTURES).glob("*.json"))
GOLDEN = Path(__file__).parent / "fixtures" / "views.json"
SANDBOX = "0123456789abcdef0123456789abcdef"


def full_pod(fixture: str) -> dict[str, Any]:
    """A fixture (status, nodeName, deletion) over a whole pod: the generated model
    refuses a pod without containers."""
    data = load_fixture(fixture)
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"hr-{SANDBOX}-1",
            "namespace": "sandboxes",
            "resourceVersion": "4711",
            "labels": {L_SANDBOX: SANDBOX, L_GENERATION: "1"},
        },
        "spec": {
            "containers": [
                {
                    "name": "sandbox",
                    "image": "python:3.12",
                    "resources": {"limits": {"memory": "512Mi"}},
                }
            ]
        },
    }
    pod["metadata"].update(data.get("metadata") or {})
    pod["spec"].update(data.get("spec") or {})
    pod["status"] = copy.deepcopy(data["status"])
    return pod


def test_every_fixture_has_its_view_from_before() -> None:
    assert sorted(json.loads(GOLDEN.read_text())) == FIXTURE_NAMES
    assert len(FIXTURE_NAMES) >= 9


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_a_pod_read_as_json_means_what_it_meant_read_as_a_model(fixture: str) -> None:
    expected = json.loads(GOLDEN.read_text())[fixture]
    raw = full_pod(fixture)
    assert dataclasses.asdict(pod_view(raw)) == expected
    api = client.ApiClient()  # the GET fallback's path: a model, back to JSON
    model = api.deserialize(type("Response", (), {"data": json.dumps(raw)})(), "V1Pod")
    assert dataclasses.asdict(pod_view(api.sanitize_for_serialization(model))) == expected


def test_the_informer_and_the_inventory_build_no_models(
    fake: FakeKube,
    make_backend: Callable[..., KubernetesBackend],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = make_backend(informer_everywhere=True)
    fake.auto_start = True
    specs = [new_spec() for _ in range(3)]
    for spec in specs:
        backend.provision(spec)
    built: list[str] = []
    provisioning = threading.Event()  # the other backend's create returns a model
    original = client.ApiClient._ApiClient__deserialize

    def counting(self: Any, data: Any, klass: Any) -> Any:
        if klass in ("V1PodList", "V1Pod") and not (
            provisioning.is_set() and threading.current_thread() is threading.main_thread()
        ):
            built.append(klass)
        return original(self, data, klass)

    monkeypatch.setattr(client.ApiClient, "_ApiClient__deserialize", counting)
    fresh = make_backend(informer_everywhere=True)
    items = fresh.inventory()
    assert sorted(str(i.sandbox_id) for i in items if i.kind == "pod") == sorted(
        s.sandbox_id for s in specs
    )
    for spec in specs:
        endpoint = fresh.endpoint(spec.sandbox_id)  # starts and syncs its informer
        assert endpoint is not None and endpoint.host
    assert fresh.informer.running and len(fresh.informer.pods) == len(specs)
    later = new_spec()
    provisioning.set()
    backend.provision(later)  # reaches the fresh informer as watch events
    provisioning.clear()
    eventually(lambda: fresh.informer.for_sandbox(later.sandbox_id))
    assert built == []
