"""The CLI follows command-line conventions (issue 26 defects 2, 4 and 8): options go
where users put them, secrets are never echoed, exec says why it failed, listings have
headers and sane defaults, destructive commands ask first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hedgerow
import pytest
from hedgerow import Client

from apps.orchard.tests.live import wait_all_deleted
from apps.sandboxes.models import Sandbox, State

pytestmark = pytest.mark.timeout(240)
SDK_DIR = Path(__file__).resolve().parents[1]


class Cli:
    def __init__(self, config: Path) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HEDGEROW_")}
        self.env.update({"HEDGEROW_CONFIG": str(config), "PYTHONPATH": str(SDK_DIR)})

    def __call__(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hedgerow.cli", *args],
            env=self.env,
            input=stdin if stdin is not None else "",
            capture_output=True,
            text=True,
            timeout=180,
        )


def test_login_takes_options_anywhere_and_never_echoes_the_key(live, make_tenant, tmp_path):
    tenant, secret = make_tenant()
    config = tmp_path / "config.json"
    cli = Cli(config)

    # The README's line: options after the subcommand.
    done = cli("login", "--url", live.url, "--key", secret)
    assert done.returncode == 0, done.stderr
    assert secret not in done.stdout + done.stderr
    assert json.loads(config.read_text()) == {"url": live.url, "api_key": secret}

    # A usage error next to the key does not print the key.
    bad = cli("login", "--url", live.url, "--key", secret, "--bogus")
    assert bad.returncode == 2
    assert "--bogus" in bad.stderr and secret not in bad.stderr + bad.stdout

    # No --key: read from stdin (a pipe), not echoed.
    config.unlink()
    piped = cli("login", "--url", live.url, stdin=secret + "\n")
    assert piped.returncode == 0, piped.stderr
    assert secret not in piped.stdout + piped.stderr
    assert json.loads(config.read_text())["api_key"] == secret
    refused = cli("login", "--url", live.url, stdin="hr_wrong\n")
    assert refused.returncode == 1 and "hr_wrong" not in refused.stderr + refused.stdout

    # Global options after the subcommand, before or after its own options.
    listed = cli("sandbox", "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == []
    assert cli("sandbox", "--json", "ls", "--limit", "5").returncode == 0
    version = cli("--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"hedgerow {hedgerow.__version__}")
    wait_all_deleted(tenant)


def test_exec_parses_options_before_the_separator_and_says_why_it_failed(
    live, make_tenant, tmp_path
):
    tenant, secret = make_tenant()
    cli = Cli(tmp_path / "config.json")
    assert cli("login", "--url", live.url, "--key", secret).returncode == 0
    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        missing = sandbox.exec(["nosuchcmd"])
        assert missing.error is not None
        assert missing.error.code == missing.termination == "agent_error"
        assert "nosuchcmd" in missing.error.message
        assert sandbox.exec("true").error is None

        ran = cli("sandbox", "exec", sandbox.id, "--", "nosuchcmd", "arg")
        assert ran.returncode == 1
        assert "nosuchcmd" in ran.stderr and "agent_error" in ran.stderr

        timed = cli("sandbox", "exec", sandbox.id, "--timeout", "1", "--", "sleep", "30")
        assert timed.returncode == 124, timed.stderr
        env = cli("sandbox", "exec", sandbox.id, "--env", "A=b c", "--", "sh", "-c", "echo $A")
        assert (env.returncode, env.stdout) == (0, "b c\n")
        # A word after -- that looks like an option belongs to the command.
        listed = cli("sandbox", "exec", sandbox.id, "--", "ls", "-d", "/workspace")
        assert (listed.returncode, listed.stdout) == (0, "/workspace\n")
    wait_all_deleted(tenant)


def test_ls_rm_and_help_follow_conventions(live, make_tenant, tmp_path):
    tenant, secret = make_tenant()
    cli = Cli(tmp_path / "config.json")
    assert cli("login", "--url", live.url, "--key", secret).returncode == 0
    created = cli("sandbox", "create", "--count", "2", "--no-wait", "--label", "suite=cli")
    assert created.returncode == 0, created.stderr
    gone_id, live_id = created.stdout.split()
    assert Sandbox.objects.get(external_id=live_id).labels == {"suite": "cli"}
    removed = cli("sandbox", "rm", gone_id)
    assert (removed.returncode, removed.stdout) == (0, f"{gone_id}\n")

    listed = cli("sandbox", "ls")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:3] == ["ID", "STATE", "IMAGE"]
    assert [line.split()[0] for line in lines[1:]] == [live_id]  # live ones by default
    everything = cli("sandbox", "ls", "--state", "all")
    assert {line.split()[0] for line in everything.stdout.splitlines()[1:]} == {gone_id, live_id}
    bogus = cli("sandbox", "ls", "--state", "bogus")
    assert bogus.returncode == 2 and "unknown state bogus" in bogus.stderr

    nothing = cli("sandbox", "rm")
    assert nothing.returncode == 2 and "--all" in nothing.stderr
    unconfirmed = cli("sandbox", "rm", "--all")
    assert unconfirmed.returncode == 2 and "--yes" in unconfirmed.stderr
    assert Sandbox.objects.get(external_id=live_id).state not in (
        State.TERMINATING,
        State.DELETED,
    )
    confirmed = cli("sandbox", "rm", "--all", "--yes")
    assert confirmed.returncode == 0, confirmed.stderr
    assert Sandbox.objects.get(external_id=live_id).state in (State.TERMINATING, State.DELETED)

    helped = cli("sandbox", "--help")
    assert helped.returncode == 0
    for text in ("list the team's sandboxes", "delete sandboxes", "run a command"):
        assert text in helped.stdout
    assert "do not ask before --all" in cli("sandbox", "rm", "--help").stdout
    wait_all_deleted(tenant)
