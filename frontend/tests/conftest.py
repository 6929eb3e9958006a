from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from frontend.tests.browser import ROOT

DIST = ROOT / "frontend" / "static" / "dist" / "main.js"


@pytest.fixture
def assets() -> None:
    if not DIST.exists():
        pytest.fail(
            "frontend assets are not built: run `scripts/stack.sh install` (make test does)"
        )


@pytest.fixture
def make_user(db: Any) -> Callable[..., Any]:
    """A Django user with a role in each given tenant; the password is the username."""
    from django.contrib.auth.models import User

    from apps.tenancy.services import membership_set_role

    def make(username: str, *memberships: tuple[Any, str]) -> Any:
        user = User.objects.create_user(username=username, password=username)
        for tenant, role in memberships:
            membership_set_role(tenant=tenant, user=user, role=role)
        return user

    return make
