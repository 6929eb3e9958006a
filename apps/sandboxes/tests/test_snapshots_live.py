"""Snapshots and forks against the real stack (issue 16): uvicorn, a Celery worker,
Postgres, Redis and real sandboxes on the local backend."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from apps.sandboxes.backends import get_backend
from apps.sandboxes.models import Sandbox, SandboxEvent, Snapshot
from apps.sandboxes.tests.live_api import api_client, ready_sandbox

pytestmark = pytest.mark.timeout(300)

PROBES = [
    # -A, not -a: `..` of /workspace and /tmp is the sandbox's own root, made when the
    # sandbox started, so a child started in the next minute lists a different time for it
    {"name": "files", "command": "ls -lA /workspace /tmp | sed 1d; cat /workspace/state.txt"},
    {"name": "sum", "command": ["sh", "-c", "sha256sum /workspace/data.bin"]},
]


def _settled(http: httpx.Client, path: str, until: tuple[str, ...], timeout: float = 60) -> Any:
    """Polls ``path`` until its ``state`` is one of ``until`` (deadline, no fixed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        body = http.get(path).json()
        if body.get("state") in until or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def _exec(http: httpx.Client, sandbox: str, command: str) -> dict[str, Any]:
    ran = http.post(f"/sandboxes/{sandbox}/exec", json={"command": command})
    assert ran.status_code == 200, ran.text
    body: dict[str, Any] = ran.json()
    return body


def _snapshot(http: httpx.Client, sandbox: str, **body: Any) -> dict[str, Any]:
    made = http.post(f"/sandboxes/{sandbox}/snapshots", json=body)
    assert made.status_code == 202, made.text
    assert made.json()["state"] == "capturing"
    snap: dict[str, Any] = _settled(http, f"/snapshots/{made.json()['id']}", ("ready", "failed"))
    return snap


def _children_settled(http: httpx.Client, ids: list[str]) -> list[dict[str, Any]]:
    return [
        _settled(http, f"/sandboxes/{i}", ("ready", "failed", "lost", "deleted"), 120) for i in ids
    ]


def test_it_forks_eight_children_that_each_have_the_parents_state(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    parent = ready_sandbox(http)
    setup = _exec(
        http,
        parent,
        "echo step-7 > /workspace/state.txt && head -c 1048576 /dev/urandom > /workspace/data.bin"
        " && echo scratch > /tmp/scratch",
    )
    assert setup["exit_code"] == 0, setup
    manifest = {"messages": [{"role": "user", "content": "fix the bug"}], "seed": 7}
    snap = _snapshot(http, parent, name="step-7", manifest=manifest, probes=PROBES)
    assert snap["state"] == "ready", snap
    assert snap["manifest"] == manifest and snap["sandbox"] == parent
    assert snap["fingerprint"]["tree"].startswith("sha256:")
    assert set(snap["fingerprint"]["probes"]) == {"files", "sum"}
    assert snap["fingerprint"]["probes"]["files"]["stdout"].endswith("step-7\n")
    assert snap["size_bytes"] >= 1 << 20 and snap["capture_s"] is not None
    # the parent runs on; what it writes after the capture is not in the snapshot
    assert _exec(http, parent, "echo later > /workspace/later.txt")["exit_code"] == 0

    forked = http.post(
        f"/snapshots/{snap['id']}/fork", json={"count": 8}, headers={"Idempotency-Key": "f1"}
    )
    assert forked.status_code == 201, forked.text
    ids = [c["id"] for c in forked.json()["sandboxes"]]
    assert len(set(ids)) == 8
    # a retried fork with the same key creates nothing more
    again = http.post(
        f"/snapshots/{snap['id']}/fork", json={"count": 8}, headers={"Idempotency-Key": "f1"}
    )
    assert again.status_code == 200 and [c["id"] for c in again.json()["sandboxes"]] == ids
    assert Sandbox.objects.filter(snapshot_id=snap["id"]).count() == 8

    children = _children_settled(http, ids)
    assert [c["state"] for c in children] == ["ready"] * 8, [c["status_message"] for c in children]
    parent_sum = _exec(http, parent, "sha256sum /workspace/data.bin")["stdout"]
    for child in children:
        assert child["from_snapshot"] == snap["id"] and child["divergence"] is None
        got = _exec(
            http,
            child["id"],
            "cat /workspace/state.txt /tmp/scratch; sha256sum /workspace/data.bin",
        )
        assert got["stdout"] == "step-7\nscratch\n" + parent_sum
        assert _exec(http, child["id"], "test -e /workspace/later.txt || echo absent")[
            "stdout"
        ] == ("absent\n")
    # a child's writes reach neither its siblings nor the parent
    assert _exec(http, ids[0], "echo child-0 > /workspace/state.txt")["exit_code"] == 0
    for other in (ids[1], parent):
        assert _exec(http, other, "cat /workspace/state.txt")["stdout"] == "step-7\n"

    listed = http.get(f"/sandboxes/{parent}/snapshots").json()["results"]
    assert [s["id"] for s in listed] == [snap["id"]]
    deleted = http.delete(f"/snapshots/{snap['id']}")
    assert deleted.status_code == 200 and deleted.json()["state"] == "deleted"
    deadline = time.monotonic() + 30
    while snap["id"].replace("-", "") in get_backend().snapshots():  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the worker did not remove the snapshot"
        time.sleep(0.1)
    # children keep their state; the snapshot cannot be forked any more
    assert _exec(http, ids[2], "cat /workspace/state.txt")["stdout"] == "step-7\n"
    refused = http.post(f"/snapshots/{snap['id']}/fork", json={"count": 1})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "snapshot_not_ready"


def test_a_diverging_probe_fails_the_child_with_its_diff_and_a_volatile_one_does_not(
    live, make_tenant
):
    _, secret = make_tenant()
    http = api_client(live, secret)
    parent = ready_sandbox(http)
    assert _exec(http, parent, "echo x > /workspace/x")["exit_code"] == 0
    clock = {"name": "clock", "command": "date +%s%N"}
    strict = _snapshot(http, parent, probes=[clock])
    lenient = _snapshot(http, parent, probes=[{**clock, "volatile": True}])
    assert strict["state"] == lenient["state"] == "ready"

    made = http.post("/sandboxes", json={"from_snapshot": strict["id"]})
    assert made.status_code == 201, made.text
    (failed,) = _children_settled(http, [made.json()["id"]])
    assert failed["state"] == "failed"
    (entry,) = failed["divergence"]
    assert entry["probe"] == "clock"
    assert entry["expected"]["stdout"] == strict["fingerprint"]["probes"]["clock"]["stdout"]
    assert entry["actual"]["stdout"] != entry["expected"]["stdout"]
    row = Sandbox.objects.get(external_id=failed["id"])
    assert SandboxEvent.objects.filter(sandbox=row, reason="state_divergence").exists()
    assert not [i for i in get_backend().inventory() if i.sandbox_id == row.id.hex]

    made = http.post("/sandboxes", json={"from_snapshot": lenient["id"]})
    (ok,) = _children_settled(http, [made.json()["id"]])
    assert ok["state"] == "ready" and ok["divergence"] is None
    assert _exec(http, ok["id"], "cat /workspace/x")["stdout"] == "x\n"


def test_a_capture_that_fails_is_reported_and_leaves_nothing(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    parent = ready_sandbox(http)
    row = Sandbox.objects.get(external_id=parent)
    get_backend().destroy(row.id.hex)  # gone behind the control plane's back
    snap = _snapshot(http, parent)
    assert snap["state"] == "failed", snap
    assert snap["error"]["code"] == "sandbox_not_running"
    assert snap["fingerprint"] == {} and snap["captured_at"] is None
    assert snap["id"].replace("-", "") not in get_backend().snapshots()  # type: ignore[attr-defined]
    refused = http.post(f"/snapshots/{snap['id']}/fork", json={"count": 2})
    assert refused.status_code == 409
    assert Sandbox.objects.filter(snapshot_id=snap["id"]).count() == 0


def test_another_tenants_snapshot_is_a_404(live, make_tenant):
    _, owner_secret = make_tenant()
    _, other_secret = make_tenant()
    owner, other = api_client(live, owner_secret), api_client(live, other_secret)
    parent = ready_sandbox(owner)
    snap = _snapshot(owner, parent)
    assert snap["state"] == "ready"
    path = f"/snapshots/{snap['id']}"
    assert other.get(path).status_code == 404
    assert other.get(path).json()["error"]["code"] == "snapshot_not_found"
    assert other.delete(path).status_code == 404
    assert other.post(f"{path}/fork", json={"count": 1}).status_code == 404
    assert other.post("/sandboxes", json={"from_snapshot": snap["id"]}).status_code == 404
    assert other.get("/snapshots").json()["results"] == []
    assert other.post(f"/sandboxes/{parent}/snapshots", json={}).status_code == 404
    assert Snapshot.objects.get(pk=snap["id"]).state == "ready"
    assert Sandbox.objects.filter(snapshot_id=snap["id"]).count() == 0
    assert owner.delete(path).json()["state"] == "deleted"


def test_bad_snapshot_requests_are_typed_and_record_nothing(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    parent = ready_sandbox(http)
    bad = http.post(f"/sandboxes/{parent}/snapshots", json={"probes": [{"command": 3}]})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "probes"
    assert Snapshot.objects.count() == 0
    snap = _snapshot(http, parent)
    too_many = http.post(f"/snapshots/{snap['id']}/fork", json={"count": 65})
    assert too_many.status_code == 400 and too_many.json()["error"]["field"] == "count"
    wrong_image = http.post(
        "/sandboxes", json={"from_snapshot": snap["id"], "image": "docker.io/library/busybox"}
    )
    assert wrong_image.status_code == 400
    assert wrong_image.json()["error"]["code"] == "snapshot_image_mismatch"
    assert Sandbox.objects.filter(snapshot_id=snap["id"]).count() == 0
    http.delete(f"/snapshots/{snap['id']}")


def test_a_fork_over_the_quota_is_refused_whole(live, make_tenant):
    from apps.billing.models import TenantQuota
    from apps.billing.quotas import quota_get

    tenant, secret = make_tenant()
    http = api_client(live, secret)
    parent = ready_sandbox(http)
    snap = _snapshot(http, parent)
    TenantQuota.objects.filter(pk=quota_get(tenant=tenant).pk).update(max_concurrent_sandboxes=3)
    refused = http.post(f"/snapshots/{snap['id']}/fork", json={"count": 3})
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "quota_exceeded"
    assert Sandbox.objects.filter(snapshot_id=snap["id"]).count() == 0  # not one of them
    fits = http.post(f"/snapshots/{snap['id']}/fork", json={"count": 2})
    assert fits.status_code == 201, fits.text
    children = _children_settled(http, [c["id"] for c in fits.json()["sandboxes"]])
    assert [c["state"] for c in children] == ["ready", "ready"]


def test_an_expired_snapshot_is_reaped_with_its_reason(live, make_tenant):
    from datetime import timedelta

    from django.utils import timezone

    from apps.sandboxes.services.provisioning import sandbox_reap

    _, secret = make_tenant()
    http = api_client(live, secret)
    parent = ready_sandbox(http)
    short = _snapshot(http, parent, ttl_seconds=60)
    long = _snapshot(http, parent, ttl_seconds=3600)
    counts = sandbox_reap(now=timezone.now() + timedelta(seconds=120))
    assert counts["snapshot_ttl_expired"] == 1
    reaped = http.get(f"/snapshots/{short['id']}").json()
    assert reaped["state"] == "deleted"
    assert Snapshot.objects.get(pk=short["id"]).deleted_reason == "ttl_expired"
    assert http.get(f"/snapshots/{long['id']}").json()["state"] == "ready"
    backend = get_backend()
    deadline = time.monotonic() + 30
    while short["id"].replace("-", "") in backend.snapshots():  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the worker did not remove the reaped snapshot"
        time.sleep(0.1)
    assert long["id"].replace("-", "") in backend.snapshots()  # type: ignore[attr-defined]


def test_an_image_sandbox_forks_with_its_root_and_the_snapshot_keeps_the_image(
    live, make_tenant, open_registry, tmp_path
):
    from apps.images.tests.conftest import push_image

    _, secret = make_tenant()
    http = api_client(live, secret)
    ref, digest = push_image(open_registry, tmp_path, f"t{time.time_ns()}/snap")
    parent = ready_sandbox(http, image=ref)
    made = _exec(
        http, parent, "echo root-write > /etc/new && rm /bin/env && echo ws > /workspace/w"
    )
    assert made["exit_code"] == 0, made
    probes = [{"name": "root", "command": "cat /etc/new; ls /bin"}]
    snap = _snapshot(http, parent, probes=probes)
    assert snap["state"] == "ready" and snap["image"] == ref and snap["image_digest"] == digest
    # the parent goes, and the image cache is collected down to nothing: the
    # snapshot's lease keeps the image's layers for its children
    assert http.delete(f"/sandboxes/{parent}").status_code == 202
    _settled(http, f"/sandboxes/{parent}", ("deleted",))
    backend = get_backend()
    backend._image_store().collect(0)  # type: ignore[attr-defined]
    assert backend._image_store().get(digest) is not None  # type: ignore[attr-defined]

    forked = http.post(f"/snapshots/{snap['id']}/fork", json={"count": 2})
    assert forked.status_code == 201, forked.text
    children = _children_settled(http, [c["id"] for c in forked.json()["sandboxes"]])
    assert [c["state"] for c in children] == ["ready", "ready"], children
    for child in children:
        assert child["image"] == ref and child["image_digest"] == digest
        got = _exec(http, child["id"], "cat /etc/new /workspace/w; test -e /bin/env || echo gone")
        assert got["stdout"] == "root-write\nws\ngone\n"
    assert _exec(http, children[0]["id"], "echo mine > /etc/new")["exit_code"] == 0
    assert _exec(http, children[1]["id"], "cat /etc/new")["stdout"] == "root-write\n"


def test_pause_releases_compute_and_resume_keeps_every_file_under_a_new_generation(
    live, make_tenant
):
    _, secret = make_tenant()
    http = api_client(live, secret)
    sandbox = ready_sandbox(http)
    row = Sandbox.objects.get(external_id=sandbox)
    assert _exec(http, sandbox, "echo kept > /workspace/k && echo tmp > /tmp/t")["exit_code"] == 0

    paused = http.post(f"/sandboxes/{sandbox}/pause")
    assert paused.status_code == 202, paused.text
    assert paused.json()["state"] == "paused"
    refused = http.post(f"/sandboxes/{sandbox}/exec", json={"command": "true"})
    assert refused.status_code == 409, refused.text
    backend = get_backend()
    deadline = time.monotonic() + 60
    # compute released: no process, address or cgroup left for it
    while [i for i in backend.inventory() if i.sandbox_id == row.id.hex]:
        assert time.monotonic() < deadline, "the pause did not release the sandbox"
        time.sleep(0.1)
    (pause,) = Snapshot.objects.filter(sandbox=row, kind="pause")
    pause.refresh_from_db()
    assert pause.state == "ready"
    assert http.post(f"/sandboxes/{sandbox}/pause").status_code == 409  # not ready
    waited = http.get(f"/sandboxes/{sandbox}/wait", params={"timeout": 30})
    assert waited.status_code == 409 and waited.json()["error"]["code"] == "sandbox_paused"

    resumed = http.post(f"/sandboxes/{sandbox}/resume")
    assert resumed.status_code == 202, resumed.text
    ready = _settled(http, f"/sandboxes/{sandbox}", ("ready", "failed"), 120)
    assert ready["state"] == "ready", ready
    assert ready["generation"] == 2
    got = _exec(http, sandbox, "cat /workspace/k /tmp/t")
    assert got["stdout"] == "kept\ntmp\n"
    stale = http.post(f"/sandboxes/{sandbox}/exec", json={"command": "echo old", "generation": 1})
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_generation"
    reasons = list(
        SandboxEvent.objects.filter(sandbox=row, event="transition").values_list(
            "to_state", "reason"
        )
    )
    assert ("paused", "paused") in reasons and ("requested", "resumed") in reasons
    # the spent pause is deleted, and its backend copy goes
    pause.refresh_from_db()
    assert pause.state == "deleted" and pause.deleted_reason == "resumed"
    deadline = time.monotonic() + 30
    while pause.id.hex in backend.snapshots():  # type: ignore[attr-defined]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert http.post(f"/sandboxes/{sandbox}/resume").json()["error"]["code"] == (
        "sandbox_not_paused"
    )


def test_a_paused_sandbox_can_be_deleted_and_its_state_goes_with_it(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    sandbox = ready_sandbox(http)
    row = Sandbox.objects.get(external_id=sandbox)
    assert http.post(f"/sandboxes/{sandbox}/pause").status_code == 202
    deadline = time.monotonic() + 60
    while not Snapshot.objects.filter(sandbox=row, kind="pause", state="ready").exists():
        assert time.monotonic() < deadline, "the pause was not captured"
        time.sleep(0.1)
    pause = Snapshot.objects.get(sandbox=row, kind="pause")
    assert http.delete(f"/sandboxes/{sandbox}").status_code == 202
    assert _settled(http, f"/sandboxes/{sandbox}", ("deleted",))["state"] == "deleted"
    deadline = time.monotonic() + 30
    while pause.id.hex in get_backend().snapshots():  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the paused sandbox's state was left behind"
        time.sleep(0.1)
    pause.refresh_from_db()
    assert pause.state == "deleted"


def test_services_restart_in_each_child_and_one_that_fails_is_a_divergence(live, make_tenant):
    _, secret = make_tenant()
    http = api_client(live, secret)
    parent = ready_sandbox(http)
    started = _snapshot(
        http,
        parent,
        manifest={"services": ["echo up > /tmp/service.pid"]},
        probes=[{"name": "ws", "command": "ls /workspace"}],
    )
    broken = _snapshot(http, parent, manifest={"services": ["echo no db >&2; exit 3"]})
    made = http.post("/sandboxes", json={"from_snapshot": started["id"]})
    (ok,) = _children_settled(http, [made.json()["id"]])
    assert ok["state"] == "ready", ok
    assert _exec(http, ok["id"], "cat /tmp/service.pid")["stdout"] == "up\n"
    made = http.post("/sandboxes", json={"from_snapshot": broken["id"]})
    (failed,) = _children_settled(http, [made.json()["id"]])
    assert failed["state"] == "failed"
    assert failed["divergence"] == [
        {
            "service": "echo no db >&2; exit 3",
            "expected": {"exit_code": 0},
            "actual": {"exit_code": 3, "stderr": "no db\n"},
        }
    ]


def test_branch_advice_weighs_measured_capture_and_restores_against_the_prefix(live, make_tenant):
    from apps.trajectories.models import Episode, EpisodeSandbox, Step

    tenant, secret = make_tenant()
    http = api_client(live, secret)
    sandbox = ready_sandbox(http)
    row = Sandbox.objects.get(external_id=sandbox)
    episode = Episode.objects.create(tenant=tenant, task_id="t1")
    EpisodeSandbox.objects.create(episode=episode, sandbox=row, sandbox_ref=sandbox, generation=1)
    for index, seconds in enumerate([30.0, 45.0, None, 25.0]):
        Step.objects.create(episode=episode, index=index, duration_s=seconds)
    path = f"/episodes/{episode.episode_id}/branch-advice"

    unknown = http.get(path, params={"k": 4}).json()
    assert unknown["advice"] == "unknown" and unknown["c_p"] == 100.0
    assert unknown["replay_cost"] == 400.0 and unknown["basis"]["steps_without_duration"] == 1

    snap = _snapshot(http, sandbox)
    forked = http.post(f"/snapshots/{snap['id']}/fork", json={"count": 2})
    _children_settled(http, [c["id"] for c in forked.json()["sandboxes"]])
    advice = http.get(path, params={"k": 4}).json()
    snap_row = Snapshot.objects.get(pk=snap["id"])
    children = Sandbox.objects.filter(snapshot=snap_row)
    restores = [
        (c.ready_at - c.provisioning_started_at).total_seconds()
        for c in children
        if c.ready_at is not None and c.provisioning_started_at is not None
    ]
    assert len(restores) == 2
    assert advice["c_s"] == pytest.approx(snap_row.capture_wall_s)
    assert advice["c_r"] == pytest.approx(sum(restores) / 2)
    assert advice["basis"] == {
        "steps": 4,
        "steps_without_duration": 1,
        "captures": 1,
        "restores": 2,
        "c_r_from": "restores",
    }
    assert advice["snapshot_cost"] == pytest.approx(advice["c_s"] + 4 * advice["c_r"])
    assert advice["advice"] == "branch"  # seconds of capture and restore against 400 s
    cheap = http.get(path, params={"k": 4, "step": 0}).json()
    assert cheap["c_p"] == 30.0
    tiny = http.get(path, params={"k": 1, "step": -1}).json()  # an empty prefix
    assert (tiny["c_p"], tiny["advice"]) == (0.0, "replay")
    _, other = make_tenant()
    assert api_client(live, other).get(path).status_code == 404


def test_an_episode_branches_from_another_at_a_step_through_a_snapshot(live, make_tenant):
    tenant, secret = make_tenant()
    http = api_client(live, secret)
    sandbox = ready_sandbox(http)
    root = http.post("/episodes", json={"task_id": "t", "sandbox_ids": [sandbox]})
    assert root.status_code == 201, root.text
    root_id = root.json()["id"]
    steps = [{"request": {"command": f"step {i}"}, "duration_s": 1.0} for i in range(3)]
    assert http.post(f"/episodes/{root_id}/steps", json={"steps": steps}).status_code in (
        200,
        201,
    )
    snap = _snapshot(http, sandbox)
    forked = http.post(f"/snapshots/{snap['id']}/fork", json={"count": 2})
    children = _children_settled(http, [c["id"] for c in forked.json()["sandboxes"]])
    made = []
    for child in children:
        branch = http.post(
            "/episodes",
            json={
                "task_id": "t",
                "sandbox_ids": [child["id"]],
                "parent_episode_id": root_id,
                "branch_step": 2,
            },
        )
        assert branch.status_code == 201, branch.text
        body = branch.json()
        # the snapshot is taken from the restored sandbox when the client names none
        assert (body["parent"], body["branch_step"], body["branch_snapshot"]) == (
            root_id,
            2,
            snap["id"],
        )
        made.append(body["id"])
    tree = http.get(f"/episodes/{root_id}/branches").json()["results"]
    assert sorted(e["id"] for e in tree) == sorted(made)
    assert http.get(f"/episodes/{root_id}").json()["parent"] is None

    no_step = http.post(
        "/episodes", json={"task_id": "t", "parent_episode_id": root_id, "branch_step": 9}
    )
    assert no_step.status_code == 400 and no_step.json()["error"]["field"] == "branch_step"
    orphan = http.post("/episodes", json={"task_id": "t", "branch_step": 1})
    assert orphan.status_code == 400
    _, other = make_tenant()
    foreign = api_client(live, other).post(
        "/episodes", json={"task_id": "t", "parent_episode_id": root_id}
    )
    assert foreign.status_code == 404
    assert api_client(live, other).get(f"/episodes/{root_id}/branches").status_code == 404
