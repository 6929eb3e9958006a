from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def no_enqueue(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Records cold-path enqueues instead of sending them (no worker in unit tests)."""
    from apps.sandboxes import tasks as sandbox_tasks

    sent: dict[str, list[Any]] = {"provision": [], "drain": [], "destroy": []}
    monkeypatch.setattr(
        sandbox_tasks.provision_sandbox, "delay", lambda *a: sent["provision"].append(a)
    )
    monkeypatch.setattr(
        sandbox_tasks.destroy_sandbox, "delay", lambda *a: sent["destroy"].append(a)
    )
    monkeypatch.setattr(sandbox_tasks.admission_drain, "delay", lambda *a: sent["drain"].append(a))
    return sent


@pytest.fixture(autouse=True)
def _fresh_limits_cache() -> None:
    from apps.billing.limits import limits_cache_clear

    limits_cache_clear()


@pytest.fixture
def seeded_price_books(db: Any) -> None:
    """The seed migration's price books (transactional tests flush the tables between
    tests, migration data included)."""
    from apps.billing.pricing import price_books_ensure

    price_books_ensure()
