"""The ``hedgerow`` CLI run as a subprocess against the real stack."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from apps.orchard.tests.live import wait_all_deleted
from apps.sandboxes.models import Sandbox, State
from apps.tenancy.models import ApiKey

pytestmark = pytest.mark.timeout(240)
SDK_DIR = Path(__file__).resolve().parents[1]


class Cli:
    def __init__(self, config: Path) -> None:
        self.env = {
            k: v for k, v in os.environ.items() if k not in ("HEDGEROW_URL", "HEDGEROW_API_KEY")
        }
        self.env.update({"HEDGEROW_CONFIG": str(config), "PYTHONPATH": str(SDK_DIR)})

    def __call__(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hedgerow.cli", *args],
            env=self.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=180,
        )

    def json(self, *args: str) -> object:
        done = self("--json", *args)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


def test_it_logs_in_and_drives_sandboxes_files_ops_and_keys(live, make_tenant, tmp_path):
    tenant, secret = make_tenant()
    config = tmp_path / "cfg" / "config.json"
    cli = Cli(config)

    refused = cli("--url", live.url, "--key", "hr_bad", "login")
    assert refused.returncode == 1 and "invalid" in refused.stderr.lower()
    assert not config.exists()
    done = cli("--url", live.url, "--key", secret, "login")
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert json.loads(config.read_text()) == {"url": live.url, "api_key": secret}

    created = cli.json("sandbox", "create")
    sandbox_id = created["id"]
    assert created["state"] == "ready"
    assert [s["id"] for s in cli.json("sandbox", "ls")] == [sandbox_id]
    assert cli.json("sandbox", "get", sandbox_id)["state"] == "ready"

    ran = cli("sandbox", "exec", sandbox_id, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (ran.returncode, ran.stdout, ran.stderr) == (7, "out\n", "err\n")
    piped = cli("sandbox", "exec", "--stdin", sandbox_id, "--", "wc -c", stdin="12345")
    assert (piped.returncode, piped.stdout.strip()) == (0, "5")
    timed = cli("sandbox", "exec", "--timeout", "0.5", sandbox_id, "--", "sleep 30")
    assert timed.returncode == 124
    record = cli.json("sandbox", "exec", sandbox_id, "--", "echo", "json")
    assert record["exit_code"] == 0
    op = cli.json("ops", "get", sandbox_id, record["id"])
    assert op["stdout"] == "json\n"

    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f.txt").write_text("deep")
    (tree / "g.txt").write_text("top")
    up = cli("sandbox", "cp", str(tree), f"{sandbox_id}:/workspace/tree")
    assert up.returncode == 0, up.stderr
    back = tmp_path / "back"
    down = cli("sandbox", "cp", f"{sandbox_id}:/workspace/tree", str(back))
    assert down.returncode == 0, down.stderr
    assert (back / "sub" / "f.txt").read_text() == "deep"
    single = cli("sandbox", "cp", f"{sandbox_id}:/workspace/tree/g.txt", str(tmp_path / "g"))
    assert single.returncode == 0 and (tmp_path / "g").read_text() == "top"
    assert cli("sandbox", "cp", "a", "b").returncode == 2

    shell = cli("sandbox", "shell", sandbox_id, stdin="echo from-shell\nexit 5\n")
    assert shell.returncode == 5, shell.stderr
    assert "from-shell" in shell.stdout

    key = cli.json("keys", "create", "ci", "--scopes", "read")
    assert key["secret"].startswith("hr_")
    assert key["id"] in {k["id"] for k in cli.json("keys", "ls")}
    cli.json("keys", "revoke", key["id"])
    assert ApiKey.objects.get(pk=key["id"]).revoked_at is not None

    missing = cli("sandbox", "get", "nope")
    assert missing.returncode == 1 and "not_found" in missing.stderr

    removed = cli("sandbox", "rm", sandbox_id)
    assert removed.returncode == 0, removed.stderr
    assert Sandbox.objects.get(tenant=tenant, external_id=sandbox_id).state in (
        State.TERMINATING,
        State.DELETED,
    )
    wait_all_deleted(tenant)


def test_it_creates_in_bulk_exports_trajectories_and_benches(live, make_tenant, tmp_path):
    tenant, secret = make_tenant()
    cli = Cli(tmp_path / "config.json")
    assert cli("--url", live.url, "--key", secret, "login").returncode == 0

    created = cli.json("sandbox", "create", "--count", "3", "--no-wait")
    assert len(created) == 3
    assert Sandbox.objects.filter(tenant=tenant).count() == 3
    removed = cli("sandbox", "rm", "--all", "--yes")
    assert removed.returncode == 0, removed.stderr
    wait_all_deleted(tenant)

    exported = cli("trajectories", "export", "-o", str(tmp_path / "ep.jsonl"))
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "ep.jsonl").read_text() == ""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"not": "an episode"}\n')
    imported = cli("--json", "trajectories", "import", str(bad))
    assert imported.returncode == 1
    assert json.loads(imported.stdout)["errors"]

    report = cli.json("bench", "exec", "--n", "3")
    assert report["n"] == 3 and report["p50_ms"] > 0
    wait_all_deleted(tenant)


def test_the_readme_quick_start_example_runs_against_the_stack(live, make_tenant):
    tenant, secret = make_tenant()
    env = {
        **os.environ,
        "HEDGEROW_URL": live.url,
        "HEDGEROW_API_KEY": secret,
        "PYTHONPATH": str(SDK_DIR),
    }
    done = subprocess.run(
        [sys.executable, str(SDK_DIR / "examples" / "quickstart.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("exited 3 hello from")
    assert lines[1] == "written by the SDK"
    wait_all_deleted(tenant)


def test_it_creates_a_sandbox_with_an_egress_policy(live, make_tenant, tmp_path):
    tenant, secret = make_tenant()
    cli = Cli(tmp_path / "config.json")
    assert cli("--url", live.url, "--key", secret, "login").returncode == 0
    created = cli.json(
        "sandbox", "create", "--no-wait", "--egress", '{"allow": ["pkg.example.org"]}'
    )
    assert created["egress"] == {"allow": ["pkg.example.org"], "dns": "filtered"}
    assert Sandbox.objects.get(tenant=tenant).egress == created["egress"]
    bad = cli("sandbox", "create", "--egress", "{not json")
    assert bad.returncode == 2 and "--egress" in bad.stderr
    removed = cli("sandbox", "rm", "--all", "--yes")
    assert removed.returncode == 0, removed.stderr
    wait_all_deleted(tenant)
