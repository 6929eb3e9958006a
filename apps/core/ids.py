"""Identifier checks shared by lookups: a value that is not a UUID never reaches a
UUID column (Postgres would raise on the cast)."""

from __future__ import annotations

import uuid


def is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True
