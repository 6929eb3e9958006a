"""The default state directory is the repository's `.state`, wherever the module that
computes it lives (env.py moved from controlplane/ to apps/core/, and for a while the
benchmarks looked for `apps/.state` and failed to log in to the stack's Postgres)."""

from __future__ import annotations

from typing import Any

import pytest

from apps.core import env


def test_the_repository_root_is_where_manage_py_is() -> None:
    assert (env.REPO_ROOT / "manage.py").is_file()


def test_db_conninfo_reads_the_password_from_the_repositorys_state_dir(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[Any, ...]] = []

    def fake_secret(env_name: str, state_dir: str, file_name: str) -> str:
        seen.append((env_name, state_dir, file_name))
        return "pw"

    monkeypatch.delenv("HEDGEROW_STATE_DIR", raising=False)
    monkeypatch.setattr(env, "state_secret", fake_secret)
    assert "password=pw " in env.db_conninfo("postgres")
    assert seen == [("HEDGEROW_DB_PASSWORD", str(env.REPO_ROOT / ".state"), "db_password")]
