"""Every file path the docs name exists (issue 18: docs/architecture.md is the map, and
a map with dead paths sends a reader nowhere).

A path is a backquoted ``dir/file.ext`` in ``README.md`` or ``docs/*.md``. The docs
often name a file relative to the app or package they are about (``services/lifecycle.py``
in a section on sandboxes), so a path counts as found when some file of the repository
is that path or ends with it. ``EXEMPT`` lists what is not in the repository on purpose,
with the reason; an entry no doc mentions any more fails too, so the list only shrinks.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# not part of the repository: the environment, installed packages, build output
_SKIP_DIRS = {".git", ".venv", "node_modules", ".state", "staticfiles", "__pycache__", "build"}
_PATH = re.compile(
    r"`(?:\{% static ')?"
    r"([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)+\.(?:py|md|sh|toml|ya?ml|json|tsx?|js|html|css|txt|cfg))"
    r"(?::\d+)?'?"
)

# path -> why the repository does not hold it
EXEMPT: dict[str, str] = {
    "deploy/overlays/mycluster/kustomization.yaml": "the reader's own overlay, copied from example",
    "deploy/overlays/mycluster/config.yaml": "the reader's own overlay, copied from example",
    "dist/main.js": "Vite's build output (frontend/static/dist, git-ignored)",
    "node_modules/axe-core/axe.min.js": "installed by npm ci",
}


def doc_paths(text: str) -> set[str]:
    """The backquoted file paths in a Markdown ``text``; those outside the repository
    (``../shared/...``, the design documents beside it) and URL paths are not."""
    return {
        found
        for found in _PATH.findall(text)
        if not found.startswith(("../", "./", "/")) and "://" not in found
    }


def repository_files() -> set[str]:
    files: set[str] = set()
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        rel = Path(top).relative_to(ROOT)
        files.update((rel / name).as_posix() for name in names)
    return files


def exists(path: str, files: set[str]) -> bool:
    return path in files or any(f.endswith("/" + path) for f in files)


def mentioned() -> dict[str, set[str]]:
    return {doc.relative_to(ROOT).as_posix(): doc_paths(doc.read_text()) for doc in DOCS}


def test_every_path_the_docs_name_exists() -> None:
    files = repository_files()
    dead = sorted(
        (doc, path)
        for doc, paths in mentioned().items()
        for path in paths
        if path not in EXEMPT and not exists(path, files)
    )
    assert dead == [], f"docs name files that do not exist (fix the doc or the path): {dead}"


def test_every_exempt_path_is_still_mentioned() -> None:
    named = set().union(*mentioned().values())
    assert sorted(EXEMPT.keys() - named) == []


def test_every_document_is_two_hops_from_the_readme() -> None:
    """README -> docs/architecture.md (the map) -> every other document."""
    readme = (ROOT / "README.md").read_text()
    assert "docs/architecture.md" in readme
    the_map = (ROOT / "docs" / "architecture.md").read_text()
    unnamed = sorted(
        doc.name
        for doc in (ROOT / "docs").glob("*.md")
        if doc.name != "architecture.md" and f"docs/{doc.name}" not in the_map
    )
    assert unnamed == [], f"docs/architecture.md does not point to: {unnamed}"


def test_the_scan_finds_paths_and_judges_them() -> None:
    text = (
        "see `apps/sandboxes/services/lifecycle.py:120` and `services/waiting.py`, "
        "`{% static 'dist/main.js' %}`, `../shared/design/X.md`, `make test`, `a.py`"
    )
    assert doc_paths(text) == {
        "apps/sandboxes/services/lifecycle.py",
        "services/waiting.py",
        "dist/main.js",
    }
    files = {"apps/sandboxes/services/waiting.py", "README.md"}
    assert exists("services/waiting.py", files)
    assert exists("README.md", files)
    assert not exists("apps/sandboxes/services/lifecycle.py", files)
    assert not exists("es/waiting.py", files)  # a suffix counts at a "/" only
