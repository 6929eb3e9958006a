"""The kubernetes backend reads no sandbox metrics yet: a typed answer, not a crash
(the API turns it into 409 ``metrics_unavailable``)."""

from __future__ import annotations

import uuid

import pytest

from apps.sandboxes.backends.base import BackendError, MetricsUnavailable
from apps.sandboxes.backends.kubernetes.backend import KubernetesBackend


def test_metrics_are_a_typed_not_available(backend: KubernetesBackend) -> None:
    with pytest.raises(MetricsUnavailable) as caught:
        backend.metrics(uuid.uuid4().hex)
    assert caught.value.code == "metrics_unavailable"
    assert "kubernetes" in str(caught.value)
    with pytest.raises(BackendError):  # a bad id is refused before anything else
        backend.metrics("../etc")
