"""The CLI follows command-line conventions (issue 26 defects 2, 4 and 8): options go
where users put them, secrets are never echoed, exec says why it failed, listings have
headers and sane defaults, destructive commands ask first."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import threading
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


def _read_until(fd: int, needle: bytes, seen: bytearray, timeout: float = 60.0) -> None:
    """Reads the terminal's output into ``seen`` until ``needle`` is in it (or EOF)."""
    while needle not in seen:
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, f"nothing more on the terminal; waiting for {needle!r}, saw {bytes(seen)!r}"
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            chunk = b""
        if not chunk:
            return
        seen += chunk


def test_login_prompts_for_the_key_on_a_terminal_without_echo(live, make_tenant, tmp_path):
    # Defect 2: "read the key from a prompt without echo". On a real terminal (a pty
    # that is the child's controlling tty) the key typed at the prompt never shows.
    tenant, secret = make_tenant()
    config = tmp_path / "config.json"
    cli = Cli(config)
    argv = [sys.executable, "-m", "hedgerow.cli", "login", "--url", live.url]
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its stdin, stdout, stderr and /dev/tty
        try:
            os.execve(sys.executable, argv, cli.env)
        finally:
            os._exit(127)
    seen = bytearray()
    try:
        _read_until(fd, b"API key: ", seen)
        assert b"API key: " in seen, bytes(seen)
        os.write(fd, secret.encode() + b"\n")
        _read_until(fd, b"\0never", seen)  # to EOF
        _, status = os.waitpid(pid, 0)
        pid = 0
    finally:
        if pid:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, bytes(seen)
    assert secret.encode() not in seen
    assert b"logged in to" in seen
    assert json.loads(config.read_text()) == {"url": live.url, "api_key": secret}
    wait_all_deleted(tenant)


def test_exec_streams_output_while_the_command_runs(live, make_tenant, tmp_path):
    # Defect 8: "exec buffers all output until the end". The command prints a line and
    # then blocks on a FIFO; the line must reach the CLI's stdout before it ends.
    tenant, secret = make_tenant()
    cli = Cli(tmp_path / "config.json")
    assert cli("login", "--url", live.url, "--key", secret).returncode == 0
    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        script = "mkfifo /tmp/go && echo first && read x < /tmp/go && echo second"
        argv = [sys.executable, "-m", "hedgerow.cli", "sandbox", "exec", sandbox.id]
        proc = subprocess.Popen(
            [*argv, "--", "sh", "-c", script],
            env=cli.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            lines: list[str] = []
            reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()))
            reader.start()
            reader.join(timeout=60)
            assert lines == ["first\n"], proc.stderr.read() if proc.poll() is not None else ""
            assert proc.poll() is None  # the command is still blocked on the FIFO
            assert sandbox.exec(["sh", "-c", "echo go > /tmp/go"]).exit_code == 0
            rest, errors = proc.communicate(timeout=60)
            assert (proc.returncode, rest) == (0, "second\n"), errors
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    wait_all_deleted(tenant)
