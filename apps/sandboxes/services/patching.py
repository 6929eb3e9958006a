"""apply_patch: one implementation for the REST API, the Orchard API and the SDK."""

from __future__ import annotations

import hashlib

from apps.sandboxes.models import Operation, Sandbox
from apps.sandboxes.services import files
from apps.sandboxes.services.operations import ExecRequest, ensure_ready, operation_exec
from apps.tenancy.principal import Principal

# git apply works outside a repository too and handles renames and binary hunks;
# patch(1) is the fallback. -p1 first (a/ b/ prefixes), then -p0. The file is removed.
PATCH_SCRIPT = r"""
p="$HEDGEROW_PATCH_FILE"
applied=""
rc=1
for strip in 1 0; do
  if command -v git >/dev/null 2>&1 && git apply --check -p"$strip" "$p" >/dev/null 2>&1; then
    git apply --whitespace=nowarn -p"$strip" "$p"; rc=$?; applied=1; break
  fi
  if command -v patch >/dev/null 2>&1 &&
     patch --dry-run --batch --forward -p"$strip" < "$p" >/dev/null 2>&1; then
    patch --batch --forward -p"$strip" < "$p"; rc=$?; applied=1; break
  fi
done
if [ -z "$applied" ]; then
  # Nothing applies cleanly: run it for real so the tool's own message says why.
  if command -v git >/dev/null 2>&1; then git apply -p1 "$p"; else
    patch --batch --forward -p1 < "$p"; fi
  rc=$?
fi
rm -f "$p"
exit "$rc"
"""


def sandbox_apply_patch(
    *,
    principal: Principal,
    sandbox: Sandbox,
    patch: str,
    cwd: str | None = None,
    timeout: float | None = None,
    operation_id: str | None = None,
) -> Operation:
    """Applies a unified diff in ``cwd`` (default /workspace) as a recorded operation.

    The patch travels as a file named by its content hash, so a replayed operation id
    with the same patch returns the stored result without writing or running again,
    and the same id with a different patch is a 409 like any exec. A patch that does
    not apply is a completed operation with a non-zero exit, not an HTTP error.
    """
    ensure_ready(sandbox)
    data = patch.encode() if patch.endswith("\n") else (patch + "\n").encode()
    target = f"/tmp/.hedgerow-patch-{hashlib.sha256(data).hexdigest()[:24]}.diff"
    replay = (
        operation_id is not None
        and Operation.objects.filter(sandbox=sandbox, operation_id=operation_id).exists()
    )
    if not replay:
        files.file_write(
            sandbox=sandbox, path=target, chunks=iter([data]), size=len(data), max_bytes=len(data)
        )
    return operation_exec(
        principal=principal,
        sandbox=sandbox,
        request=ExecRequest(
            command=PATCH_SCRIPT,
            cwd=cwd or "/workspace",
            env={"HEDGEROW_PATCH_FILE": target},
            timeout=float(timeout or 60),
        ),
        operation_id=operation_id,
    )
