"""A typed ``database_sync_to_async`` (channels ships it untyped)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar, cast

from channels.db import database_sync_to_async

P = ParamSpec("P")
R = TypeVar("R")


def db_async(fn: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """Runs ``fn`` in the ORM's thread with connection cleanup, as channels does."""
    return cast(Callable[P, Awaitable[R]], database_sync_to_async(fn))
