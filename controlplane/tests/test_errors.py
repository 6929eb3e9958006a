"""Outages of Postgres or Redis become a typed, retryable 503, never an untyped 500."""

from __future__ import annotations

import pytest
import redis
from django.db import OperationalError

from apps.tenancy.models import ApiKey

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "error", [OperationalError("server closed the connection"), redis.ConnectionError("refused")]
)
def test_it_answers_503_with_retry_after_when_a_backing_service_fails(
    make_tenant, api_client, monkeypatch, error
):
    _, secret = make_tenant()

    def broken(**_kwargs):
        raise error

    monkeypatch.setattr("apps.sandboxes.api.views.selectors.sandbox_list", broken)
    response = api_client(secret).get("/api/v1/sandboxes")
    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert response.json()["error"]["code"] == "service_unavailable"
    assert ApiKey.objects.count() == 1
