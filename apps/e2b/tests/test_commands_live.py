"""envd's process service through the real e2b SDK: each command an operation row."""

from __future__ import annotations

import threading
import time

import pytest
from e2b import (
    CommandExitException,
    CommandResult,
    NotFoundException,
    Sandbox,
    SandboxException,
    TimeoutException,
)

from apps.e2b.tests.live import opts, wait_all_deleted
from apps.sandboxes.models import Operation

pytestmark = pytest.mark.timeout(240)


def test_it_runs_a_command_with_its_result_fields_and_records_the_operation(live, make_tenant):
    tenant, secret = make_tenant()
    sbx = Sandbox.create(envs={"FROM_SANDBOX": "yes", "GREETING": "hi"}, **opts(live, secret))
    result = sbx.commands.run("echo hi; echo oops >&2")
    assert (result.stdout, result.stderr, result.exit_code, result.error) == (
        "hi\n",
        "oops\n",
        0,
        None,
    )
    op = Operation.objects.get(sandbox__external_id=sbx.sandbox_id)
    assert op.operation_id.startswith("e2b-") and op.termination == "exited"
    assert op.exit_code == 0 and op.request["command"] == "echo hi; echo oops >&2"
    assert op.request["login_shell"] is True

    # the sandbox's envVars reach every command; a command's own envs win
    env = sbx.commands.run(
        "echo $GREETING $FROM_SANDBOX from $(pwd)", envs={"GREETING": "hello"}, cwd="/tmp"
    )
    assert env.stdout == "hello yes from /tmp\n"

    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo partial; exit 7")
    assert failed.value.exit_code == 7 and failed.value.stdout == "partial\n"
    assert Operation.objects.filter(sandbox__external_id=sbx.sandbox_id).count() == 3
    sbx.kill()
    wait_all_deleted(tenant)


def test_it_streams_output_to_on_stdout_while_a_slow_command_runs(live, make_tenant):
    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    seen: list[tuple[str, float]] = []
    release = "/tmp/e2b-release"
    done = threading.Event()

    def run() -> None:
        # The command waits for a file the test writes only after the first line
        # arrived: the callback must get output while the command still runs.
        sbx.commands.run(
            f"echo first; while [ ! -e {release} ]; do sleep 0.05; done; echo second",
            on_stdout=lambda line: seen.append((line, time.monotonic())),
            timeout=60,
        )
        done.set()

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [line for line, _ in seen] == ["first\n"]
    assert not done.is_set()
    # the release goes through a second command, while the first one streams
    sbx.commands.run(f"touch {release}")
    worker.join(30)
    assert done.is_set()
    assert [line for line, _ in seen] == ["first\n", "second\n"]
    sbx.kill()
    wait_all_deleted(tenant)


def test_it_times_out_a_command_with_the_sdks_timeout_error(live, make_tenant):
    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    op = Operation.objects.get(sandbox__external_id=sbx.sandbox_id)
    deadline = time.monotonic() + 30
    while op.status == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
        op.refresh_from_db()
    assert op.termination == "timeout" and op.request["timeout"] == 1.0
    sbx.kill()
    wait_all_deleted(tenant)


def test_it_runs_in_the_background_lists_reconnects_waits_and_kills(live, make_tenant):
    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    gate = "/tmp/e2b-gate"
    handle = sbx.commands.run(
        f"echo started; while [ ! -e {gate} ]; do sleep 0.05; done; echo finished",
        background=True,
    )
    assert handle.pid > 0
    listed = {p.pid: p for p in sbx.commands.list()}
    assert handle.pid in listed and gate in " ".join(listed[handle.pid].args)
    handle.disconnect()

    again = sbx.commands.connect(handle.pid)
    sbx.commands.run(f"touch {gate}")
    result = again.wait()
    # a reconnect replays the command from its start (docs/e2b.md)
    assert (result.exit_code, result.stdout) == (0, "started\nfinished\n")
    assert handle.pid not in {p.pid for p in sbx.commands.list()}

    doomed = sbx.commands.run("sleep 300", background=True)
    assert sbx.commands.kill(doomed.pid) is True
    with pytest.raises(CommandExitException) as killed:
        doomed.wait()
    assert killed.value.exit_code == -1
    op = Operation.objects.get(sandbox__external_id=sbx.sandbox_id, request__command="sleep 300")
    assert op.termination == "cancelled"
    assert sbx.commands.kill(doomed.pid) is False  # already ended
    assert sbx.commands.kill(999999) is False  # never existed
    sbx.kill()
    wait_all_deleted(tenant)


