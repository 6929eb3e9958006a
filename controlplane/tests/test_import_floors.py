"""No deferred imports to dodge a circle between apps (issue 18; docs/architecture.md,
"The import-layer contract").

import-linter sees imports inside functions too, so the contracts already forbid a
lower floor importing a higher one wherever the import sits. What they cannot see is
*why* an import sits inside a function: the usual reason is a circle that the import
hides from Python's module loader. This test lists every function-level import of
another app (or of ``frontend``/``controlplane``) in product code and fails on any that
is not in ``ALLOWED`` with its reason; an ``ALLOWED`` entry that no longer matches an
import fails too, so the list only shrinks. ``AppConfig.ready`` is exempt: Django
requires app-crossing wiring (signal hooks, registries) to run there, after every
app's models are loaded.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("apps", "frontend", "controlplane")
FIRST_PARTY = ("apps", "frontend", "controlplane")

# (file, imported module) -> why it is still deferred. Remove an entry with its import.
ALLOWED: dict[tuple[str, str], str] = {}


def _own(path: Path) -> str:
    """The first-party package ``path`` belongs to: ``apps.<app>``, ``frontend`` or
    ``controlplane``."""
    parts = path.relative_to(ROOT).parts
    return ".".join(parts[:2]) if parts[0] == "apps" else parts[0]


def _target(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] not in FIRST_PARTY:
        return None
    return ".".join(parts[:2]) if parts[0] == "apps" else parts[0]


def _is_ready(path: Path, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return path.name == "apps.py" and function.name == "ready"


def scan(rel: str, source: str) -> set[tuple[str, str]]:
    """``(rel, module)`` for each function-level import in ``source`` (the file ``rel``
    under the repository) of a first-party package other than the file's own."""
    path = ROOT / rel
    own = _own(path)
    found: set[tuple[str, str]] = set()
    for function in ast.walk(ast.parse(source, filename=rel)):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if _is_ready(path, function):
            continue
        for node in ast.walk(function):
            modules: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            for module in modules:
                target = _target(module)
                if target is not None and target != own:
                    found.add((rel, module))
    return found


def deferred_cross_app_imports() -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "tests" in rel.parts or "migrations" in rel.parts:
                continue
            found |= scan(rel.as_posix(), path.read_text())
    return found


def test_no_deferred_import_crosses_apps_without_a_reason() -> None:
    found = deferred_cross_app_imports()
    unexplained = sorted(found - ALLOWED.keys())
    assert unexplained == [], (
        "function-level imports of another app (import at the top, or invert the "
        "dependency with a signal or a registry; see docs/architecture.md): "
        f"{unexplained}"
    )


def test_every_allowed_deferred_import_still_exists() -> None:
    stale = sorted(ALLOWED.keys() - deferred_cross_app_imports())
    assert stale == [], f"remove these ALLOWED entries, their imports are gone: {stale}"


def test_the_scan_sees_a_deferred_cross_app_import() -> None:
    """The scanner itself: a function-level import of another app is found (``from``
    and plain ``import``), one of the file's own app, one at module level and one in
    ``AppConfig.ready`` are not."""
    source = (
        "from apps.tenancy.models import Tenant\n"
        "def f():\n"
        "    from apps.billing.usage import x\n"
        "    from apps.sandboxes.models import y\n"
        "    import frontend.views\n"
        "class C:\n"
        "    def ready(self):\n"
        "        from apps.billing.quotas import z\n"
    )
    found = scan("apps/sandboxes/apps.py", source)
    assert found == {
        ("apps/sandboxes/apps.py", "apps.billing.usage"),
        ("apps/sandboxes/apps.py", "frontend.views"),
    }
    # outside apps.py, ``ready`` is an ordinary function
    assert ("apps/sandboxes/other.py", "apps.billing.quotas") in scan(
        "apps/sandboxes/other.py", source
    )
