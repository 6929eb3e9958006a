"""One writer of sandbox states (issue 18; docs/architecture.md, "One transition writer").

Every change of ``Sandbox.state`` — a create's first state, a warm-pool claim born
``ready``, every compare-and-set move — and its ledger rows and usage-ledger write go
through ``apps/sandboxes/services/lifecycle.py``. This test reads product code (the
AST, like ``controlplane/tests/test_import_floors.py``) and fails on a write of the
state or of a ledger row anywhere else:

* a ``state=`` (or ``**`` fields, or ``defaults`` naming ``state``) in ``Sandbox(...)``
  or a write method (``update``, ``create``, ``bulk_create``…) of a chain that starts
  at ``Sandbox``, runs through a manager or queryset (``.objects``, ``.filter(…)``…)
  that is not another model's, or names sandboxes (``tenant.sandboxes``);
* ``<anything>.state = …`` or ``setattr(…, "state", …)`` on something named like a
  sandbox, and ``<sandbox>.save(…)`` (a save writes whatever state the instance holds);
* ``SandboxEvent(...)`` or its manager's ``create``/``bulk_create`` (ledger rows);
* SQL text that updates or inserts into the sandbox or ledger tables, and Django's
  ``InsertQuery``/``UpdateQuery`` (how a statement is built from a model).

A chain that starts at another model's class (``WarmMember``, ``Snapshot``,
``Operation``) is that model's. ``ALLOWED`` holds
a finding with its reason; it is empty, and an entry that no longer matches fails.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = ("apps", "frontend", "controlplane")
WRITER = "apps/sandboxes/services/lifecycle.py"
# (file, rule) -> why it may write. Keep it empty: route the write through the writer.
ALLOWED: dict[tuple[str, str], str] = {}

WRITE_METHODS = frozenset(
    {"update", "create", "get_or_create", "update_or_create", "bulk_create", "bulk_update"}
)
QUERYSET_ATTRS = frozenset({"objects", "filter", "exclude", "all", "select_for_update"})
_SQL_WRITE = re.compile(
    r"\b(UPDATE|INSERT\s+INTO)\s+\"?sandboxes_sandbox(event)?\"?(\s|$|\()", re.IGNORECASE
)


def _chain(node: ast.expr) -> tuple[str, list[str]]:
    """The start of a chain and the attribute names along it: ``("Sandbox",
    ["update", "filter", "objects"])`` for ``Sandbox.objects.filter(...).update``."""
    attrs: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            return (node.id if isinstance(node, ast.Name) else ""), attrs


def _sandboxish(node: ast.expr) -> bool:
    """A receiver named like a sandbox: ``sandbox``, ``self.sandbox``, ``row`` is not."""
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return "sandbox" in name.lower()


def _writes_state(call: ast.Call) -> bool:
    for keyword in call.keywords:
        if keyword.arg in ("state", None):  # ``state=`` or ``**fields``
            return True
        if keyword.arg == "defaults" and isinstance(keyword.value, ast.Dict):
            keys = keyword.value.keys
            if any(isinstance(k, ast.Constant) and k.value == "state" for k in keys):
                return True
    return False


def scan(rel: str, source: str) -> set[tuple[str, str]]:
    """``(rel, rule)`` for each write of the sandbox state or ledger in ``source``."""
    found: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.Call):
            func = node.func
            root_name, attrs = _chain(func)
            if isinstance(func, ast.Name) and func.id == "Sandbox" and _writes_state(node):
                found.add((rel, "Sandbox(state=)"))
            if isinstance(func, ast.Name) and func.id == "SandboxEvent":
                found.add((rel, "SandboxEvent()"))
            if isinstance(func, ast.Attribute) and func.attr in WRITE_METHODS:
                if root_name == "SandboxEvent" and func.attr in ("create", "bulk_create"):
                    found.add((rel, "SandboxEvent.objects.create"))
                # ``Sandbox…``, a queryset or manager chain that is not another model's
                # (a variable handed around, ``tenant.sandboxes``), or a receiver named
                # like sandboxes; a plain ``meta.update(state=…)`` is a dict.
                on_sandboxes = root_name == "Sandbox" or (
                    not root_name[:1].isupper()
                    and (
                        bool(QUERYSET_ATTRS.intersection(attrs[1:]))
                        or any("sandbox" in name.lower() for name in [root_name, *attrs[1:]])
                    )
                )
                if on_sandboxes and _writes_state(node):
                    found.add((rel, f"{func.attr}(state=)"))
            if isinstance(func, ast.Attribute) and func.attr == "save" and _sandboxish(func.value):
                found.add((rel, "sandbox.save()"))
            if (
                isinstance(func, ast.Name)
                and func.id == "setattr"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == "state"
                and _sandboxish(node.args[0])
            ):
                found.add((rel, "sandbox.state ="))
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == "state"
                    and _sandboxish(target.value)
                ):
                    found.add((rel, "sandbox.state ="))
        elif isinstance(node, ast.Name) and node.id in ("InsertQuery", "UpdateQuery"):
            found.add((rel, node.id))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _SQL_WRITE.search(node.value):
                found.add((rel, "SQL write"))
    return found


def product_writes() -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "tests" in rel.parts or "migrations" in rel.parts or rel.as_posix() == WRITER:
                continue
            found |= scan(rel.as_posix(), path.read_text())
    return found


def test_only_the_writer_writes_a_sandbox_state_or_a_ledger_row() -> None:
    unexplained = sorted(product_writes() - ALLOWED.keys())
    assert unexplained == [], (
        "a write of Sandbox.state or of the ledger outside services/lifecycle.py "
        "(use sandbox_transition / sandbox_insert; docs/architecture.md): "
        f"{unexplained}"
    )


def test_every_allowed_write_still_exists() -> None:
    stale = sorted(ALLOWED.keys() - product_writes())
    assert stale == [], f"remove these ALLOWED entries, their writes are gone: {stale}"


def test_the_writer_itself_is_seen_by_the_scan() -> None:
    """The exemption is the writer's and nothing else's: scanned like any other file,
    the writer shows the writes it owns (so the scan reads the real code)."""
    rules = {rule for _rel, rule in scan(WRITER, (ROOT / WRITER).read_text())}
    assert {"sandbox.state =", "InsertQuery", "UpdateQuery"} <= rules


@pytest.mark.parametrize(
    ("line", "rule"),
    [
        ("Sandbox.objects.filter(pk=1).update(state=State.READY)", "update(state=)"),
        ("Sandbox.objects.filter(pk=1).update(**fields)", "update(state=)"),
        ("qs.filter(pk=1).update(state='ready', updated_at=now)", "update(state=)"),
        ("sandboxes.update(state='lost')", "update(state=)"),
        ("tenant.sandboxes.all().update(state='lost')", "update(state=)"),
        ("Sandbox.objects.create(state='ready', tenant=t)", "create(state=)"),
        (
            "Sandbox.objects.update_or_create(pk=1, defaults={'state': 'x'})",
            "update_or_create(state=)",
        ),
        ("Sandbox(state=State.READY, tenant=t)", "Sandbox(state=)"),
        ("sandbox.state = State.LOST", "sandbox.state ="),
        ("self.sandbox.state = 'lost'", "sandbox.state ="),
        ("setattr(sandbox, 'state', 'lost')", "sandbox.state ="),
        ("sandbox.save(update_fields=['state'])", "sandbox.save()"),
        (
            "SandboxEvent.objects.create(sandbox=s, event='transition')",
            "SandboxEvent.objects.create",
        ),
        ("SandboxEvent(sandbox=s)", "SandboxEvent()"),
        ("cursor.execute('UPDATE sandboxes_sandbox SET state = %s', [x])", "SQL write"),
        ("q = 'INSERT INTO \"sandboxes_sandboxevent\" (id) VALUES (1)'", "SQL write"),
        ("InsertQuery(Sandbox)", "InsertQuery"),
        ("query.chain(UpdateQuery)", "UpdateQuery"),
    ],
)
def test_the_scan_sees_a_write(line: str, rule: str) -> None:
    assert scan("apps/x.py", line + "\n") == {("apps/x.py", rule)}


@pytest.mark.parametrize(
    "line",
    [
        "Sandbox.objects.filter(state=State.READY).update(labels={})",
        "Sandbox.objects.filter(pk=1, state='requested').update(updated_at=now)",
        "WarmMember.objects.filter(pk=1).update(state=WarmMemberState.WARM)",
        "Snapshot.objects.filter(pk=1).update(state='ready')",
        "Operation.objects.filter(pk=1).update(**fields)",
        "member.state = 'warm'",
        "meta.update(state='started')",
        "context.update(**extra)",
        "operation.save()",
        "x = Sandbox.objects.filter(state='ready').count()",
        "cursor.execute('SELECT state FROM sandboxes_sandbox WHERE id = %s', [1])",
        "SandboxEvent.objects.filter(sandbox=s).count()",
    ],
)
def test_the_scan_leaves_reads_and_other_models_alone(line: str) -> None:
    assert scan("apps/x.py", line + "\n") == set()


@pytest.mark.django_db
def test_the_admin_shows_the_state_but_never_writes_it() -> None:
    """Django's admin is a writer too: the sandbox's state and generation are read-only
    there (a state changed by hand would skip the ledger and the usage ledger)."""
    from django.contrib import admin

    from apps.sandboxes.models import Sandbox

    model_admin = admin.site._registry[Sandbox]
    assert {"state", "generation"} <= set(model_admin.get_readonly_fields(None))  # type: ignore[arg-type]
