"""DELETE /api/v1/sandboxes/<id>/files (the dashboard's file browser uses the same
service): a file goes, a non-empty directory needs recursive=true, a missing path is a
404, / and /workspace are refused, and another team's sandbox is not found."""

from __future__ import annotations

from typing import Any

import pytest

from apps.sandboxes.tests.test_files_live import _api, _error, _ready, _sh

pytestmark = pytest.mark.timeout(300)


def test_it_deletes_files_and_directories_with_typed_refusals(live: Any, make_tenant: Any) -> None:
    _, secret = make_tenant()
    _, other_secret = make_tenant()
    http = _api(live, secret)
    sandbox_id = _ready(http)
    _sh(
        http,
        sandbox_id,
        "mkdir -p /workspace/d/e && echo x > /workspace/d/e/f && echo y > /workspace/g",
    )
    url = f"/sandboxes/{sandbox_id}/files"

    gone = http.delete(url, params={"path": "/workspace/g"})
    assert gone.status_code == 200 and gone.json() == {"path": "/workspace/g", "deleted": True}
    _error(http.delete(url, params={"path": "/workspace/g"}), 404, "not_found")
    _error(http.delete(url, params={"path": "/workspace/d"}), 400, "directory_not_empty")
    assert _sh(http, sandbox_id, "cat /workspace/d/e/f") == "x\n"
    _error(http.delete(url, params={"path": "relative"}), 400, "path_not_absolute")

    outsider = _api(live, other_secret)
    assert (
        outsider.delete(url, params={"path": "/workspace/d", "recursive": "true"}).status_code
        == 404
    )
    assert _sh(http, sandbox_id, "ls /workspace") == "d\n"

    done = http.delete(url, params={"path": "/workspace/d", "recursive": "true"})
    assert done.status_code == 200, done.text
    assert _sh(http, sandbox_id, "ls -A /workspace") == ""
