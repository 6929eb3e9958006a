from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import time
from pathlib import Path

from .conftest import Agent, Client, new_op_id, out, pid_alive, wait_gone


def test_it_requires_a_token(agent: Agent) -> None:
    for token in (None, "wrong"):
        c = agent.client(token)
        status, body, _ = c.request("POST", "/exec", {"operation_id": "x", "command": "true"})
        assert status == 401
        assert body["error"]["code"] == "unauthorized"
        c.close()


def test_it_answers_health_without_a_token(agent: Agent) -> None:
    status, body = agent.client(None).get("/health")
    assert status == 200
    assert body["status"] == "ok" and body["pid"] == agent.proc.pid


def test_it_reports_exit_code_and_output(client: Client) -> None:
    r = client.exec("echo hi; echo oops >&2; exit 3")
    assert r["termination"] == {"reason": "exited", "exit_code": 3, "signal": None, "message": None}
    assert out(r) == "hi\n" and out(r, "stderr") == "oops\n"
    assert r["stdout"]["sha256"] == hashlib.sha256(b"hi\n").hexdigest()
    assert r["stdout"]["total_bytes"] == 3 and not r["stdout"]["truncated"]
    assert r["replayed"] is False and r["children_remained"] is False
    usage = r["usage"]
    assert usage["ended_at"] >= usage["started_at"] > 0 and usage["wall_s"] >= 0
    assert usage["max_rss_kb"] > 0


def test_it_reports_exit_124_as_exited_not_timeout(client: Client) -> None:
    r = client.exec("exit 124", timeout=30)
    assert r["termination"]["reason"] == "exited"
    assert r["termination"]["exit_code"] == 124


def test_it_reports_a_signal(client: Client) -> None:
    r = client.exec("kill -9 $$")
    assert r["termination"]["reason"] == "signaled"
    assert r["termination"]["signal"] == 9 and r["termination"]["exit_code"] is None


