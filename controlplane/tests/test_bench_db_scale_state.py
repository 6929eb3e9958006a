"""bench/db_scale.py's ``--state DIR`` / ``--reuse DIR`` handling (issue 20): which kept
database a directory names, and the clear refusals (exit 2 with a message) before any
stack starts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.db_scale import STATE_FILE, read_state, state_database


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="db_scale")


def _kept(directory: Path, **extra: object) -> dict[str, object]:
    record: dict[str, object] = {
        "database": state_database(directory),
        "live": 10,
        "ended": 94,
        "ops": 500,
        "episodes": 2,
        "start": "2026-12-06T06:00:00+00:00",
        "busy": "sb-0000104",
        **extra,
    }
    (directory / STATE_FILE).write_text(json.dumps(record))
    return record


def test_a_directory_names_one_database_by_its_resolved_path(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    name = state_database(tmp_path / "a")
    assert name.startswith("hr_dbscale_") and len(name) <= 63
    assert state_database(tmp_path / "b" / ".." / "a") == name
    assert state_database(tmp_path / "b") != name


def test_neither_option_generates_and_keeps_nothing(tmp_path: Path) -> None:
    assert read_state(_parser(), None, None) is None


def test_state_into_a_new_directory_generates(tmp_path: Path) -> None:
    assert read_state(_parser(), tmp_path / "new", None) is None


def test_reuse_returns_the_kept_record(tmp_path: Path) -> None:
    record = _kept(tmp_path, scale=0.001)
    assert read_state(_parser(), None, tmp_path) == record


def test_state_and_reuse_together_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        read_state(_parser(), tmp_path, tmp_path)
    assert exit_.value.code == 2
    assert "--state and --reuse exclude each other" in capsys.readouterr().err


def test_state_into_a_directory_that_holds_a_kept_database_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _kept(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        read_state(_parser(), tmp_path, None)
    assert exit_.value.code == 2
    assert f"measure it with --reuse {tmp_path}" in capsys.readouterr().err


def test_reuse_of_a_directory_without_a_finished_generation_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        read_state(_parser(), None, tmp_path)
    assert exit_.value.code == 2
    assert f"no {STATE_FILE}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [("{not json", "is not valid JSON"), ('{"database": "hr_x"}', "lacks busy, ended")],
)
def test_reuse_of_a_damaged_record_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    (tmp_path / STATE_FILE).write_text(text)
    with pytest.raises(SystemExit) as exit_:
        read_state(_parser(), None, tmp_path)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
