"""The runtime fingerprint's diff and volatile declarations (pure functions)."""

from __future__ import annotations

import pytest

from apps.core.errors import ValidationFailed
from apps.sandboxes.services.fingerprint import (
    runtime_diff,
    runtime_fingerprint,
    validate_volatile,
)

CAPTURED = runtime_fingerprint(
    {
        "ports": [
            {"proto": "tcp", "address": "*", "port": 5432},
            {"proto": "tcp", "address": "loopback", "port": 8080},
        ],
        "processes": [["postgres", "-D", "/workspace/pg"], ["/usr/bin/sleep", "100"]],
        "env": {"PATH": "/usr/bin", "LANG": "C", "API_TOKEN": "s3cret"},
    }
)


def test_secret_looking_environment_values_are_kept_as_a_hash_only():
    assert CAPTURED["env"]["PATH"] == "/usr/bin"
    assert CAPTURED["env"]["API_TOKEN"].startswith("sha256:")
    assert "s3cret" not in str(CAPTURED)


def test_the_same_runtime_state_has_no_diff():
    same = runtime_fingerprint(
        {
            "ports": list(reversed(CAPTURED["ports"])),
            "processes": list(reversed(CAPTURED["processes"])),
            "env": {"LANG": "C", "PATH": "/usr/bin", "API_TOKEN": "s3cret"},
        }
    )
    assert runtime_diff(CAPTURED, same, []) == []


def test_a_missing_server_an_extra_process_and_a_changed_variable_are_each_named():
    child = runtime_fingerprint(
        {
            "ports": [{"proto": "tcp", "address": "loopback", "port": 8080}],
            "processes": [["/usr/bin/sleep", "100"], ["/usr/bin/sleep", "100"]],
            "env": {"PATH": "/usr/bin", "LANG": "C.UTF-8", "API_TOKEN": "other"},
        }
    )
    diff = runtime_diff(CAPTURED, child, [])
    hashed = CAPTURED["env"]["API_TOKEN"]
    assert diff == [
        {
            "fingerprint": "ports",
            "missing": [{"proto": "tcp", "address": "*", "port": 5432}],
            "unexpected": [],
        },
        {
            "fingerprint": "processes",
            "missing": [["postgres", "-D", "/workspace/pg"]],
            "unexpected": [["/usr/bin/sleep", "100"]],
        },
        {"env": "API_TOKEN", "expected": hashed, "actual": child["env"]["API_TOKEN"]},
        {"env": "LANG", "expected": "C", "actual": "C.UTF-8"},
    ]
    # declared volatile: shown, not compared (by part, by port, by process name, by name)
    assert runtime_diff(CAPTURED, child, ["ports", "processes", "env"]) == []
    narrow = ["port:5432", "process:postgres", "process:sleep", "env:LANG", "env:API_TOKEN"]
    assert runtime_diff(CAPTURED, child, narrow) == []
    assert [d.get("env") for d in runtime_diff(CAPTURED, child, ["env:LANG"]) if "env" in d] == [
        "API_TOKEN"
    ]


def test_a_capture_without_runtime_parts_compares_none_of_them():
    child = runtime_fingerprint({"ports": [{"proto": "tcp", "address": "*", "port": 1}]})
    assert runtime_diff({"tree": "sha256:x"}, child, []) == []


def test_an_unset_variable_is_null_on_its_side():
    child = runtime_fingerprint({**CAPTURED, "env": {"PATH": "/usr/bin", "NEW": "1"}})
    diff = runtime_diff(CAPTURED, child, ["env:API_TOKEN"])
    assert {"env": "LANG", "expected": "C", "actual": None} in diff
    assert {"env": "NEW", "expected": None, "actual": "1"} in diff


@pytest.mark.parametrize(
    "bad",
    ["ports ", "port:abc", "env:", "everything", 3, ["ports"], "process:a/b"],
)
def test_bad_volatile_declarations_are_typed(bad):
    with pytest.raises(ValidationFailed) as err:
        validate_volatile([bad])
    assert err.value.field == "volatile"


def test_volatile_declarations_are_kept_sorted_and_once():
    assert validate_volatile(["env:B", "ports", "env:B", "port:80"]) == [
        "env:B",
        "port:80",
        "ports",
    ]
    assert validate_volatile(None) == []
    with pytest.raises(ValidationFailed):
        validate_volatile("ports")
