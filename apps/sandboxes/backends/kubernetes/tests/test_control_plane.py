"""The control plane's services over the Kubernetes backend (the FAKE API server): the
watcher ends a sandbox with the pod's reason, the reconciler converges the namespace
policy and forces out a pod its lost node never released."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.utils import timezone
from kubernetes import client

from apps.sandboxes.backends.kubernetes import KubernetesBackend
from apps.sandboxes.models import AuditRun, Sandbox, SandboxEvent, State
from apps.sandboxes.services import audit, reconcile, watching
from apps.sandboxes.tests.factories import make_sandbox

from .conftest import NS, eventually, new_spec
from .fakekube import FakeKube

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(120)]


def ready_on_the_cluster(
    fake: FakeKube, backend: KubernetesBackend, make_tenant: Callable[..., Any]
) -> Sandbox:
    tenant, _ = make_tenant()
    sandbox = make_sandbox(
        tenant,
        backend="kubernetes",
        memory_mib=512,
        ready_at=timezone.now() - timedelta(seconds=5),
    )
    fake.auto_start = True
    backend.provision(new_spec(sandbox_id=sandbox.id.hex, tenant_id=str(tenant.pk), memory_mib=512))
    fake.auto_start = False
    return sandbox


def lost_reason(sandbox: Sandbox) -> str:
    event = SandboxEvent.objects.filter(sandbox=sandbox, to_state=State.LOST).first()
    return event.reason if event else ""


@pytest.mark.django_db(transaction=True)  # the watcher closes old connections
@pytest.mark.parametrize(
    ("fixture", "reason", "message"),
    [
        ("oom_killed", "resource_exhausted", "resource_exhausted: memory: "),
        ("evicted", "evicted", "evicted by the kubelet: The node was low on resource"),
        ("node_lost", "node_lost", "node_lost (DeletionByTaintManager)"),
    ],
)
def test_the_watcher_ends_a_sandbox_with_the_pods_reason(
    fake: FakeKube,
    backend: KubernetesBackend,
    make_tenant: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    fixture: str,
    reason: str,
    message: str,
) -> None:
    monkeypatch.setattr(watching, "get_backend", lambda: backend)
    sandbox = ready_on_the_cluster(fake, backend, make_tenant)
    fake.load_status(NS, f"hr-{sandbox.id.hex}-1", fixture)
    eventually(lambda: watching.watch_backend_once(timeout_s=0.3))
    sandbox.refresh_from_db()
    assert sandbox.state == State.LOST
    assert lost_reason(sandbox) == reason
    assert sandbox.status_message.startswith(message)


def test_the_reconciler_restores_the_namespace_policy(
    fake: FakeKube, backend: KubernetesBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reconcile, "get_backend", lambda: backend)
    backend.ensure_namespace_policy()
    client.NetworkingV1Api(backend.api.api_client).delete_namespaced_network_policy(
        "hedgerow-t1-default", NS
    )
    run = reconcile.sandbox_reconcile()
    assert not run.skipped, run.skip_reason
    assert run.actions.get("namespace_policy_restored") == 1
    assert ("networkpolicies", NS, "hedgerow-t1-default") in fake.objects
    again = reconcile.sandbox_reconcile()
    assert "namespace_policy_restored" not in again.actions  # nothing to restore now


def test_the_reconciler_marks_lost_and_forces_out_a_pod_stuck_terminating(
    fake: FakeKube,
    make_backend: Callable[..., KubernetesBackend],
    make_tenant: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = make_backend(terminating_grace_s=0.0)
    monkeypatch.setattr(reconcile, "get_backend", lambda: backend)
    sandbox = ready_on_the_cluster(fake, backend, make_tenant)
    fake.graceful_pods = True
    fake.dead_nodes.add("node-a")  # deleted by someone; its kubelet never confirms
    client.CoreV1Api(backend.api.api_client).delete_namespaced_pod(f"hr-{sandbox.id.hex}-1", NS)
    run = reconcile.sandbox_reconcile()
    sandbox.refresh_from_db()
    assert sandbox.state == State.LOST, run.actions
    assert lost_reason(sandbox) == "resource_missing"
    assert ("pods", NS, f"hr-{sandbox.id.hex}-1") in fake.objects  # a plain delete: stuck
    # the next round finds the lost sandbox's residue and forces it out
    after = reconcile.sandbox_reconcile()
    assert after.actions.get("leak_reclaimed") == 1, after.details
    assert ("pods", NS, f"hr-{sandbox.id.hex}-1") not in fake.objects


def test_the_audit_command_reclaims_on_the_cluster(
    fake: FakeKube, backend: KubernetesBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`manage.py hedgerow_audit` (run in a worker pod on Kubernetes, docs): an
    installation-wide audit that reclaims what no sandbox record owns."""
    monkeypatch.setattr(audit, "get_backend", lambda: backend)
    monkeypatch.setattr(reconcile, "get_backend", lambda: backend)
    fake.auto_start = True
    orphan = new_spec()  # resources of a sandbox id the database does not know
    backend.provision(orphan)
    out = StringIO()
    call_command("hedgerow_audit", "--reconcile", "--reclaim", stdout=out)
    assert out.getvalue().startswith("reconcile: ")
    run = AuditRun.objects.get(trigger="manual")
    assert f"audit {run.pk}: " in out.getvalue()
    assert not [k for k in fake.objects if orphan.sandbox_id in k[2]]