def test_stream_input_reaches_the_command_chunk_by_chunk(live, make_tenant):
    """``commands.stream_input`` is a client stream: each chunk reaches the command
    while the stream is still open, not once the SDK has sent the whole of it."""
    from e2b import FileNotFoundException

    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    other = Sandbox.connect(sbx.sandbox_id, **opts(live, secret))  # its own connections
    handle = sbx.commands.run("cat > /workspace/in.txt", background=True, stdin=True)

    def arrived(text: str) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                if other.files.read("/workspace/in.txt") == text:
                    return
            except FileNotFoundException:
                pass  # the shell has not opened it yet
            assert time.monotonic() < deadline, f"{text!r} did not reach the command"
            time.sleep(0.05)

    def chunks():
        yield "first\n"
        arrived("first\n")  # the stream is still open here
        yield b"second\n"
        arrived("first\nsecond\n")
        yield "third\n"

    sbx.commands.stream_input(handle.pid, chunks())
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().exit_code == 0
    assert other.files.read("/workspace/in.txt") == "first\nsecond\nthird\n"
    # The command has ended: a stream to it is envd's not found, with nothing sent.
    with pytest.raises(NotFoundException):
        sbx.commands.stream_input(handle.pid, ["late\n"])
    plain = sbx.commands.run("sleep 30", background=True)
    with pytest.raises(SandboxException, match="stdin"):
        sbx.commands.stream_input(plain.pid, ["x"])
    assert sbx.commands.kill(plain.pid) is True
    sbx.kill()
    wait_all_deleted(tenant)


def test_it_sends_stdin_to_a_running_command_and_closes_it(live, make_tenant):
    tenant, secret = make_tenant()
    sbx = Sandbox.create(**opts(live, secret))
    handle = sbx.commands.run(
        'while read -r l; do echo "got:$l"; done; echo eof', background=True, stdin=True
    )
    sbx.commands.send_stdin(handle.pid, "one\ntw")
    sbx.commands.send_stdin(handle.pid, b"o\n")
    sbx.commands.stream_input(handle.pid, ["thr", b"ee\n", "four\n"])  # a client stream
    sbx.commands.close_stdin(handle.pid)
    result = handle.wait()
    assert (result.exit_code, result.stdout) == (
        0,
        "got:one\ngot:two\ngot:three\ngot:four\neof\n",
    )
    op = Operation.objects.get(sandbox__external_id=sbx.sandbox_id, request__stdin_open=True)
    assert op.termination == "exited"
    # The process has ended: envd's not found.
    with pytest.raises(NotFoundException):
        sbx.commands.send_stdin(handle.pid, "late\n")

    # Without stdin=True the command's stdin is not open: a typed error, nothing sent.
    plain = sbx.commands.run("sleep 30", background=True)
    with pytest.raises(SandboxException, match="stdin"):
        sbx.commands.send_stdin(plain.pid, "x")
    assert sbx.commands.kill(plain.pid) is True

    # A foreground run reads what another thread sends, until EOF.
    done: list[CommandResult] = []
    runner = threading.Thread(
        target=lambda: done.append(sbx.commands.run("wc -c", stdin=True, timeout=60))
    )
    runner.start()
    deadline = time.monotonic() + 30
    while not [p for p in sbx.commands.list() if "wc -c" in " ".join(p.args)]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pid = next(p.pid for p in sbx.commands.list() if "wc -c" in " ".join(p.args))
    sbx.commands.send_stdin(pid, "x" * 5000)
    sbx.commands.close_stdin(pid)
    runner.join(60)
    assert done and done[0].stdout.strip() == "5000"
    sbx.kill()
    wait_all_deleted(tenant)


def test_commands_take_the_envd_fast_path_with_the_same_answers(live, make_tenant):
    """``process.Process/Start`` answered on the event loop (apps/e2b/fastpath.py): the
    same results, streaming, env, timeouts, reconnects and records as the regular
    view. The fast path's access line names the operation it started (the regular
    view's does not)."""
    tenant, secret = make_tenant()

    def fast_starts() -> int:
        lines = live.web.log_path.read_text().splitlines()
        return sum(
            '"path": "/e2b/envd/process.Process/Start"' in line and '"operation_id": "e2b-' in line
            for line in lines
        )

    before = fast_starts()
    sbx = Sandbox.create(envs={"GREETING": "hi"}, **opts(live, secret))
    result = sbx.commands.run("echo $GREETING; echo err >&2")
    assert (result.stdout, result.stderr, result.exit_code) == ("hi\n", "err\n", 0)
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo out; exit 7")
    assert (failed.value.exit_code, failed.value.stdout) == (7, "out\n")
    seen: list[tuple[float, str]] = []
    sbx.commands.run(
        "echo one; sleep 1; echo two", on_stdout=lambda s: seen.append((time.monotonic(), s))
    )
    assert "".join(s for _, s in seen) == "one\ntwo\n"
    assert seen[-1][0] - seen[0][0] >= 0.5  # "one" arrived while the command still ran
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 10", timeout=1)
    handle = sbx.commands.run("echo started; sleep 300", background=True)
    assert handle.pid in {p.pid for p in sbx.commands.list()}
    handle.disconnect()
    again = sbx.commands.connect(handle.pid)
    assert sbx.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException):
        again.wait()
    assert fast_starts() - before == 5
    ops = Operation.objects.filter(sandbox__external_id=sbx.sandbox_id).order_by("created_at")
    assert [(o.termination, o.exit_code) for o in ops] == [
        ("exited", 0),
        ("exited", 7),
        ("exited", 0),
        ("timeout", None),
        ("cancelled", None),
    ]
    assert all(o.operation_id.startswith("e2b-") and o.generation == 1 for o in ops)
    assert ops[0].request["env"] == {"GREETING": "[redacted]"}  # the value is sealed at rest
    assert ops[0].request["env_sealed"]  # the values live only in the encrypted token
    sbx.kill()
    wait_all_deleted(tenant)
