"""NUL bytes without a live agent (issue 14, finding 4): whatever an agent answers,
the stored record holds the exact bytes and the operation ends; a NUL in the input is
refused before a row exists."""

from __future__ import annotations

import base64

import pytest

from apps.core.errors import ValidationFailed
from apps.sandboxes.models import Operation, OperationStatus
from apps.sandboxes.services.operations import (
    ExecRequest,
    operation_record_failure,
    operation_record_result,
)
from apps.sandboxes.tests.factories import make_sandbox

pytestmark = pytest.mark.django_db

# What agents before the base64-on-NUL rule answered: valid UTF-8 text with a NUL.
OLD_AGENT_RESULT = {
    "termination": {"reason": "exited", "exit_code": 0, "signal": None, "message": None},
    "stdout": {"head": "a\x00b", "tail": "", "encoding": "utf-8", "total_bytes": 3},
    "stderr": {"head": "x\x00", "tail": "\x00y", "encoding": "utf-8", "total_bytes": 9000},
    "usage": {"wall_s": 0.01},
    "children_remained": False,
}


def _running(make_tenant):
    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant)
    return Operation.objects.create(
        tenant=tenant, sandbox=sandbox, operation_id="op-1", generation=1, request_hash="h"
    )


def test_it_stores_an_older_agents_nul_output_as_base64_with_the_exact_bytes(make_tenant):
    operation = _running(make_tenant)
    operation_record_result(operation=operation, result=OLD_AGENT_RESULT)
    row = Operation.objects.get(pk=operation.pk)
    assert (row.status, row.termination, row.exit_code) == (OperationStatus.COMPLETED, "exited", 0)
    assert row.stdout["encoding"] == row.stderr["encoding"] == "base64"
    assert base64.b64decode(row.stdout["head"]) == b"a\x00b"
    assert base64.b64decode(row.stderr["head"]) == b"x\x00"
    assert base64.b64decode(row.stderr["tail"]) == b"\x00y"
    assert row.stderr["total_bytes"] == 9000


def test_it_stores_a_failure_message_that_holds_a_nul(make_tenant):
    operation = _running(make_tenant)
    operation_record_failure(operation=operation, code="agent_error", message="bad \x00 path")
    row = Operation.objects.get(pk=operation.pk)
    assert row.status == OperationStatus.FAILED
    assert row.error == {"code": "agent_error", "message": "bad \\0 path"}


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"command": ["ls", "a\x00"]}, "command[1]"),
        ({"command": "ls\x00"}, "command"),
        ({"command": "ls", "env": {"A\x00": "1"}}, "env"),
        ({"command": "ls", "env": {"A": "\x001"}}, "env.A"),
        ({"command": "ls", "cwd": "/\x00"}, "cwd"),
    ],
)
def test_every_exec_path_refuses_a_nul_in_its_input(make_tenant, request_fields, field):
    from apps.sandboxes.services.operations import operation_start
    from apps.tenancy.principal import Principal

    tenant, _ = make_tenant()
    sandbox = make_sandbox(tenant)
    with pytest.raises(ValidationFailed) as refused:
        operation_start(
            principal=Principal(tenant=tenant, scopes=frozenset({"write"})),
            sandbox=sandbox,
            request=ExecRequest(**request_fields),
            operation_id=None,
        )
    assert refused.value.field == field
    assert refused.value.as_dict()["error"]["code"] == "validation_error"
    assert not Operation.objects.exists()
