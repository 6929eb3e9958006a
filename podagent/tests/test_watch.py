"""Directory watchers (podagent/watch.py): what changed under a directory since the
last read, waiting for a change up to ``wait`` seconds."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, List

from podagent import watch

from .conftest import Agent, Client


def _create(client: Client, path: str, recursive: bool = False) -> Dict[str, Any]:
    query = f"/watchers?path={path}&recursive={'1' if recursive else '0'}"
    status, body, _ = client.request("POST", query)
    assert status == 200, body
    return dict(body)


def _events(client: Client, watcher_id: str, wait: float = 0) -> List[Dict[str, Any]]:
    status, body = client.get(f"/watchers/{watcher_id}?wait={wait}")
    assert status == 200, body
    return list(body["events"])


def test_it_reports_creates_writes_chmods_renames_and_removes(agent: Agent) -> None:
    client = agent.client()
    root = agent.workdir / "watched"
    (root / "sub").mkdir(parents=True)
    (root / "keep.txt").write_text("a")
    watcher = _create(client, str(root), recursive=True)
    assert watcher["entries"] == 2
    assert _events(client, watcher["watcher_id"]) == []

    (root / "new.txt").write_text("x")
    (root / "sub" / "deep.txt").write_text("y")
    events = _events(client, watcher["watcher_id"])
    assert events == [
        {"name": "new.txt", "type": "create"},
        {"name": "sub/deep.txt", "type": "create"},
    ]
    with open(root / "keep.txt", "a") as handle:
        handle.write("more")
    os.chmod(root / "new.txt", 0o600)
    os.rename(root / "sub" / "deep.txt", root / "moved.txt")
    events = _events(client, watcher["watcher_id"])
    assert sorted(events, key=lambda e: (e["name"], e["type"])) == [
        {"name": "keep.txt", "type": "write"},
        {"name": "moved.txt", "type": "create"},
        {"name": "new.txt", "type": "chmod"},
        {"name": "sub/deep.txt", "type": "rename"},
    ]
    # An atomic write (a new file renamed over the name) is a write of that name.
    (root / "tmp.part").write_text("replaced")
    watcher_events = _events(client, watcher["watcher_id"])
    assert watcher_events == [{"name": "tmp.part", "type": "create"}]
    os.replace(root / "tmp.part", root / "keep.txt")
    assert _events(client, watcher["watcher_id"]) == [
        {"name": "tmp.part", "type": "rename"},
        {"name": "keep.txt", "type": "write"},
    ]
    (root / "new.txt").unlink()
    assert _events(client, watcher["watcher_id"]) == [{"name": "new.txt", "type": "remove"}]
    status, _ = client.request("DELETE", f"/watchers/{watcher['watcher_id']}")[:2]
    assert status == 200
    status, body = client.get(f"/watchers/{watcher['watcher_id']}")
    assert status == 404
    client.close()


def test_a_read_waits_for_the_next_change(agent: Agent) -> None:
    client = agent.client()
    root = agent.workdir / "waiting"
    root.mkdir()
    watcher = _create(client, str(root))
    timer = threading.Timer(0.5, lambda: (root / "late.txt").write_text("z"))
    started = time.monotonic()
    timer.start()
    events = _events(client, watcher["watcher_id"], wait=20)
    took = time.monotonic() - started
    timer.join()
    assert events == [{"name": "late.txt", "type": "create"}]
    assert 0.4 <= took < 10  # woke on the change, not at the end of the wait
    # Not recursive: a change two levels down is not reported.
    (root / "d").mkdir()
    assert _events(client, watcher["watcher_id"]) == [{"name": "d", "type": "create"}]
    (root / "d" / "inner").write_text("q")
    assert _events(client, watcher["watcher_id"], wait=0.3) == []
    assert client.request("DELETE", f"/watchers/{watcher['watcher_id']}")[0] == 200
    client.close()


def test_watchers_are_bounded_and_refuse_what_is_not_a_directory(agent: Agent) -> None:
    client = agent.client()
    (agent.workdir / "file.txt").write_text("f")
    status, body, _ = client.request("POST", f"/watchers?path={agent.workdir}/file.txt")
    assert status == 400 and body["error"]["code"] == "not_a_directory"
    status, body, _ = client.request("POST", f"/watchers?path={agent.workdir}/missing")
    assert status == 404
    status, body, _ = client.request("POST", "/watchers?path=relative")
    assert status == 400 and body["error"]["code"] == "path_not_absolute"
    made = [_create(client, str(agent.workdir)) for _ in range(watch.MAX_WATCHERS)]
    status, body, _ = client.request("POST", f"/watchers?path={agent.workdir}")
    assert status == 429 and body["error"]["code"] == "too_many_watchers"
    for watcher in made:
        assert client.request("DELETE", f"/watchers/{watcher['watcher_id']}")[0] == 200
    big = agent.workdir / "big"
    big.mkdir()
    for i in range(watch.MAX_ENTRIES + 1):
        (big / f"f{i}").touch()
    status, body, _ = client.request("POST", f"/watchers?path={big}")
    assert status == 400 and body["error"]["code"] == "too_many_entries"
    client.close()


def test_a_watcher_with_include_entry_gives_each_present_name_its_entry(agent: Agent) -> None:
    client = agent.client()
    root = agent.workdir / "entries"
    (root / "sub").mkdir(parents=True)
    (root / "old.txt").write_text("old")
    status, created, _ = client.request(
        "POST", f"/watchers?path={root}&recursive=1&include_entry=1"
    )
    assert status == 200 and created["include_entry"] is True, created
    plain = _create(client, str(root), recursive=True)
    assert plain["include_entry"] is False

    (root / "sub" / "a.txt").write_text("abcd")
    os.chmod(root / "sub" / "a.txt", 0o640)
    os.symlink("sub/a.txt", root / "link")
    (root / "old.txt").unlink()
    events = _events(client, created["watcher_id"])
    by_name = {(e["name"], e["type"]): e for e in events}
    assert set(by_name) == {
        ("sub/a.txt", "create"),
        ("link", "create"),
        ("old.txt", "remove"),
    }
    entry = by_name[("sub/a.txt", "create")]["entry"]
    assert entry["path"] == str(root / "sub" / "a.txt") and entry["name"] == "a.txt"
    assert (entry["type"], entry["size"], entry["mode"]) == ("file", 4, "0640")
    link = by_name[("link", "create")]["entry"]
    assert (link["type"], link["target"]) == ("symlink", "sub/a.txt")
    assert "entry" not in by_name[("old.txt", "remove")]
    # The watcher that did not ask sees the same events without entries.
    assert all("entry" not in e for e in _events(client, plain["watcher_id"]))
    assert sorted((e["name"], e["type"]) for e in events) == sorted(by_name)
    client.close()