def test_it_times_out_and_kills_the_whole_group(client: Client, tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    r = client.exec(f"sleep 100 & echo $! > {pidfile}; echo $$ >> {pidfile}; sleep 100", timeout=1)
    assert r["termination"]["reason"] == "timeout"
    assert r["termination"]["signal"] == 15
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 2
    assert wait_gone(pids), [p for p in pids if pid_alive(p)]
    assert out(client.exec("echo still-works")) == "still-works\n"


def test_it_escalates_to_sigkill_after_the_grace(client: Client) -> None:
    r = client.exec("trap '' TERM; sleep 100", timeout=0.5, kill_grace=0.5)
    assert r["termination"]["reason"] == "timeout"
    assert r["termination"]["signal"] == 9


def test_it_bounds_one_gib_of_output(agent: Agent, client: Client) -> None:
    gib = 1 << 30
    expected = hashlib.sha256()
    zeros = bytes(1 << 20)
    for _ in range(1024):
        expected.update(zeros)
    r = client.exec(f"head -c {gib} /dev/zero", output_window=65536, timeout=300)
    s = r["stdout"]
    assert r["termination"]["reason"] == "exited" and r["termination"]["exit_code"] == 0
    assert s["total_bytes"] == gib and s["truncated"] is True
    assert s["sha256"] == expected.hexdigest()
    assert s["encoding"] == "base64"  # NUL bytes: never a utf-8 record (jsonb refuses U+0000)
    assert base64.b64decode(s["head"]) == base64.b64decode(s["tail"]) == bytes(32768)
    assert agent.rss_hwm_kb() < 100 * 1024


def test_it_kills_a_command_over_its_output_limit(client: Client) -> None:
    r = client.exec("yes", output_limit=100000, output_window=1000, timeout=30)
    assert r["termination"]["reason"] == "output_limit"
    assert r["stdout"]["total_bytes"] > 100000 and r["stdout"]["truncated"]


def test_it_encodes_binary_output_as_base64(client: Client) -> None:
    r = client.exec("printf '\\377\\376ok'")
    assert r["stdout"]["encoding"] == "base64"
    assert base64.b64decode(r["stdout"]["head"]) == b"\xff\xfeok"


def test_it_encodes_output_with_a_nul_byte_as_base64(client: Client) -> None:
    # Valid UTF-8, but the control plane's jsonb cannot hold U+0000: base64, bytes exact.
    r = client.exec("printf 'a\\000b'; printf 'e\\000' >&2")
    assert r["termination"]["reason"] == "exited" and r["termination"]["exit_code"] == 0
    assert (r["stdout"]["encoding"], r["stderr"]["encoding"]) == ("base64", "base64")
    assert base64.b64decode(r["stdout"]["head"]) == b"a\x00b"
    assert base64.b64decode(r["stderr"]["head"]) == b"e\x00"


def test_it_does_not_wait_for_background_children(client: Client, tmp_path: Path) -> None:
    pidfile = tmp_path / "bg"
    t0 = time.monotonic()
    r = client.exec(f"sleep 1000 & echo $! > {pidfile}; echo done")
    assert time.monotonic() - t0 < 20
    assert r["termination"]["reason"] == "exited" and out(r) == "done\n"
    assert r["children_remained"] is True
    pid = int(pidfile.read_text())
    assert pid_alive(pid), "background children are left alone when the command exited"
    os.kill(pid, 9)


def test_it_hides_agent_variables_from_commands(client: Client) -> None:
    r = client.exec("env")
    env = out(r)
    assert "leaked-secret" not in env
    assert "HEDGEROW_" not in env
    assert "PATH=" in env


def test_it_applies_request_env(client: Client) -> None:
    r = client.exec('printf %s "$GREETING"', env={"GREETING": "hello world"})
    assert out(r) == "hello world"


def test_it_restores_variables_the_launcher_changed(tmp_path: Path) -> None:
    restore = json.dumps({"PYTHONHOME_TEST": None, "LD_TEST_PATH": "/orig/value"})
    agent = Agent(tmp_path, {
        "HEDGEROW_AGENT_ENV_RESTORE": restore, "PYTHONHOME_TEST": "/bundled",
        "LD_TEST_PATH": "/bundled/lib", "HEDGEROW_OTHER": "x",
    })  # fmt: skip
    try:
        c = agent.client()
        env = out(c.exec("env"))
        assert "LD_TEST_PATH=/orig/value\n" in env
        assert "PYTHONHOME_TEST" not in env
        assert "HEDGEROW_" not in env
        c.close()
    finally:
        agent.stop()


def test_it_feeds_stdin(client: Client) -> None:
    data = b"line1\nline2\n" * 20000
    r = client.exec("wc -l; cat >/dev/null", stdin=base64.b64encode(data).decode())
    assert out(r).strip() == "40000"


def test_it_runs_argv_without_a_shell(client: Client) -> None:
    r = client.exec(["printf", "%s|", "a b", "$HOME", ";true"])
    assert out(r) == "a b|$HOME|;true|"


def test_it_reports_a_missing_executable_as_agent_error(client: Client) -> None:
    r = client.exec(["/no/such/binary"])
    assert r["termination"]["reason"] == "agent_error"
    assert "no/such/binary" in r["termination"]["message"]


def test_it_runs_in_the_workdir_or_the_given_cwd(
    agent: Agent, client: Client, tmp_path: Path
) -> None:
    assert out(client.exec("pwd")).strip() == str(agent.workdir)
    assert out(client.exec("pwd", cwd=str(tmp_path))).strip() == str(tmp_path)


def test_it_rejects_a_missing_cwd(client: Client) -> None:
    status, body, _ = client.request(
        "POST", "/exec", {"operation_id": new_op_id(), "command": "pwd", "cwd": "/no/such/dir"}
    )
    assert status == 400
    assert body["error"]["code"] == "cwd_not_found"


def test_it_uses_a_login_shell_when_asked(client: Client) -> None:
    assert out(client.exec("shopt -q login_shell && echo login || echo plain")) == "plain\n"
    r = client.exec("shopt -q login_shell && echo login || echo plain", login_shell=True)
    assert out(r) == "login\n"


def test_it_validates_the_request(client: Client) -> None:
    bad = [
        {"command": "true"},
        {"operation_id": "has space", "command": "true"},
        {"operation_id": new_op_id(), "command": ""},
        {"operation_id": new_op_id(), "command": [1]},
        {"operation_id": new_op_id(), "command": "true", "env": {"A": 1}},
        {"operation_id": new_op_id(), "command": "true", "stdin": "!!notbase64"},
        {"operation_id": new_op_id(), "command": "true", "timeout": "soon"},
    ]
    for body in bad:
        status, data, _ = client.request("POST", "/exec", body)
        assert status == 400, body
        assert data["error"]["code"] == "bad_request"


def test_it_truncates_to_head_and_tail_windows(client: Client) -> None:
    r = client.exec("seq 1 10000", output_window=20)
    s = r["stdout"]
    assert s["truncated"] is True
    assert s["head"] == "1\n2\n3\n4\n5\n"
    assert s["tail"] == "\n9998\n9999\n10000\n"[-10:]
    assert re.fullmatch(r"[0-9a-f]{64}", s["sha256"])


def test_it_starts_commands_alike_in_the_workdir_and_elsewhere(tmp_path: Path) -> None:
    # The workdir (the agent's own cwd) takes the posix_spawn path, another cwd Popen's;
    # a command must not see a difference: only fds 0-2 (not one the agent inherited),
    # SIGPIPE at its default, the leader of its own session.
    r_fd, w_fd = os.pipe()
    os.set_inheritable(w_fd, True)
    agent = Agent(tmp_path, pass_fds=(w_fd,))
    os.close(w_fd)
    other = tmp_path / "elsewhere"
    other.mkdir()
    script = (
        # (ls writes to a file: a pipe or $(...) would be one more fd in the shell)
        "ls /proc/$$/fd >.fds; tr '\\n' ' ' <.fds; echo; yes | head -1 >/dev/null; "
        "echo ${PIPESTATUS[0]}; "
        "cut -d' ' -f6 /proc/$$/stat; echo $$"
    )
    try:
        c = agent.client()
        for cwd in (None, str(other)):
            fields = {"cwd": cwd} if cwd else {}
            r = c.exec(script, **fields)
            fds, pipestatus, sid, pid = out(r).splitlines()
            assert fds.split() == ["0", "1", "2"], (cwd, fds)
            assert pipestatus == "141", cwd  # 128 + SIGPIPE: yes was killed, not ignoring it
            assert sid.strip() == pid, cwd
            assert out(r, "stderr") == ""
        c.close()
    finally:
        agent.stop()
        os.close(r_fd)
