"""E2B's allow_internet_access maps onto the egress policy."""

from __future__ import annotations

import pytest

from apps.e2b.services import e2b_create_request

pytestmark = pytest.mark.django_db


def test_allow_internet_access_is_egress_all_and_its_absence_none():
    opened = e2b_create_request({"templateID": "base", "allow_internet_access": True})
    assert (opened.egress, opened.network_access) == ("all", True)
    closed = e2b_create_request({"templateID": "base"})
    assert (closed.egress, closed.network_access) == ("none", False)
