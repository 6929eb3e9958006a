"""Request budgets: the API calls one provision, one delete and one inventory make are a
fixed number, whatever the number of pods in the namespace (the FAKE API server counts
every request; watches, which are long-lived, are counted apart)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from apps.sandboxes.backends.kubernetes import KubernetesBackend

from .conftest import new_spec
from .fakekube import FakeKube

# provision: 2 metadata LISTs of the sandbox's older generations (pods, policies;
# secrets are never listed), the Pod, the token Secret (owned by the pod) — and the
# egress policy with network access; a process without an informer (a worker: only the
# watcher runs one) reads its pod once (and watches it alone while it starts)
PROVISION = 4
# one deletecollection of pods and one of policies, whatever the number of generations;
# secrets go with their pod (owner references, the garbage collector)
DELETE = 2


def calls_of(fake: FakeKube, action: Callable[[], object]) -> list[tuple[str, str]]:
    start = len(fake.requests)
    action()
    return [(m, p.rsplit("/", 1)[-1]) for m, p, _q in fake.calls(start)]


@pytest.mark.parametrize("everywhere", [False, True])
@pytest.mark.parametrize("others", [0, 25])
def test_a_provision_and_a_delete_cost_a_fixed_number_of_calls(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend], others: int, everywhere: bool
) -> None:
    backend = make_backend(informer_everywhere=everywhere)
    fake.auto_start = True
    backend.provision(new_spec())  # applies the namespace policy (and starts an informer)
    for _ in range(others):
        backend.provision(new_spec(network_access=True))
    spec = new_spec()
    provision = calls_of(fake, lambda: backend.provision(spec))
    read = [] if everywhere else [("GET", f"hr-{spec.sandbox_id}-1")]
    assert len(provision) == PROVISION + len(read), provision
    lists = [("GET", "pods"), ("GET", "networkpolicies")]
    assert sorted(provision) == sorted([*lists, ("POST", "secrets"), ("POST", "pods"), *read])
    with_network = calls_of(fake, lambda: backend.provision(new_spec(network_access=True)))
    assert len(with_network) == PROVISION + len(read) + 1
    delete = calls_of(fake, lambda: backend.destroy(spec.sandbox_id))
    assert sorted(delete) == [("DELETE", "networkpolicies"), ("DELETE", "pods")]
    assert not [k for k in fake.objects if k[2].startswith(f"hr-{spec.sandbox_id}")]
    assert len(delete) == DELETE


def test_an_inventory_costs_one_call_per_page_not_per_pod(
    fake: FakeKube, make_backend: Callable[..., KubernetesBackend]
) -> None:
    backend = make_backend(list_page_size=10)
    fake.auto_start = True
    for _ in range(25):
        backend.provision(new_spec())
    calls = calls_of(fake, backend.inventory)
    # pods: 3 pages of 10; policies: one page (none); secrets: never listed
    assert sorted(calls) == sorted([("GET", "pods")] * 3 + [("GET", "networkpolicies")])
