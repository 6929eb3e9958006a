"""apply_patch through the REST API: one recorded operation, replay-safe."""

from __future__ import annotations

import httpx
import pytest

from apps.sandboxes.models import Operation

pytestmark = pytest.mark.timeout(180)

DIFF = "--- a/app.py\n+++ b/app.py\n@@ -1 +1 @@\n-print('old')\n+print('new')\n"


def test_it_applies_a_patch_once_and_reports_one_that_does_not_apply(live, make_tenant):
    _, secret = make_tenant()
    http = httpx.Client(
        base_url=live.url + "/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=90,
        trust_env=False,
    )
    sandbox_id = http.post("/sandboxes", json={"image": "host"}).json()["id"]
    assert http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 60}).status_code == 200
    http.put(
        f"/sandboxes/{sandbox_id}/files",
        params={"path": "/workspace/app.py"},
        content=b"print('old')\n",
    )
    url = f"/sandboxes/{sandbox_id}/apply_patch"
    applied = http.post(url, json={"patch": DIFF, "operation_id": "patch-1"})
    assert applied.status_code == 200, applied.text
    assert applied.json()["applied"] is True
    content = http.get(f"/sandboxes/{sandbox_id}/files", params={"path": "/workspace/app.py"})
    assert content.content == b"print('new')\n"

    # The same operation id replays the stored result instead of patching twice.
    replay = http.post(url, json={"patch": DIFF, "operation_id": "patch-1"}).json()
    assert replay["applied"] is True and replay["id"] == "patch-1"
    assert Operation.objects.filter(operation_id="patch-1").count() == 1
    conflict = http.post(
        url, json={"patch": DIFF.replace("new", "other"), "operation_id": "patch-1"}
    )
    assert conflict.status_code == 409

    # Applying it again for real fails (already applied): a typed result, not an HTTP error.
    again = http.post(url, json={"patch": DIFF}).json()
    assert again["applied"] is False and again["exit_code"] != 0
    assert again["stderr"]
    leftovers = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": "ls -a /tmp"}).json()
    assert ".hedgerow-patch" not in leftovers["stdout"]

    bad = http.post(url, json={"patch": DIFF, "cwd": "relative"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "cwd"