def test_egress_over_the_api_patches_the_clusters_objects_and_reads_the_resolvers_log(
    fake: FakeKube,
    make_backend: Callable[..., KubernetesBackend],
    make_tenant: Callable[..., Any],
    api_client: Callable[[str], Any],
    monkeypatch: pytest.MonkeyPatch,
    settings: Any,
) -> None:
    """PATCH /sandboxes/{id} and GET /sandboxes/{id}/dns over the Kubernetes backend:
    the -egress policy's annotation (what the in-cluster resolver reads) follows, the
    ledger records it, a refused policy changes nothing, the log is the resolver's
    (dnslog.py), another team's sandbox is a 404."""
    import json

    from apps.core.egress import parse_egress
    from apps.core.redis_sync import redis_client
    from apps.sandboxes.backends.kubernetes import dnslog
    from apps.sandboxes.backends.kubernetes.egress_allow import A_POLICY
    from apps.sandboxes.services import egress

    settings.HEDGEROW_K8S_RESOLVER_IP = "10.96.0.53"
    backend = make_backend(resolver_ip="10.96.0.53")
    monkeypatch.setattr(egress, "get_backend", lambda: backend)
    tenant, secret = make_tenant()
    _, other_secret = make_tenant()
    allow = {"allow": ["pkg.example.org"], "dns": "filtered"}
    sandbox = make_sandbox(tenant, backend="kubernetes", egress=allow, network_access=True)
    fake.auto_start = True
    backend.provision(
        new_spec(
            sandbox_id=sandbox.id.hex,
            tenant_id=str(tenant.pk),
            network_access=True,
            egress=parse_egress(allow),
        )
    )
    key = ("networkpolicies", NS, f"hr-{sandbox.id.hex}-1-egress")

    def annotation() -> Any:
        return json.loads(fake.objects[key]["metadata"]["annotations"][A_POLICY])

    http = api_client(secret)
    url = f"/api/v1/sandboxes/{sandbox.external_id}"
    refused = http.patch(
        url, {"egress": {"allow": ["pkg.example.org"], "match": "sni"}}, format="json"
    )
    assert refused.status_code == 400, refused.content
    assert refused.json()["error"]["reason"] == "egress_unsupported"
    assert annotation() == allow
    patched = http.patch(url, {"egress": {"allow": ["git.example.org"]}}, format="json")
    assert patched.status_code == 200, patched.content
    assert annotation() == {"allow": ["git.example.org"], "dns": "filtered"}
    assert SandboxEvent.objects.filter(sandbox=sandbox, event="egress_changed").count() == 1
    assert api_client(other_secret).patch(url, {"egress": "all"}, format="json").status_code == 404
    assert annotation() == {"allow": ["git.example.org"], "dns": "filtered"}

    entry = {"ts": 1.0, "generation": 1, "name": "git.example.org", "type": "A"}
    entry |= {"allowed": True, "rcode": "NOERROR", "answer": [], "flags": []}
    redis = redis_client()
    try:
        dnslog.append(redis, "t1", sandbox.id.hex, entry)
        assert http.get(f"{url}/dns").json()["results"] == [entry]
        assert api_client(other_secret).get(f"{url}/dns").status_code == 404
    finally:
        redis.delete(dnslog.key("t1", sandbox.id.hex))
