"""Post/redirect/get for every dashboard form (issue 24, defect 7): a form that did its
work answers a redirect to a page a reload only re-reads, never a page rendered from
the POST (a reload re-sends it: a second key, a second member, a second fork). Forms
refused by validation re-render with their errors, as Django's form views do.

``test_every_post_form_is_covered`` reads every template: a new ``method="post"``
form must be added here (or name the test that proves its redirect)."""

from __future__ import annotations

import importlib
import inspect
import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from apps.sandboxes.models import Sandbox, Snapshot, State
from apps.sandboxes.tests.factories import make_sandbox
from apps.tenancy.models import ApiKey, Membership
from apps.trajectories.models import Episode
from frontend.tests.browser import ROOT

pytestmark = pytest.mark.django_db

_FORM = re.compile(r"<form\b[^>]*>", re.S)
_ACTION = re.compile(r"""action="\{% url '([^']+)'""")

# Forms whose redirect another test proves with its own fixtures (a registry, a real
# sandbox backend): url name -> "module::test", which must exist and assert a 302.
PROVED_ELSEWHERE = {
    "images:list": (
        "frontend.tests.test_images_page::"
        "test_it_pulls_from_the_page_and_redirects_so_a_reload_does_not_pull_again"
    ),
    "images:credential-add": (
        "frontend.tests.test_images_page::"
        "test_a_login_is_stored_encrypted_never_shown_and_then_used_for_the_pull"
    ),
    "billing:budget-alert": (
        "apps.billing.tests.test_budget_alert::"
        "test_an_owner_sets_and_clears_the_alert_with_a_redirect"
    ),
    "billing:team-budget": (
        "apps.billing.tests.test_team_budget::"
        "test_an_owner_sets_and_clears_the_team_budget_on_the_page"
    ),
    "billing:alert-webhook": (
        "apps.billing.tests.test_budget_notices::"
        "test_the_webhook_gets_one_post_and_its_url_is_never_shown_or_logged"
    ),
    "frontend:sandbox-pause": (
        "frontend.tests.test_pause_resume_live::"
        "test_a_member_pauses_and_resumes_a_sandbox_from_its_page"
    ),
    "frontend:sandbox-resume": (
        "frontend.tests.test_pause_resume_live::"
        "test_a_member_pauses_and_resumes_a_sandbox_from_its_page"
    ),
    "images:credential-delete": (
        "frontend.tests.test_images_page::"
        "test_a_login_is_stored_encrypted_never_shown_and_then_used_for_the_pull"
    ),
}
# Proved below.
PROVED_HERE = {
    "frontend:login",
    "frontend:logout",
    "frontend:team-switch",
    "frontend:keys",
    "frontend:key-revoke",
    "frontend:key-rename",
    "frontend:key-rotate",
    "members",  # frontend/members.html posts to itself: add, change role, remove
    "frontend:sandbox-create",
    "frontend:sandbox-delete",
    "frontend:sandbox-ttl",
    "frontend:sandbox-bulk-delete",
    "frontend:snapshot-fork",
    "images:delete",
    "datasets:create",
    "trajectories:relabel",
    "leak-report-run",
}


def _post_forms() -> set[str]:
    """The url name of every non-htmx POST form in the templates ("members" for the
    Members page's forms, which post to the page itself)."""
    found = set()
    for path in (ROOT / "frontend" / "templates").rglob("*.html"):
        for tag in _FORM.findall(path.read_text()):
            if 'method="post"' not in tag:
                continue
            action = _ACTION.search(tag)
            found.add(action.group(1) if action else path.stem)
    return found


def test_every_post_form_is_covered() -> None:
    assert _post_forms() == PROVED_HERE | set(PROVED_ELSEWHERE)
    for target in set(PROVED_ELSEWHERE.values()):
        module, name = target.split("::")
        source = inspect.getsource(getattr(importlib.import_module(module), name))
        assert "status_code == 302" in source, target


def _client(make_user: Any, name: str, *memberships: tuple[Any, str]) -> Client:
    make_user(name, *memberships)
    client = Client()
    assert client.login(username=name, password=name)
    return client


def _redirects(response: Any, client: Client, to: str | None = None) -> str:
    """The POST answered a redirect whose target is a page (200) for a GET."""
    assert response.status_code == 302, (response.status_code, response.content[:300])
    location = str(response["Location"])
    if to is not None:
        assert location == to
    assert client.get(location).status_code == 200, location
    return location


