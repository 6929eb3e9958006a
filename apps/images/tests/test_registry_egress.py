"""The registry egress policy through the API (docs/security.md "Registry egress"): a
tenant cannot point the control plane's skopeo at loopback, link-local (metadata),
private or internal hosts; what the tenant sees is a typed code and a fixed message,
never skopeo's words (which name internal addresses and open ports); the operator's log
keeps them."""

from __future__ import annotations

import json
import logging
import socket
from typing import Any

import pytest

from apps.images.models import Image, ImageStatus
from apps.images.services import image_pull_run
from apps.images.tests.conftest import push_image
from apps.sandboxes import backends
from apps.sandboxes.backends.local.images.errors import PUBLIC_MESSAGES
from apps.sandboxes.models import Sandbox

pytestmark = pytest.mark.django_db

# words of skopeo's and Go's resolver/dialer that must never reach a tenant
SKOPEO_WORDS = ("dial tcp", "connection refused", "pinging container registry", "skopeo", "lookup")


def _forbidden(response: Any, reference: str) -> dict[str, Any]:
    assert response.status_code == 422, response.content
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "registry_forbidden", error
    assert error["reference"] == reference
    assert PUBLIC_MESSAGES["registry_forbidden"] in error["message"]
    return error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "host",
    ["169.254.169.254", "10.20.30.40:5000", "[::1]:5000", "192.168.0.1", "100.64.1.1:443"],
)
def test_non_public_registry_hosts_are_refused(make_tenant, api_client, host):
    _, secret = make_tenant()
    client = api_client(secret)
    reference = f"{host}/latest/meta-data:v1"
    _forbidden(client.post("/api/v1/images", {"reference": reference}, format="json"), reference)
    _forbidden(client.post("/api/v1/sandboxes", {"image": reference}, format="json"), reference)
    assert not Image.objects.exists() and not Sandbox.objects.exists()


def test_an_unlisted_loopback_registry_is_refused_and_never_asked(
    make_tenant, api_client, open_registry, tmp_path, unique_repo, settings
):
    _, secret = make_tenant()
    client = api_client(secret)
    repo = unique_repo("loop")
    reference, _ = push_image(open_registry, tmp_path, repo)
    settings.HEDGEROW_INSECURE_REGISTRIES = []  # the operator did not list it
    _forbidden(client.post("/api/v1/images", {"reference": reference}, format="json"), reference)
    _forbidden(client.post("/api/v1/sandboxes", {"image": reference}, format="json"), reference)
    assert open_registry.manifest_gets(repo) == 0
    assert not Image.objects.exists() and not Sandbox.objects.exists()
    # listed (as the test fixtures list it): the same registry works
    settings.HEDGEROW_INSECURE_REGISTRIES = [open_registry.host]
    pulled = client.post("/api/v1/images", {"reference": reference}, format="json")
    assert pulled.status_code == 202, pulled.content
    assert open_registry.manifest_gets(repo) >= 1


def test_a_name_resolving_to_loopback_is_refused(
    make_tenant, api_client, open_registry, monkeypatch
):
    asked: list[str] = []

    def stub(host: str) -> list[str]:  # "localtest.example" → 127.0.0.1, no /etc/hosts
        asked.append(host)
        return ["127.0.0.1"]

    monkeypatch.setattr(backends, "REGISTRY_RESOLVER", stub)
    _, secret = make_tenant()
    port = open_registry.host.rsplit(":", 1)[1]
    reference = f"localtest.example:{port}/a/b:v1"
    client = api_client(secret)
    _forbidden(client.post("/api/v1/images", {"reference": reference}, format="json"), reference)
    _forbidden(client.post("/api/v1/sandboxes", {"image": reference}, format="json"), reference)
    assert asked == ["localtest.example", "localtest.example"]  # resolved at each request


def test_the_deny_list_and_the_allow_list(make_tenant, api_client, monkeypatch, settings):
    monkeypatch.setattr(backends, "REGISTRY_RESOLVER", lambda _host: ["10.1.1.1"])
    _, secret = make_tenant()
    client = api_client(secret)
    settings.HEDGEROW_REGISTRY_DENY = ["ghcr.io"]
    _forbidden(client.post("/api/v1/images", {"reference": "ghcr.io/a/b:1"}, format="json"),
               "ghcr.io/a/b:1")  # fmt: skip
    # an address the policy refuses, until the operator allows it: then skopeo asks it
    # (over TLS: allowed is not plain HTTP), and finds nothing listening
    closed = f"127.0.0.1:{_free_port()}"
    reference = f"{closed}/a/b:1"
    _forbidden(client.post("/api/v1/images", {"reference": reference}, format="json"), reference)
    settings.HEDGEROW_REGISTRY_ALLOW = [closed]
    response = client.post("/api/v1/images", {"reference": reference}, format="json")
    assert response.status_code == 422, response.content
    assert response.json()["error"]["code"] == "registry_unreachable"
    assert not Image.objects.exists()


def test_the_tenant_sees_a_fixed_message_and_the_operator_log_the_raw_one(
    make_tenant, api_client, settings, caplog
):
    caplog.set_level(logging.WARNING)
    closed = f"127.0.0.1:{_free_port()}"  # listed, nothing listening: connection refused
    settings.HEDGEROW_INSECURE_REGISTRIES = [closed]
    _, secret = make_tenant()
    client = api_client(secret)
    reference = f"{closed}/probe/port:v1"
    for response in (
        client.post("/api/v1/images", {"reference": reference}, format="json"),
        client.post("/api/v1/sandboxes", {"image": f"{closed}/probe/port:v2"}, format="json"),
    ):
        assert response.status_code == 422, response.content
        error = response.json()["error"]
        assert error["code"] == "registry_unreachable"
        assert error["message"].endswith(PUBLIC_MESSAGES["registry_unreachable"])
        body = json.dumps(response.json()).lower()
        assert not [w for w in SKOPEO_WORDS if w in body], body
    assert "connection refused" in caplog.text  # the operator still gets skopeo's words


def test_a_pull_whose_registry_is_refused_in_the_worker_records_the_fixed_message(
    make_tenant, api_client, open_registry, tmp_path, unique_repo, settings
):
    tenant, secret = make_tenant()
    reference, _ = push_image(open_registry, tmp_path, unique_repo("later"))
    created = api_client(secret).post("/api/v1/images", {"reference": reference}, format="json")
    assert created.status_code == 202, created.content
    settings.HEDGEROW_INSECURE_REGISTRIES = []  # unlisted before the worker runs
    image = image_pull_run(image_id=created.json()["id"])
    assert image is not None and image.status == ImageStatus.FAILED
    assert image.error_code == "registry_forbidden"
    assert image.error_message.endswith(PUBLIC_MESSAGES["registry_forbidden"])
    shown = api_client(secret).get(f"/api/v1/images/{image.pk}").json()
    assert shown["error"]["code"] == "registry_forbidden"
    assert "127.0.0.1" not in shown["error"]["message"].replace(reference, "")
