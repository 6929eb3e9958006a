"""The CLI's file commands and lifetime (issue 26: the missing features "in the sync
and async clients and the CLI"): ``fs ls|stat|mkdir|mv|rm|watch ID:/path`` and
``sandbox timeout ID SECONDS``, against the live stack, run as subprocesses."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hedgerow import Client

from apps.sandboxes.models import Sandbox as Row

pytestmark = pytest.mark.timeout(240)
SDK_DIR = Path(__file__).resolve().parents[1]


def _env(live, secret) -> dict[str, str]:
    return dict(os.environ, HEDGEROW_URL=live.url, HEDGEROW_API_KEY=secret, PYTHONPATH=str(SDK_DIR))


def cli(live, secret, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hedgerow.cli", *argv],
        capture_output=True,
        text=True,
        env=_env(live, secret),
        cwd=str(SDK_DIR),
        timeout=120,
    )


def test_cli_lists_stats_makes_moves_and_removes_files(live, make_tenant):
    _, secret = make_tenant()
    _, outsider = make_tenant()
    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        sandbox.write_file("/workspace/a.txt", "hello")
        sb = sandbox.id
        made = cli(live, secret, "fs", "mkdir", f"{sb}:/workspace/d/e")
        assert made.returncode == 0 and made.stdout.strip() == "/workspace/d/e", made.stderr
        moved = cli(live, secret, "fs", "mv", f"{sb}:/workspace/a.txt", "/workspace/d/b.txt")
        assert moved.returncode == 0 and moved.stdout.strip() == "/workspace/d/b.txt"
        listed = cli(live, secret, "fs", "ls", f"{sb}:/workspace/d")
        assert listed.returncode == 0
        lines = listed.stdout.splitlines()
        assert [line.split()[-1] for line in lines] == ["b.txt", "e/"]
        assert lines[0].split()[1] == "5"  # bytes
        as_json = json.loads(
            cli(live, secret, "--json", "fs", "stat", f"{sb}:/workspace/d/b.txt").stdout
        )
        assert (as_json["type"], as_json["size"]) == ("file", 5)
        # A directory needs -r; a missing path is one line and exit 1.
        refused = cli(live, secret, "fs", "rm", f"{sb}:/workspace/d")
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1
        assert sandbox.exists("/workspace/d")
        assert cli(live, secret, "fs", "rm", "-r", f"{sb}:/workspace/d").returncode == 0
        assert not sandbox.exists("/workspace/d")
        missing = cli(live, secret, "fs", "stat", f"{sb}:/workspace/nope")
        assert missing.returncode == 1 and "Traceback" not in missing.stderr
        # Bad input is a usage error (2); another team's sandbox is not found.
        assert cli(live, secret, "fs", "ls", "no-colon").returncode == 2
        assert cli(live, secret, "fs", "ls", f"{sb}:relative").returncode == 2
        foreign = cli(live, outsider, "fs", "ls", f"{sb}:/workspace")
        assert foreign.returncode == 1 and "not_found" in foreign.stderr


def test_cli_watches_a_directory_and_sets_a_sandboxs_timeout(live, make_tenant):
    _, secret = make_tenant()
    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        sandbox.mkdir("/workspace/w")
        watch = subprocess.Popen(
            [sys.executable, "-m", "hedgerow.cli", "--json", "fs", "watch", "--count", "2",
             f"{sandbox.id}:/workspace/w"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(live, secret),
            cwd=str(SDK_DIR),
        )  # fmt: skip
        try:
            assert watch.stdout is not None and watch.stderr is not None
            # The watcher exists once this line is out: changes from now on are reported.
            ready = watch.stderr.readline()
            assert ready.startswith(f"watching {sandbox.id}:/workspace/w"), ready
            # Directories: one create each (a file's write could also show as a write).
            sandbox.mkdir("/workspace/w/one")
            first = watch.stdout.readline()
            sandbox.mkdir("/workspace/w/two")
            second = watch.stdout.readline()
            assert watch.wait(timeout=60) == 0, watch.stderr.read()  # --count 2: done
        finally:
            if watch.poll() is None:
                watch.kill()
        assert json.loads(first) == {"type": "create", "name": "one"}
        assert json.loads(second) == {"type": "create", "name": "two"}

        before = dt.datetime.now(dt.UTC)
        changed = cli(live, secret, "sandbox", "timeout", sandbox.id, "900")
        assert changed.returncode == 0, changed.stderr
        row = Row.objects.get(external_id=sandbox.id)
        assert row.expires_at is not None
        assert 890 <= (row.expires_at - before).total_seconds() <= 960
        bad = cli(live, secret, "sandbox", "timeout", sandbox.id, "soon")
        assert bad.returncode == 2
