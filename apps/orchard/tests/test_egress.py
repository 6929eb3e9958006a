"""Orchard bodies carry the egress policy; block_network maps onto it."""

from __future__ import annotations

import pytest

from apps.orchard.services import orchard_create_request


@pytest.mark.django_db
def test_orchard_takes_the_policy_and_maps_block_network(make_tenant, client):
    request, _ = orchard_create_request({"egress": {"allow": ["pkg.example.org"]}})
    assert request.egress == {"allow": ["pkg.example.org"], "dns": "filtered"}
    assert request.network_access
    request, _ = orchard_create_request({"block_network": False})
    assert (request.egress, request.network_access) == ("all", True)
    request, _ = orchard_create_request({})
    assert (request.egress, request.network_access) == ("none", False)
