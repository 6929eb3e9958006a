"""Input to running commands, labels edited after create, and the sandbox list's
filters and cursor pages, through the SDK (sync and async) and the CLI, against the
real stack (issue 26: background commands' stdin; "labels editable after create, list
with label/metadata filters and pagination")."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hedgerow import AsyncClient, Client, Conflict, NotFound

from apps.sandboxes.models import Sandbox, SandboxEvent

pytestmark = pytest.mark.timeout(240)
SDK_DIR = Path(__file__).resolve().parents[1]


def cli(live, secret, *argv, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, HEDGEROW_URL=live.url, HEDGEROW_API_KEY=secret, PYTHONPATH=str(SDK_DIR))
    return subprocess.run(
        [sys.executable, "-m", "hedgerow.cli", *argv],
        input=stdin,
        capture_output=True,
        env=env,
        cwd=str(SDK_DIR),
        timeout=120,
    )


def test_a_background_command_reads_input_sent_while_it_runs(live, make_tenant):
    tenant, secret = make_tenant()
    _, outsider = make_tenant()
    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        handle = sandbox.exec(
            ["sh", "-c", 'while read -r l; do echo "got:$l"; done; echo eof'],
            background=True,
            stdin=b"one\n",
            stdin_open=True,
        )
        assert handle.send_stdin("two\nthr") == 7
        assert handle.send_stdin(b"ee\n") == 3
        # Output as it is produced proves the command read the input while running.
        seen = ""
        for frame in handle.output():
            seen += frame.text if frame.type == "stdout" else ""
            if "got:three" in seen:
                break
        assert seen == "got:one\ngot:two\ngot:three\n"
        handle.close_stdin()
        handle.close_stdin()  # closing twice is closing
        result = handle.wait(timeout=60)
        assert (result.exit_code, result.stdout) == (0, "got:one\ngot:two\ngot:three\neof\n")
        with pytest.raises(Conflict) as ended:
            handle.send_stdin("late\n")
        assert ended.value.code == "stdin_closed"

        # A handle picked up by id (another process) writes too, from where input stands.
        cat = sandbox.exec("cat", background=True, stdin_open=True)
        with Client(live.url, secret, cleanup=False) as other:
            again = other.get(sandbox.id).command(cat.id)
            again.send_stdin(b"\x00\xffbinary")
            cat.send_stdin(b"!", eof=True)
        assert cat.wait(timeout=60).stdout_info.head == b"\x00\xffbinary!"

        # Not opened: refused, typed; another team cannot write at all.
        plain = sandbox.exec("sleep 30", background=True)
        with pytest.raises(Conflict) as closed:
            plain.send_stdin("x")
        assert closed.value.code == "stdin_closed"
        with Client(live.url, outsider, cleanup=False) as stranger:
            foreign = stranger.request
            with pytest.raises(NotFound):
                foreign(
                    "POST",
                    f"/sandboxes/{sandbox.id}/operations/{plain.id}/stdin",
                    json={"text": "x"},
                )
        plain.kill()
        with pytest.raises(ValueError):
            sandbox.exec("cat", stdin_open=True)  # needs background=True


def test_the_async_client_sends_input_too(live, make_tenant):
    tenant, secret = make_tenant()

    async def main() -> None:
        async with AsyncClient(live.url, secret) as hr:
            sandbox = await hr.create_sandbox()
            try:
                handle = await sandbox.exec("tr a-z A-Z", background=True, stdin_open=True)
                assert await handle.send_stdin("hello ") == 6
                await handle.send_stdin("world", eof=True)
                result = await handle.wait(timeout=60)
                assert result.stdout == "HELLO WORLD"
            finally:
                await sandbox.delete()

    asyncio.run(main())


def test_the_cli_starts_a_command_with_open_stdin_and_feeds_it(live, make_tenant):
    tenant, secret = make_tenant()
    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        started = cli(
            live, secret, "sandbox", "exec", "--background", "--stdin-open", sandbox.id,
            "--", "wc", "-c",
        )  # fmt: skip
        assert started.returncode == 0, started.stderr
        op = started.stdout.decode().strip()
        fed = cli(live, secret, "ops", "stdin", sandbox.id, op, stdin=b"x" * 70000)
        assert fed.returncode == 0, fed.stderr
        closed = cli(live, secret, "ops", "stdin", sandbox.id, op, "--text", "yz", "--eof")
        assert closed.returncode == 0, closed.stderr
        assert sandbox.command(op).wait(timeout=60).stdout.strip() == "70002"
        refused = cli(live, secret, "ops", "stdin", sandbox.id, op, "--text", "more")
        assert refused.returncode == 1 and b"stdin_closed" in refused.stderr
        usage = cli(live, secret, "sandbox", "exec", "--stdin-open", sandbox.id, "--", "cat")
        assert usage.returncode == 2


def test_labels_change_and_lists_filter_and_page_through_sdk_and_cli(live, make_tenant):
    tenant, secret = make_tenant()
    _, outsider = make_tenant()
    with Client(live.url, secret) as hr:
        made = [hr.create_sandbox(labels={"run": "r1", "n": str(i)}, wait=False) for i in range(5)]
        other = hr.create_sandbox(labels={"run": "r2"}, wait=False)
        assert made[0].update_labels({"stage": "eval", "n": None}) == {
            "run": "r1",
            "stage": "eval",
        }
        assert made[0].labels == {"run": "r1", "stage": "eval"}
        event = SandboxEvent.objects.get(sandbox__external_id=made[0].id, event="labels_changed")
        assert event.reason == "api"

        # Every page, newest first, each sandbox once; two per request.
        listed = [sb.id for sb in hr.sandboxes.list(labels={"run": "r1"}, page_size=2)]
        assert listed == [sb.id for sb in reversed(made)]
        assert [sb.id for sb in hr.sandboxes.list(labels={"stage": None})] == [made[0].id]
        assert [sb.id for sb in hr.sandboxes.list(limit=3)] == [other.id, made[4].id, made[3].id]
        page = hr.sandboxes.list_page(labels={"run": "r1"}, limit=4)
        assert page.count == 5 and len(page.sandboxes) == 4 and page.next_cursor
        rest = hr.sandboxes.list_page(labels={"run": "r1"}, limit=4, cursor=page.next_cursor)
        assert [sb.id for sb in rest.sandboxes] == [made[0].id] and rest.next_cursor is None
        assert rest.count is None  # counted on the first page only
        assert [sb.id for sb in hr.list(labels={"run": "r2"})] == [other.id]

        # The CLI: ls --label, label KEY=VALUE KEY-.
        shown = cli(live, secret, "sandbox", "ls", "--label", "run=r2", "--state", "all")
        assert shown.returncode == 0, shown.stderr
        assert other.id in shown.stdout.decode() and made[0].id not in shown.stdout.decode()
        changed = cli(live, secret, "sandbox", "label", other.id, "run-", "owner=me")
        assert changed.returncode == 0, changed.stderr
        assert changed.stdout.decode().split() == ["owner=me"]
        assert Sandbox.objects.get(external_id=other.id).labels == {"owner": "me"}
        bad = cli(live, secret, "sandbox", "label", other.id, "bad key!=x")
        assert bad.returncode == 1 and b"validation_error" in bad.stderr
        assert cli(live, secret, "sandbox", "label", other.id, "novalue").returncode == 2

        with Client(live.url, outsider, cleanup=False) as stranger:
            assert list(stranger.sandboxes.list()) == []
            with pytest.raises(NotFound):
                stranger.get(other.id).update_labels({"x": "y"})
    # Another team's key changed nothing.
    assert Sandbox.objects.get(external_id=other.id).labels == {"owner": "me"}


def test_the_async_client_lists_pages_and_edits_labels(live, make_tenant):
    tenant, secret = make_tenant()

    async def main() -> None:
        async with AsyncClient(live.url, secret) as hr:
            made = [await hr.create_sandbox(labels={"batch": "b"}, wait=False) for _ in range(3)]
            ids = [sb.id async for sb in hr.sandboxes.list(labels={"batch": "b"}, page_size=1)]
            assert ids == [sb.id for sb in reversed(made)]
            assert await made[1].update_labels({"batch": None, "k": "v"}) == {"k": "v"}
            assert [sb.id for sb in await hr.list(labels={"k": "v"})] == [made[1].id]
            page = await hr.sandboxes.list_page(labels={"batch": "b"}, limit=1)
            assert page.count == 2 and page.next_cursor

    asyncio.run(main())


def test_it_watches_a_directory_through_sdk_and_rest(live, make_tenant):
    tenant, secret = make_tenant()
    _, outsider = make_tenant()
    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        sandbox.mkdir("/workspace/w/sub")
        with sandbox.watch("/workspace/w", recursive=True) as watcher:
            assert watcher.id.startswith("w-") and watcher.events() == []
            sandbox.write_file("/workspace/w/a.txt", b"a")
            sandbox.write_file("/workspace/w/sub/b.txt", b"b")
            got = watcher.events(wait=10)
            assert {(e.type, e.name) for e in got} == {
                ("create", "a.txt"),
                ("create", "sub/b.txt"),
            }
            # A read waits for the next change (made by a command in the background).
            sandbox.exec("sleep 0.5; echo more >> /workspace/w/a.txt", background=True)
            started = time.monotonic()
            assert [(e.type, e.name) for e in watcher.events(wait=20)] == [("write", "a.txt")]
            assert time.monotonic() - started < 15
            sandbox.rename("/workspace/w/sub/b.txt", "/workspace/w/c.txt")
            sandbox.remove("/workspace/w/a.txt")
            events = {(e.type, e.name) for e in watcher.events(wait=10)}
            assert events == {("rename", "sub/b.txt"), ("create", "c.txt"), ("remove", "a.txt")}
            # Another team cannot read it, even knowing its id.
            with Client(live.url, outsider, cleanup=False) as stranger:
                with pytest.raises(NotFound):
                    stranger.request("GET", f"/sandboxes/{sandbox.id}/files/watch/{watcher.id}")
            watcher_id = watcher.id
        with pytest.raises(NotFound) as gone:
            hr.request("GET", f"/sandboxes/{sandbox.id}/files/watch/{watcher_id}")
        assert gone.value.code == "watcher_not_found"
        with pytest.raises(NotFound):
            sandbox.watch("/workspace/missing")
        # include_entry: each present name's entry, as a stat answers it; none without.
        with sandbox.watch("/workspace/w", include_entry=True) as with_entries:
            sandbox.write_file("/workspace/w/e.txt", b"abc", mode="0640")
            (event,) = with_entries.events(wait=10)
            assert (event.type, event.name) == ("create", "e.txt")
            assert event.entry is not None
            assert (event.entry.path, event.entry.type, event.entry.size, event.entry.mode) == (
                "/workspace/w/e.txt",
                "file",
                3,
                "0640",
            )
            sandbox.remove("/workspace/w/e.txt")
            assert [(e.type, e.entry) for e in with_entries.events(wait=10)] == [("remove", None)]

    async def main() -> None:
        async with AsyncClient(live.url, secret) as ahr:
            asb = await ahr.create_sandbox()
            try:
                watcher = await asb.watch("/workspace", include_entry=True)
                await asb.write_file("/workspace/x.txt", b"x")
                events = await watcher.events(wait=10)
                assert [(e.type, e.name) for e in events] == [("create", "x.txt")]
                assert events[0].entry is not None and events[0].entry.size == 1
                await watcher.stop()
            finally:
                await asb.delete()

    asyncio.run(main())