def test_sign_in_sign_out_and_team_switch_redirect(make_tenant: Any, make_user: Any) -> None:
    first, _ = make_tenant()
    second, _ = make_tenant()
    make_user("swi", (first, "member"), (second, "member"))
    client = Client()
    signed_in = client.post("/login/", {"username": "swi", "password": "swi"})
    assert signed_in.status_code == 302
    switched = client.post("/team/switch", {"tenant_id": str(second.pk), "next": "/keys/"})
    assert switched.status_code == 302 and switched["Location"] == "/keys/"
    assert client.session["tenant_id"] == str(second.pk)
    signed_out = client.post("/logout/")
    assert signed_out.status_code == 302


def test_key_issue_and_revoke_redirect(make_tenant: Any, make_user: Any) -> None:
    tenant, _ = make_tenant()
    client = _client(make_user, "prgkeys", (tenant, "owner"))
    _redirects(client.post("/keys/", {"name": "ci", "scopes": ["read"]}), client, "/keys/")
    key = ApiKey.objects.get(tenant=tenant, name="ci")
    _redirects(client.post(f"/keys/{key.pk}/revoke"), client, "/keys/")
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert ApiKey.objects.filter(tenant=tenant, name="ci").count() == 1


def test_key_rename_and_rotate_redirect_and_a_reload_rotates_nothing(
    make_tenant: Any, make_user: Any
) -> None:
    tenant, _ = make_tenant()
    client = _client(make_user, "prgrot", (tenant, "owner"))
    client.post("/keys/", {"name": "ci", "scopes": ["read"]})
    key = ApiKey.objects.get(tenant=tenant, name="ci")
    _redirects(client.post(f"/keys/{key.pk}/rename", {"name": "ci-2"}), client, "/keys/")
    key.refresh_from_db()
    assert key.name == "ci-2"
    before = key.secret_hash
    rotated = client.post(f"/keys/{key.pk}/rotate", {"grace_seconds": "3600"})
    _redirects(rotated, client, "/keys/")
    key.refresh_from_db()
    after = key.secret_hash
    assert after != before and key.previous_secret_hash == before  # rotated once
    # the reload of the page the redirect landed on is a GET: it rotates nothing again
    assert client.get("/keys/").status_code == 200
    key.refresh_from_db()
    assert key.secret_hash == after


def test_member_add_role_change_and_remove_redirect(make_tenant: Any, make_user: Any) -> None:
    tenant, _ = make_tenant()
    client = _client(make_user, "prgowner", (tenant, "owner"))
    User.objects.create_user("newcomer", password="x")
    added = client.post("/members/", {"action": "add", "username": "newcomer", "role": "viewer"})
    _redirects(added, client, "/members/")
    membership = Membership.objects.get(tenant=tenant, user__username="newcomer")
    changed = client.post("/members/", {"membership_id": str(membership.pk), "role": "member"})
    _redirects(changed, client, "/members/")
    removed = client.post("/members/", {"action": "remove", "membership_id": str(membership.pk)})
    _redirects(removed, client, "/members/")
    assert not Membership.objects.filter(tenant=tenant, user__username="newcomer").exists()


def test_sandbox_create_delete_and_bulk_delete_redirect_without_htmx(
    make_tenant: Any, make_user: Any
) -> None:
    tenant, _ = make_tenant()
    client = _client(make_user, "prgsb", (tenant, "member"))
    created = client.post("/sandboxes/new", {"image": "host", "cpu": "0.25", "memory": "128Mi"})
    sandbox = Sandbox.objects.get(tenant=tenant)
    assert created.status_code == 302
    assert created["Location"] == f"/sandboxes/{sandbox.external_id}/"
    one = make_sandbox(tenant)
    deleted = client.post(f"/sandboxes/{one.external_id}/delete", {"next": "/sandboxes/"})
    assert deleted.status_code == 302 and deleted["Location"] == "/sandboxes/"
    two = make_sandbox(tenant)
    bulk = client.post("/sandboxes/delete", {"ids": [two.external_id]})
    _redirects(bulk, client, "/sandboxes/")
    one.refresh_from_db()
    two.refresh_from_db()
    assert one.state != State.READY and two.state != State.READY


