"""How the control plane stores and answers a sandbox's resource exhaustion (the live
path through real sandboxes is in test_exhaustion_live.py)."""

from __future__ import annotations

from typing import Any

import pytest

from apps.core.errors import ApiError
from apps.sandboxes.agent_client import AgentError
from apps.sandboxes.models import Operation, OperationStatus
from apps.sandboxes.services.operations import operation_agent_failed, result_fields
from apps.sandboxes.tests.factories import make_sandbox


def _result(termination: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"termination": termination, "stdout": {}, "stderr": {}, "usage": {}, **extra}


def test_an_agent_result_naming_exhaustion_is_a_failed_operation_with_a_typed_error() -> None:
    killed = {"reason": "signaled", "exit_code": None, "signal": 9, "message": "killed"}
    exhausted = {"kind": "memory", "limit": 64 << 20, "oom_kills": 1, "message": "OOM"}
    fields = result_fields(_result(killed, resource_exhausted=exhausted))
    assert fields["status"] == OperationStatus.FAILED
    assert (fields["termination"], fields["signal"]) == ("signaled", 9)
    assert fields["error"] == {
        "code": "resource_exhausted",
        "message": "OOM",
        "kind": "memory",
        "limit": 64 << 20,
        "signal": 9,
    }
    # a crippled command that exited 0 is failed too (the limit refused its forks)
    exited = {"reason": "exited", "exit_code": 0, "signal": None, "message": None}
    pids = result_fields(_result(exited, resource_exhausted={"kind": "pids", "limit": 48}))
    assert pids["status"] == OperationStatus.FAILED and pids["error"]["kind"] == "pids"
    # nothing named: a plain kill or failure stays what it was
    assert result_fields(_result(killed))["status"] == OperationStatus.COMPLETED
    assert result_fields(_result(killed))["error"] is None


def test_an_agent_out_of_threads_is_a_retryable_503_not_an_unreachable_agent(
    make_tenant: Any,
) -> None:
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant)
    operation = Operation.objects.create(
        tenant=tenant, sandbox=sandbox, operation_id="op-1", generation=1, request_hash="h"
    )
    refused = AgentError(503, "resource_exhausted", "no thread left", None, "pids")
    with pytest.raises(ApiError) as raised:
        operation_agent_failed(sandbox=sandbox, operation=operation, exc=refused)
    assert (raised.value.status_code, raised.value.code) == (503, "resource_exhausted")
    assert raised.value.headers == {"Retry-After": "1"}
    assert raised.value.extra["kind"] == "pids"
    operation.refresh_from_db()
    assert operation.status == OperationStatus.FAILED
    assert operation.error == {
        "code": "resource_exhausted",
        "message": "no thread left",
        "kind": "pids",
    }


@pytest.mark.parametrize(
    ("termination", "exhausted"),
    [
        (
            {"reason": "exited", "exit_code": 1, "signal": None, "message": None},
            {"kind": "disk", "limit": 32 << 20, "used": 32 << 20, "message": "disk full"},
        ),
        (
            {"reason": "output_limit", "exit_code": None, "signal": 9, "message": "cut"},
            {"kind": "output", "limit": 100_000, "message": "output cap"},
        ),
    ],
)
def test_disk_and_output_exhaustion_are_failed_operations_with_their_kind(
    termination: dict[str, Any], exhausted: dict[str, Any]
) -> None:
    fields = result_fields(_result(termination, resource_exhausted=exhausted))
    assert fields["status"] == OperationStatus.FAILED
    assert fields["termination"] == termination["reason"]
    assert fields["error"] == {
        "code": "resource_exhausted",
        "message": exhausted["message"],
        "kind": exhausted["kind"],
        "limit": exhausted["limit"],
        "signal": termination["signal"],
    }
