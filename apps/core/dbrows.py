"""Model instances from hand-written SELECTs, for the few reads on the API's hot paths.

Building and compiling an ORM query costs more CPU than the statement itself for a
one-row read (~0.5 ms against ~0.2 ms; py-spy, docs/benchmarks.md). ``select_list``
gives every concrete column of a model, once; ``instance_from_row`` applies the ORM's
own converters (JSON, …) and ``from_db``, as ``ModelIterable`` does, so the instance is
the one the ORM would have returned. Each caller has a test that holds its statement
to the ORM's answer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import connection
from django.db.models import Model
from django.db.models.expressions import Col

M = TypeVar("M", bound=Model)


@dataclass(frozen=True)
class _Columns:
    select_list: str
    names: list[str]
    converters: list[tuple[int, Col, list[Callable[..., Any]]]]


@functools.cache
def _columns(model: type[Model]) -> _Columns:
    meta = model._meta
    fields = meta.concrete_fields
    converters = []
    for i, f in enumerate(fields):
        col = f.get_col(meta.db_table)
        found = connection.ops.get_db_converters(col) + col.get_db_converters(connection)
        if found:
            converters.append((i, col, found))
    return _Columns(
        ", ".join(f'"{meta.db_table}"."{f.column}"' for f in fields),
        [f.attname for f in fields],
        converters,
    )


def select_list(model: type[Model]) -> str:
    """Every concrete column of ``model``, table-qualified, in ``instance_from_row``'s
    order."""
    return _columns(model).select_list


def instance_from_row(model: type[M], row: Sequence[Any]) -> M:
    """The instance the ORM would build from ``row`` (``select_list`` order)."""
    columns = _columns(model)
    values = list(row[: len(columns.names)])
    for i, col, functions in columns.converters:
        for convert in functions:
            values[i] = convert(values[i], col, connection)
    return model.from_db(connection.alias, columns.names, values)