def test_setting_the_ttl_redirects_and_refusals_change_nothing(
    make_tenant: Any, make_user: Any
) -> None:
    tenant, _ = make_tenant()
    other, _ = make_tenant()
    client = _client(make_user, "prgttl", (tenant, "member"))
    sandbox = make_sandbox(tenant, expires_at=timezone.now() + timedelta(minutes=5))
    page = f"/sandboxes/{sandbox.external_id}/"
    assert 'action="/sandboxes/' + sandbox.external_id + '/ttl"' in client.get(page).text
    before = timezone.now()
    _redirects(client.post(f"{page}ttl", {"seconds": "14400"}), client, page)
    sandbox.refresh_from_db()
    assert before + timedelta(hours=4) <= sandbox.expires_at <= timezone.now() + timedelta(hours=4)
    kept = sandbox.expires_at
    # beyond HEDGEROW_MAX_TTL_S, not a number, or a sandbox that is ending: a message, a
    # redirect, and the expiry unchanged
    for seconds, said in ((str(10**9), "The TTL was not changed"), ("soon", "Choose how long")):
        refused = client.post(f"{page}ttl", {"seconds": seconds})
        assert refused.status_code == 302 and refused["Location"] == page
        assert said in client.get(page).text  # the message, shown once after the redirect
    ending = make_sandbox(tenant, state=State.TERMINATING)
    _redirects(client.post(f"/sandboxes/{ending.external_id}/ttl", {"seconds": "3600"}), client)
    ending.refresh_from_db()
    sandbox.refresh_from_db()
    assert sandbox.expires_at == kept and ending.state == State.TERMINATING
    # another team's sandbox is not found; a viewer may not change it
    theirs = make_sandbox(other)
    assert (
        client.post(f"/sandboxes/{theirs.external_id}/ttl", {"seconds": "3600"}).status_code == 404
    )
    viewer = _client(make_user, "prgttlv", (tenant, "viewer"))
    assert viewer.post(f"{page}ttl", {"seconds": "3600"}).status_code == 403
    sandbox.refresh_from_db()
    assert sandbox.expires_at == kept


def test_a_fork_redirects_even_when_refused(make_tenant: Any, make_user: Any) -> None:
    tenant, _ = make_tenant()
    client = _client(make_user, "prgfork", (tenant, "member"))
    sandbox = make_sandbox(tenant)
    snapshot = Snapshot.objects.create(
        tenant=tenant,
        sandbox=sandbox,
        backend=sandbox.backend,
        image="host",
        state="capturing",
        ttl_seconds=3600,
        expires_at=timezone.now() + timedelta(hours=1),
    )
    for count in ("x", "1"):  # not a number; a snapshot not ready yet
        answer = client.post(f"/snapshots/{snapshot.pk}/fork", {"count": count})
        _redirects(answer, client, f"/snapshots/{snapshot.pk}/")
    assert Sandbox.objects.filter(tenant=tenant).count() == 1  # nothing forked


def test_image_delete_dataset_create_and_relabel_redirect(make_tenant: Any, make_user: Any) -> None:
    from apps.images.models import Image

    tenant, _ = make_tenant()
    client = _client(make_user, "prgmisc", (tenant, "member"))
    image = Image.objects.create(tenant=tenant, reference="example.org/idle:1", status="ready")
    _redirects(client.post(f"/images/{image.pk}/delete"), client, "/images/")
    now = timezone.now()
    episode = Episode.objects.create(
        tenant=tenant,
        task_id="t",
        status="closed",
        started_at=now,
        ended_at=now,
        auto_failure_class="task",
        failure_class="task",
    )
    relabeled = client.post(
        f"/trajectories/{episode.episode_id}/relabel",
        {"failure_class": "environment", "reason": "the mirror was down"},
    )
    _redirects(relabeled, client, f"/trajectories/{episode.episode_id}/")
    assert episode.relabels.count() == 1
    created = client.post(
        "/datasets/create", {"name": "all", "train": "1", "validation": "0", "test": "0"}
    )
    assert created.status_code == 302 and created["Location"].startswith("/datasets/")
    assert client.get(created["Location"]).status_code == 200


def test_the_staff_audit_run_redirects(make_user: Any) -> None:
    User.objects.create_user("prgstaff", password="prgstaff", is_staff=True)
    client = Client()
    assert client.login(username="prgstaff", password="prgstaff")
    answer = client.post("/reports/leaks/run", {})
    _redirects(answer, client, "/reports/leaks")
