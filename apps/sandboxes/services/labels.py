"""Editing a sandbox's labels after create (``PATCH /api/v1/sandboxes/{id}``).

A label patch is a JSON merge patch of the label map (RFC 7386): a key with a string
value is set, a key with ``null`` is removed, keys not named are kept. The result is
checked by the same rules as a create's labels (at most 32, key syntax, values of at
most 253 characters); a patch that breaks them changes nothing. The read-merge-write
runs on the locked row, so two concurrent patches of different keys both land.
"""

from __future__ import annotations

import json
from typing import Any

from django.db import transaction

from apps.core.errors import Conflict, ValidationFailed
from apps.sandboxes.models import Sandbox, State
from apps.sandboxes.services.lifecycle import sandbox_record_event, validate_labels


def labels_patch_parse(patch: Any) -> dict[str, str | None]:
    """A label merge patch: a JSON object of key → string (set) or null (remove)."""
    if not isinstance(patch, dict):
        raise ValidationFailed(
            "labels must be an object of key → string (set) or null (remove)", field="labels"
        )
    clean: dict[str, str | None] = {}
    for key, value in patch.items():
        if value is not None and not isinstance(value, str):
            raise ValidationFailed(
                f"label {key!r} must be a string, or null to remove it", field="labels"
            )
        clean[str(key)] = value
    # Key syntax is checked for the keys being set by validate_labels below; a removed
    # key that is not a valid label cannot exist, so it is refused too.
    validate_labels({k: "" for k in clean})
    return clean


def sandbox_patch_labels(*, sandbox: Sandbox, patch: Any, actor: str) -> Sandbox:
    """Applies a label merge patch; records one ``labels_changed`` ledger event with the
    keys set and removed (only when something changed). A deleted sandbox's labels are
    its record and stay as they were (409)."""
    changes = labels_patch_parse(patch)
    with transaction.atomic():
        row = Sandbox.objects.select_for_update().get(pk=sandbox.pk)
        if row.state in (State.DELETED, State.FAILED, State.LOST):
            raise Conflict(
                f"the labels of a {row.state} sandbox cannot change",
                code="sandbox_ended",
                extra={"state": row.state},
            )
        old = dict(row.labels or {})
        new = dict(old)
        for key, value in changes.items():
            if value is None:
                new.pop(key, None)
            else:
                new[key] = value
        new = validate_labels(new)
        if new != old:
            Sandbox.objects.filter(pk=row.pk).update(labels=new)
            set_keys = sorted(k for k, v in new.items() if old.get(k) != v)
            removed = sorted(k for k in old if k not in new)
            sandbox_record_event(
                sandbox=row,
                event="labels_changed",
                reason="api",
                message=json.dumps({"set": set_keys, "removed": removed}, separators=(",", ":")),
                actor=actor,
            )
    sandbox.labels = new
    return sandbox


def labels_patch_check(*, sandbox: Sandbox, patch: Any) -> None:
    """Raises what ``sandbox_patch_labels`` would for this patch on the sandbox as read,
    changing nothing (a PATCH checks every part before applying any)."""
    changes = labels_patch_parse(patch)
    merged = {k: v for k, v in (sandbox.labels or {}).items() if changes.get(k, v) is not None}
    merged.update({k: v for k, v in changes.items() if v is not None})
    validate_labels(merged)
