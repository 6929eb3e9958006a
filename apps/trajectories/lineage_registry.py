"""Who else holds derived data: apps built on trajectories (datasets, analyses) register
here, so a deletion request can find what it affects without this app importing them
(import-linter keeps trajectories below them).

    from apps.trajectories.lineage_registry import Withdrawal, register_dependent

    def affected_datasets(w: Withdrawal) -> list[dict[str, Any]]:
        ...  # look up by w.episode_pks; mark them stale; say which
        return [{"kind": "dataset", "id": "ds-1", "name": "train-v3", "action": "stale"}]

    register_dependent("datasets", affected_datasets)   # e.g. in AppConfig.ready()

A dependent runs inside the deletion's transaction, before the episodes are deleted
(their rows are still there to join on); what it returns is written into the
tombstone's ``affects``. An exception aborts the whole deletion. A dependent whose
rows reference the episodes (a foreign key with ``PROTECT``) deletes or detaches them
here, or the deletion fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from apps.tenancy.models import Tenant


@dataclass(frozen=True)
class Withdrawal:
    tenant: Tenant
    episode_pks: tuple[str, ...]  # Episode primary keys (UUID strings)
    episode_ids: tuple[str, ...]  # the ids clients see
    layer_ids: tuple[str, ...]  # every LineageLayer derived from them
    request: dict[str, Any]
    reason: str
    actor: str


Dependent = Callable[[Withdrawal], list[dict[str, Any]]]
_dependents: dict[str, Dependent] = {}


def register_dependent(name: str, finder: Dependent) -> None:
    """Registers (or replaces) the dependent called ``name``."""
    _dependents[name] = finder


def unregister_dependent(name: str) -> None:
    _dependents.pop(name, None)


def dependents() -> dict[str, Dependent]:
    return dict(_dependents)
