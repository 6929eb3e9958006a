"""Secrets out of the data: planted in every field type (episode metadata, labels,
step action, request, observation — exec and not, base64 output —, shown, diff,
model_call, verifier output and report, close results, imported lines, rows stored
before redaction existed) they never reach an export, the steps API, the raw events or
a layer; placeholders are typed, stable within an episode and different across
episodes; the mapping is encrypted, readable by tenant admins only, every read
audited."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
from django.utils import timezone

from apps.core import crypto
from apps.sandboxes.models import Operation, OperationStatus
from apps.sandboxes.tests.factories import make_sandbox
from apps.trajectories.models import Episode, EpisodeSecret, SecretAccess, Step
from apps.trajectories.redaction import Redactor, find_spans

GITHUB = "ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"
AWS = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
GCP = "AIzaSyA1234567890abcdefghijklmnopqrstuv"
GITLAB = "glpat-xY7zQ2wE9rT4uI1oP6aS"
SLACK = "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx"
OPENAI = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"
HR = "hr_A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8S9t0uVw"
PEM = (
    "-----BEGIN RSA PRIVATE KEY-----\n"
    "MIIEowIBAAKCAQEA7bqXv2Lr9mZpT4xQ8wN3kJ5hG6fD1sA0zY7uI2oP9lK4jH3g\n"
    "-----END RSA PRIVATE KEY-----"
)
JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0."
    "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
)
PASSWORD = "q8Zr!v2Lp@x9Wm"
URL_TOKEN = "9fJ2kL8mN3pQ7rS1"
WRAPPED = base64.b64encode(f"export GITHUB_TOKEN={GITHUB}\n".encode()).decode()

# Every planted value: none of them may appear in anything handed out.
PLANTED = [GITHUB, AWS, AWS_SECRET, GCP, GITLAB, SLACK, OPENAI, HR, JWT, PASSWORD, URL_TOKEN]
PLANTED_TEXT = [
    *PLANTED,
    "MIIEowIBAAKCAQEA7bqXv2Lr9mZpT4xQ8wN3kJ5hG6fD1sA0zY7uI2oP9lK4jH3g",
    WRAPPED,
]
PLACEHOLDER = re.compile(r"<SECRET:([a-z0-9_]+):([0-9a-f]{8}):(\d+)>")


def _redactor(scope: str = "abcd1234") -> Redactor:
    return Redactor(scope=scope, fingerprint=lambda v: f"fp:{v}")


@pytest.mark.parametrize(
    ("text", "kind", "secret"),
    [
        (f"git push https://x:{GITHUB}@github.com/a/b", "github_token", GITHUB),
        (f"AWS_ACCESS_KEY_ID={AWS}", "aws_access_key", AWS),
        (f"aws_secret_access_key = {AWS_SECRET}", "aws_secret_key", AWS_SECRET),
        (f"key {GCP} used", "gcp_api_key", GCP),
        (f"token {GITLAB}", "gitlab_token", GITLAB),
        (f"SLACK={SLACK}", "slack_token", SLACK),
        (f"OPENAI_API_KEY {OPENAI}", "openai_key", OPENAI),
        (f"Authorization: Bearer {HR}", "hr_key", HR),
        (f"cat id_rsa\n{PEM}\n", "private_key", PEM),
        (f"cookie: session={JWT};", "jwt", JWT),
        (f"password: '{PASSWORD}'", "credential", PASSWORD),
        (f'{{"db": {{"api_key" : "{PASSWORD}"}}}}', "credential", PASSWORD),
        (f"DB_PASSWORD={PASSWORD} ./run", "credential", PASSWORD),
        (f"GET https://api.example.com/v1?page=2&token={URL_TOKEN}&x=1", "url_param", URL_TOKEN),
        (f"echo {WRAPPED} | base64 -d", "b64_github_token", WRAPPED),
        ("psql postgres://app:Zx9vQ2mL7pR4@db:5432/x", "url_password", "Zx9vQ2mL7pR4"),
    ],
)
def test_each_known_format_becomes_a_typed_placeholder(text, kind, secret):
    redactor = _redactor()
    out = redactor.text(text, "stdout")
    assert secret not in out
    assert f"<SECRET:{kind}:abcd1234:1>" in out, out
    assert [f.kind for f in redactor.found] == [kind]
    assert redactor.found[0].secret == secret


@pytest.mark.parametrize(
    "text",
    [
        "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "ep-3f2a9c1d5e6b7a80 att-0a1b2c3d4e5f 1f0e2d3c-4b5a-6978-8796-a5b4c3d2e1f0",
        "the password field is required; tokens_in: 812, token count 64",
        "password=******** token: <SECRET:github_token:abcd1234:1>",
        "compass=Zq8Lr2Vx9Pw4Ks7M bypass: Zq8Lr2Vx9Pw4Ks7M",
        "===================== 3 passed in 0.12s =====================",
        "FAILED tests/test_auth.py::test_login - AssertionError: assert 401 == 200",
    ],
)
def test_ordinary_output_is_left_alone(text):
    assert find_spans(text) == []


def test_the_same_secret_is_the_same_placeholder_within_a_scope_only():
    one, two = _redactor("aaaa0000"), _redactor("bbbb1111")
    first = one.value({"a": GITHUB, "b": [f"x {GITHUB}"], "c": f"{GITLAB} {GITHUB}"})
    assert first == {
        "a": "<SECRET:github_token:aaaa0000:1>",
        "b": ["x <SECRET:github_token:aaaa0000:1>"],
        "c": "<SECRET:gitlab_token:aaaa0000:1> <SECRET:github_token:aaaa0000:1>",
    }
    assert len(one.found) == 2 and one.uses["<SECRET:github_token:aaaa0000:1>"] == 3
    assert two.text(GITHUB) == "<SECRET:github_token:bbbb1111:1>"


def test_a_credential_named_field_and_a_base64_output_record_are_redacted():
    redactor = _redactor()
    raw = f"line\nexport TOKEN={GITHUB}\n\x00\xff".encode("latin-1")
    record = {"head": base64.b64encode(raw).decode(), "tail": "", "encoding": "base64"}
    out = redactor.value({"db_password": "plainButLong9", "stdout": record})
    assert out["db_password"] == "<SECRET:credential:abcd1234:1>"
    decoded = base64.b64decode(out["stdout"]["head"])
    assert GITHUB.encode() not in decoded
    assert decoded.endswith(b"<SECRET:github_token:abcd1234:1>\n\x00\xff")  # bytes kept


# -- through the API -------------------------------------------------------------------


def _handed_out(client: Any, episode_id: str) -> str:
    """Everything a reader can get of the episode: export, record, steps, raw events,
    lineage layers and their items."""
    parts = [b"".join(client.get("/api/v1/episodes/export").streaming_content).decode()]
    for path in ("", "/steps", "/raw-events", "/timeline", "/lineage"):
        response = client.get(f"/api/v1/episodes/{episode_id}{path}")
        assert response.status_code == 200, (path, response.content)
        parts.append(response.content.decode())
    for layer in client.get(f"/api/v1/episodes/{episode_id}/lineage").json()["layers"]:
        parts.append(
            client.get(f"/api/v1/episodes/{episode_id}/layers/{layer['id']}").content.decode()
        )
    return "\n".join(parts)


def _assert_clean(text: str) -> None:
    for secret in PLANTED_TEXT:
        assert secret not in text, secret
        assert json.dumps(secret)[1:-1] not in text, secret  # nor JSON-escaped


@pytest.mark.django_db
def test_secrets_planted_in_every_field_never_reach_what_is_handed_out(make_tenant, api_client):
    tenant, secret = make_tenant()
    client = api_client(secret)
    sandbox = make_sandbox(tenant, ready_at=timezone.now())
    Operation.objects.create(
        tenant=tenant, sandbox=sandbox, operation_id="op-1", generation=1,
        request={"command": f"curl -H 'Authorization: Bearer {HR}' https://x", "env": {
            "OPENAI_API_KEY": OPENAI}},
        request_hash="x", status=OperationStatus.COMPLETED, termination="exited", exit_code=0,
        stdout={"head": f"key={AWS}\n{PEM}\n", "tail": "", "encoding": "utf-8",
                "total_bytes": 10, "sha256": "x", "truncated": False},
        stderr={"head": base64.b64encode(f"token: {GITLAB}".encode()).decode(), "tail": "",
                "encoding": "base64", "total_bytes": 5, "sha256": "y", "truncated": False},
    )  # fmt: skip
    Operation.objects.create(
        tenant=tenant, sandbox=sandbox, operation_id="op-v", generation=1, request={},
        request_hash="x", status=OperationStatus.COMPLETED, termination="exited", exit_code=1,
        stdout={"head": f"FAILED test_x - assert '{SLACK}' == ''", "tail": "",
                "encoding": "utf-8", "total_bytes": 1, "sha256": "z", "truncated": False},
    )  # fmt: skip
    opened = client.post(
        "/api/v1/episodes",
        {
            "task_id": "t-secret",
            "model": "m",
            "labels": {"source": f"https://hub.example.com/d?token={URL_TOKEN}"},
            "sampling": {"temperature": 0.5, "api_key": OPENAI},
            "versions": {"harness": f"h {GCP}"},
            "sandbox_ids": [sandbox.external_id],
        },
        format="json",
    )
    assert opened.status_code == 201, opened.content
    ep = opened.json()
    report = (
        '<testsuite><testcase classname="t" name="test_x">'
        f"<failure>expected {JWT}</failure></testcase></testsuite>"
    )
    steps = client.post(
        f"/api/v1/episodes/{ep['id']}/steps",
        {
            "steps": [
                {
                    "kind": "model",
                    "action": {"tool": "bash", "args": f"export GITHUB_TOKEN={GITHUB}"},
                    "shown": {"text": f"password: '{PASSWORD}'"},
                    "model_call": {"tokens_in": 3, "raw": f"echo {WRAPPED}"},
                },
                {
                    "kind": "tool",
                    "action": "edit",
                    "observation": {"ok": True, "note": f"wrote {AWS_SECRET} to aws_secret_key"},
                    "diff": f"+aws_secret_access_key = {AWS_SECRET}\n+key={HR}\n",
                },
                {"kind": "exec", "sandbox_id": sandbox.external_id, "operation_id": "op-1"},
                {
                    "kind": "verifier",
                    "sandbox_id": sandbox.external_id,
                    "operation_id": "op-v",
                    "verifier": {"kind": "junit-xml", "report": report, "report_path": "/r"},
                },
            ]
        },
        format="json",
    )
    assert steps.status_code == 201, steps.content
    closed = client.post(
        f"/api/v1/episodes/{ep['id']}/close",
        {
            "reward": 0.0,
            "reward_components": {"note": f"leaked {GITHUB}"},
            "inference_error": {"message": f"401 for key {OPENAI}"},
        },
        format="json",
    )
    assert closed.status_code == 200, closed.content

    out = _handed_out(client, ep["id"])
    _assert_clean(out)
    kinds = {m.group(1) for m in PLACEHOLDER.finditer(out)}
    assert kinds >= {
        "github_token", "aws_access_key", "aws_secret_key", "gcp_api_key",
        "slack_token", "openai_key", "hr_key", "private_key", "jwt", "credential",
        "url_param", "b64_github_token",
    }  # fmt: skip
    # the exec step's base64 stderr record holds the placeholder as bytes
    exec_step = client.get(f"/api/v1/episodes/{ep['id']}/steps").json()["results"][2]
    stderr = base64.b64decode(exec_step["observation"]["stderr"]["head"]).decode()
    assert stderr.startswith("token: <SECRET:gitlab_token:") and GITLAB not in stderr
    # nothing stored in the clear either
    row = Episode.objects.get(episode_id=ep["id"])
    stored = json.dumps(
        [
            list(Step.objects.filter(episode=row).values()),
            row.labels,
            row.sampling,
            row.reward_components,
            row.inference_error,
        ],
        default=str,
    )
    _assert_clean(stored)
    # one secret, one placeholder, wherever it appeared in the episode
    github = {m.group() for m in PLACEHOLDER.finditer(out) if m.group(1) == "github_token"}
    assert len(github) == 1
    secrets = EpisodeSecret.objects.filter(episode=row)
    assert secrets.filter(kind="github_token").get().occurrences >= 3
    assert all(GITHUB not in s.value_encrypted for s in secrets)
    assert crypto.decrypt(secrets.get(kind="github_token").value_encrypted) == GITHUB


@pytest.mark.django_db
def test_the_same_secret_in_two_episodes_gets_two_placeholders(make_tenant, api_client):
    _, secret = make_tenant()
    client = api_client(secret)
    seen = []
    for _ in range(2):
        ep = client.post("/api/v1/episodes", {"task_id": "t"}, format="json").json()
        client.post(
            f"/api/v1/episodes/{ep['id']}/steps",
            {"steps": [{"kind": "model", "action": f"{GITHUB} and again {GITHUB}"}]},
            format="json",
        )
        action = client.get(f"/api/v1/episodes/{ep['id']}/steps").json()["results"][0]["action"]
        found = PLACEHOLDER.findall(action)
        assert len(found) == 2 and found[0] == found[1]
        seen.append(found[0])
    assert seen[0][0] == seen[1][0] == "github_token"
    assert seen[0][1] != seen[1][1]  # the scope differs across episodes


@pytest.mark.django_db
def test_imported_lines_and_rows_stored_before_redaction_are_exported_redacted(
    make_tenant, api_client
):
    tenant, secret = make_tenant()
    client = api_client(secret)
    line = {
        "schema": "hedgerow.episode/v1",
        "episode_id": "ep-imp",
        "task_id": "t",
        "started_at": "2026-01-01T00:00:00+00:00",
        "labels": {"token": "Zq8Lr2Vx9Pw4Ks7M"},
        "steps": [{"index": 0, "kind": "model", "action": f"use {SLACK}"}],
        "failure": {
            "relabels": [{"to": "task", "reason": f"saw {AWS}", "at": "2026-01-01T00:00:01Z"}]
        },
    }
    response = client.generic(
        "POST", "/api/v1/episodes/import", json.dumps(line).encode(), content_type="x"
    )
    assert response.status_code == 200, response.content
    legacy = Episode.objects.create(tenant=tenant, task_id="t", episode_id="ep-legacy")
    Step.objects.create(episode=legacy, index=0, kind="model", action=f"old {GITLAB}")
    exported = b"".join(client.get("/api/v1/episodes/export").streaming_content).decode()
    for value in ("Zq8Lr2Vx9Pw4Ks7M", SLACK, AWS, GITLAB):
        assert value not in exported
    assert EpisodeSecret.objects.filter(episode=legacy, kind="gitlab_token").exists()
    raw = client.get("/api/v1/episodes/ep-imp/raw-events").content.decode()
    assert SLACK not in raw and "<SECRET:slack_token:" in raw


@pytest.mark.django_db
def test_only_tenant_admins_read_the_mapping_and_every_read_is_audited(make_tenant, api_client):
    tenant, admin_secret = make_tenant()
    from apps.tenancy.services import api_key_create

    writer = api_client(api_key_create(tenant=tenant, name="w", scopes=["read", "write"]).secret)
    _, outsider_secret = make_tenant()
    admin = api_client(admin_secret)
    ep = writer.post("/api/v1/episodes", {"task_id": "t", "labels": {"k": GITHUB}}, format="json")
    episode_id = ep.json()["id"]
    assert GITHUB not in ep.content.decode()

    assert writer.get(f"/api/v1/episodes/{episode_id}/secrets").status_code == 403
    assert writer.get("/api/v1/episodes/secrets/access").status_code == 403
    assert (
        api_client(outsider_secret).get(f"/api/v1/episodes/{episode_id}/secrets").status_code == 404
    )
    assert not SecretAccess.objects.exists()  # refused reads are no reads

    revealed = admin.get(f"/api/v1/episodes/{episode_id}/secrets")
    assert revealed.status_code == 200
    assert revealed["Cache-Control"] == "no-store"
    (entry,) = revealed.json()["results"]
    assert entry["value"] == GITHUB and entry["kind"] == "github_token"
    assert entry["placeholder"] == ep.json()["labels"]["k"]
    access = SecretAccess.objects.get()
    assert access.episode_ref == episode_id and access.actor.startswith("key:")
    assert access.placeholders == [entry["placeholder"]]
    audit = admin.get("/api/v1/episodes/secrets/access").json()["results"]
    assert [a["episode_id"] for a in audit] == [episode_id]

    report = writer.get("/api/v1/episodes/secrets/report").json()
    # two replacements: the stored label and the raw event (the open as received)
    assert report["by_kind"] == {"github_token": {"secrets": 1, "occurrences": 2, "episodes": 1}}
    assert GITHUB not in json.dumps(report)
    exported = b"".join(writer.get("/api/v1/episodes/export").streaming_content)
    assert GITHUB.encode() not in exported and b"<SECRET:github_token:" in exported
    assert writer.get("/api/v1/episodes/secrets/report").json() == report  # not re-counted


@pytest.mark.django_db
def test_the_scan_endpoint_reports_by_kind_without_values(make_tenant, api_client):
    _, secret = make_tenant(scopes=["read"])  # a dry run: a read-only key may scan
    body = "\n".join(
        [
            json.dumps({"steps": [{"action": GITHUB}, {"action": f"again {GITHUB}"}]}),
            f"plain text with {AWS}",
            "",
        ]
    ).encode()
    response = api_client(secret).generic("POST", "/api/v1/episodes/scan", body, content_type="x")
    assert response.status_code == 200
    report = response.json()
    assert report["lines"] == 2 and report["secrets"] == 2 and report["occurrences"] == 3
    assert report["by_kind"]["github_token"]["secrets"] == 1
    assert report["by_kind"]["github_token"]["occurrences"] == 2
    assert report["by_kind"]["aws_access_key"]["paths"] == ["line 2"]
    assert GITHUB not in response.content.decode() and AWS not in response.content.decode()


@pytest.mark.django_db
def test_a_field_too_long_once_redacted_is_a_clear_400_and_nothing_is_stored(
    make_tenant, api_client
):
    tenant, secret = make_tenant()
    client = api_client(secret)
    keys = [f"AKIA{c * 16}" for c in "ABCDEFGHI"]  # 20 characters each, 35 as placeholders
    model = " ".join(keys)
    assert len(model) <= 200
    response = client.post("/api/v1/episodes", {"task_id": "t", "model": model}, format="json")
    assert response.status_code == 400, response.content
    assert response.json()["error"]["field"] == "model"
    assert keys[0] not in response.content.decode()
    assert not Episode.objects.filter(tenant=tenant).exists()
    assert not EpisodeSecret.objects.filter(tenant=tenant).exists()
