"""Docstrings with units and defaults, and typed returns (issue 26 defect 10): every
public call says what it does, none returns a bare ``Dict[str, Any]``, and the calls
users read most state their units and defaults."""

from __future__ import annotations

import inspect

import hedgerow
import pytest
from hedgerow.episode import AsyncEpisode, Episode
from hedgerow.images import AsyncImages, Images
from hedgerow.sandboxes import AsyncSandboxes, Sandboxes
from hedgerow.watch import AsyncWatcher, Watcher

CLASSES = [
    hedgerow.Client,
    hedgerow.Sandbox,
    hedgerow.AsyncClient,
    hedgerow.AsyncSandbox,
    hedgerow.CommandHandle,
    hedgerow.AsyncCommandHandle,
    Images,
    AsyncImages,
    Sandboxes,
    AsyncSandboxes,
    Watcher,
    AsyncWatcher,
    Episode,
    AsyncEpisode,
    hedgerow.Snapshot,
    hedgerow.AsyncSnapshot,
    hedgerow.ExecResult,
]


# Calls that return the caller's own JSON as given: no shape to type.
USER_JSON = {("Snapshot", "manifest"), ("AsyncSnapshot", "manifest")}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_it_documents_every_public_call_and_returns_typed_objects(cls):
    for name in sorted(n for n in dir(cls) if not n.startswith("_")):
        attr = inspect.getattr_static(cls, name)
        function = attr.fget if isinstance(attr, property) else attr
        if not inspect.isfunction(function):
            continue
        assert (function.__doc__ or "").strip(), f"{cls.__name__}.{name} has no docstring"
        returns = str(inspect.signature(function).return_annotation)
        if (cls.__name__, name) in USER_JSON:
            continue
        assert "Dict[str, Any]" not in returns and "dict[str, Any]" not in returns, (
            f"{cls.__name__}.{name} returns a bare dict: {returns}"
        )


def test_it_states_units_and_defaults_where_users_look():
    create = inspect.getdoc(hedgerow.Client.create_sandbox)
    for promise in ("3600 s", "1024 MiB", "1 core", "120 s", "300 s", "python:3.12-slim"):
        assert promise in create
    assert "600 s" in inspect.getdoc(hedgerow.Sandbox.exec)
    assert "seconds" in inspect.getdoc(hedgerow.CommandHandle.wait)


def test_it_keeps_dict_access_on_the_typed_records():
    info = hedgerow.FileInfo.from_api(
        {"name": "a", "path": "/a", "type": "file", "size": 3, "mode": "0644", "modified": 1.5}
    )
    assert (info.size, info["size"], info.get("target"), info.mode) == (3, 3, None, "0644")
    key = hedgerow.ApiKeyInfo.from_api({"id": "k1", "name": "n", "secret": "hr_x"})
    assert (key.secret, key["secret"], key.revoked) == ("hr_x", "hr_x", False)


def test_docs_sdk_md_names_every_public_call():
    # Issue 26: "docs/sdk.md documents every call"; a call added without a line there
    # fails here.
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "sdk.md").read_text()
    missing = []
    for cls in CLASSES:
        for name in sorted(n for n in dir(cls) if not n.startswith("_")):
            attr = inspect.getattr_static(cls, name)
            if not (inspect.isfunction(attr) or isinstance(attr, property)):
                continue
            if not re.search(rf"\b{re.escape(name)}\b", doc):
                missing.append(f"{cls.__name__}.{name}")
    assert missing == []
