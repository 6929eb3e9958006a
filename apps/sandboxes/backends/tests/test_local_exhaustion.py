"""A sandbox's exhaustion is named, its agent survives it, and a dead agent ends the
whole sandbox (issue 14, findings 7 and 8), on real sandboxes of both launches."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from apps.sandboxes.backends.local import LocalBackend, wait_healthy
from apps.sandboxes.backends.local._sys import is_alive

from .conftest import Sandbox, needs_root, new_spec

pytestmark = needs_root

LAUNCHES = ("zygote", "exec")


def until(predicate: Callable[[], Any], what: str, timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(params=LAUNCHES)
def launched(
    request: pytest.FixtureRequest, backend: LocalBackend
) -> Iterator[Callable[..., Sandbox]]:
    """Sandboxes of the session's instance, started by the zygote or by exec."""
    b = (
        backend
        if request.param == "zygote"
        else LocalBackend(
            replace(backend.config, agent_launch="exec", allow_unprotected_exec_launch=True)
        )
    )
    made: list[str] = []

    def make(**overrides: Any) -> Sandbox:
        spec = new_spec(**overrides)
        made.append(spec.sandbox_id)
        endpoint = b.provision(spec)
        wait_healthy(endpoint, spec.agent_token, timeout=20)
        sb = Sandbox(b, spec, endpoint)
        assert meta(sb)["launch"] == request.param
        return sb

    yield make
    for sid in made:
        b.destroy(sid)


def meta(sb: Sandbox) -> dict[str, Any]:
    data = sb.backend._meta(sb.id)
    assert data is not None
    return data


def post_exec(sb: Sandbox, command: str | list[str], timeout: float = 60) -> tuple[int, Any]:
    """(HTTP status, body) of one /exec; a dropped connection raises."""
    conn = http.client.HTTPConnection(sb.endpoint.host, sb.endpoint.port, timeout=120)
    try:
        body = {"operation_id": f"op-{uuid.uuid4().hex}", "command": command, "timeout": timeout}
        conn.request(
            "POST",
            "/exec",
            json.dumps(body),
            {"Authorization": f"Bearer {sb.spec.agent_token}", "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def sandbox_pids(sb: Sandbox) -> set[int]:
    """Every process in the sandbox's cgroups (sub-groups included)."""
    found: set[int] = set()
    for path in (meta(sb).get("cgroups") or {}).values():
        for procs in Path(path).rglob("cgroup.procs"):
            found |= {int(x) for x in procs.read_text().split()}
    return found


# A bounded fork bomb: forks sleepers until the kernel refuses a fork, then exits 0.
FORK_UNTIL_REFUSED = (
    "import os, time\n"
    "n = 0\n"
    "while n < 5000:\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError:\n"
    "        break\n"
    "    if pid == 0:\n"
    "        os.close(1); os.close(2); time.sleep({sleep}); os._exit(0)\n"
    "    n += 1\n"
    "print(n)\n"
)


def test_an_oom_killed_command_is_named_memory_and_the_agent_answers_the_next_exec(
    launched: Callable[..., Sandbox],
) -> None:
    sb = launched(memory_mib=64)
    status, result = post_exec(
        sb, ["python3", "-c", "b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096])"]
    )
    assert status == 200, result
    assert result["termination"]["signal"] == signal.SIGKILL
    exhausted = result["resource_exhausted"]
    assert exhausted["kind"] == "memory"
    assert exhausted["limit"] == 64 << 20
    assert exhausted["oom_kills"] >= 1
    assert sb.sh("echo alive") == (0, "alive\n", "")
    # a command that merely fails is not called exhausted
    status, plain = post_exec(sb, "exit 3")
    assert status == 200 and "resource_exhausted" not in plain


def test_a_fork_bomb_is_named_pids_and_the_agent_keeps_answering(
    launched: Callable[..., Sandbox],
) -> None:
    sb = launched(pids_limit=48)
    status, result = post_exec(sb, ["python3", "-c", FORK_UNTIL_REFUSED.format(sleep=4)])
    assert status == 200, result
    assert result["termination"]["exit_code"] == 0
    assert result["resource_exhausted"]["kind"] == "pids"
    assert result["resource_exhausted"]["limit"] == 48
    assert result["resource_exhausted"]["refused_forks"] >= 1
    # While the sleepers hold every command pid, the agent still answers, typed.
    status, refused = post_exec(sb, "echo hi")
    assert status == 200, refused
    if refused["termination"]["reason"] == "agent_error":
        assert refused["resource_exhausted"]["kind"] == "pids"
    # Once they are gone, commands run again.
    until(lambda: post_exec(sb, "echo ok")[1]["stdout"]["head"] == "ok\n", "commands to run")


def test_concurrent_execs_past_the_pids_limit_get_typed_answers_never_a_dropped_one(
    launched: Callable[..., Sandbox],
) -> None:
    sb = launched(pids_limit=16)
    answers: list[tuple[int, Any]] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            answers.append(post_exec(sb, "sleep 1"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(120)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert len(answers) == 120
    kinds = set()
    for status, body in answers:
        if status == 503:
            assert body["error"]["code"] == "resource_exhausted"
            assert body["error"]["kind"] == "pids"
            kinds.add("refused")
        else:
            assert status == 200, body
            if "resource_exhausted" in body:
                assert body["resource_exhausted"]["kind"] == "pids"
                kinds.add("not started")
            else:
                assert body["termination"] == {
                    "reason": "exited",
                    "exit_code": 0,
                    "signal": None,
                    "message": None,
                }
                kinds.add("ran")
    assert "ran" in kinds and kinds - {"ran"}  # some ran, the rest were refused typed
    assert sb.sh("echo alive") == (0, "alive\n", "")


def test_an_agent_killed_under_an_orphan_ends_the_whole_sandbox(
    launched: Callable[..., Sandbox],
) -> None:
    sb = launched()
    assert sb.sh("setsid sleep 900 </dev/null >/dev/null 2>&1 &")[0] == 0
    m = meta(sb)
    before = sandbox_pids(sb)
    assert len(before) >= 3  # init, agent, the orphan (and pause, bwrap)
    os.kill(m["agent_pid"], signal.SIGKILL)

    def gone_event() -> bool:
        return any(e.sandbox_id == sb.id and e.kind == "gone" for e in sb.backend.watch(0))

    until(gone_event, "the backend to report the sandbox gone", timeout=10)
    until(lambda: not sandbox_pids(sb), "every process of the sandbox to end", timeout=10)
    assert not any(is_alive(pid, None) for pid in before)
    assert sb.backend.endpoint(sb.id) is None


def test_deleting_a_fork_bombed_sandbox_leaves_no_process_or_cgroup(
    launched: Callable[..., Sandbox],
) -> None:
    sb = launched(pids_limit=256, memory_mib=128)
    bomb = "bomb() { bomb & bomb & }; bomb >/dev/null 2>&1 </dev/null &"
    post_exec(sb, bomb, timeout=5)
    until(lambda: len(sandbox_pids(sb)) > 200, "the bomb to fill the pids limit")
    cgroups = [Path(p) for p in (meta(sb).get("cgroups") or {}).values()]
    pids = sandbox_pids(sb)
    t0 = time.monotonic()
    sb.backend.destroy(sb.id)
    elapsed = time.monotonic() - t0
    print(f"destroy of a fork-bombed sandbox ({meta_launch(sb)}): {elapsed:.3f} s")
    assert not any(p.exists() for p in cgroups)
    assert not any(is_alive(pid, None) for pid in pids)


def meta_launch(sb: Sandbox) -> str:
    return "exec" if sb.backend.config.agent_launch == "exec" else "zygote"


def test_commands_run_in_their_own_cgroups_and_cannot_reach_the_agents_descriptors(
    launched: Callable[..., Sandbox],
) -> None:
    sb = launched()
    groups = {c: Path(p) for c, p in (meta(sb).get("cgroups") or {}).items()}
    # No descriptor of another process that leads to a cgroup file can be reopened (the
    # agent is not dumpable); then the command's own cgroups, seen from the host.
    script = (
        "for f in /proc/[0-9]*/fd/*; do case $(readlink $f 2>/dev/null) in "
        "*cgroup*) echo reachable $f;; esac; done; "
        "sleep 30 </dev/null >/dev/null 2>&1 & echo $!"
    )
    code, out, _ = sb.sh(script)
    assert code == 0 and "reachable" not in out, out
    for controller, own in (("memory", ""), ("pids", "agent")):
        commands = _procs(groups[controller] / "cmds")
        agent = _procs(groups[controller] / own)
        assert commands and meta(sb)["agent_pid"] in agent, controller
        assert not commands & agent


def _procs(group: Path) -> set[int]:
    return {int(x) for x in (group / "cgroup.procs").read_text().split()}


def test_writes_past_the_disk_quota_are_named_disk_and_a_plain_failure_is_not(
    launched: Callable[..., Sandbox],
) -> None:
    """``dd`` past a 32 MiB ``disk_mib``: the write gets EDQUOT, dd fails, and the agent
    reads the sandbox's quota group (usage at the limit), not the exit code."""
    sb = launched(disk_mib=32)
    # a command that fails while the disk has room is not exhausted
    status, plain = post_exec(sb, "exit 2")
    assert status == 200 and "resource_exhausted" not in plain

    status, result = post_exec(sb, "dd if=/dev/zero of=/workspace/fill bs=1M count=100")
    assert status == 200, result
    assert result["termination"]["exit_code"] != 0
    assert "quota" in result["stderr"]["head"].lower() or "space" in result["stderr"]["head"]
    exhausted = result["resource_exhausted"]
    assert exhausted["kind"] == "disk"
    assert exhausted["limit"] == 32 << 20
    assert 31 << 20 <= exhausted["used"] <= 32 << 20
    # a command that succeeds on a full disk is not named (it wrote nothing)
    status, ok = post_exec(sb, "echo fine")
    assert status == 200 and ok["stdout"]["head"] == "fine\n"
    assert "resource_exhausted" not in ok
    # freed, the same failure is an ordinary one again
    status, freed = post_exec(sb, "rm /workspace/fill; exit 1")
    assert status == 200 and "resource_exhausted" not in freed


def test_a_command_ended_by_its_output_cap_is_named_output(
    launched: Callable[..., Sandbox],
) -> None:
    sb = launched()
    conn = http.client.HTTPConnection(sb.endpoint.host, sb.endpoint.port, timeout=120)
    body = {
        "operation_id": f"op-{uuid.uuid4().hex}",
        "command": "yes",
        "output_limit": 100_000,
        "output_window": 1000,
        "timeout": 30,
    }
    conn.request(
        "POST",
        "/exec",
        json.dumps(body),
        {"Authorization": f"Bearer {sb.spec.agent_token}", "Content-Type": "application/json"},
    )
    result = json.loads(conn.getresponse().read())
    conn.close()
    assert result["termination"]["reason"] == "output_limit"
    assert result["resource_exhausted"]["kind"] == "output"
    assert result["resource_exhausted"]["limit"] == 100_000
    assert "output_limit" in result["resource_exhausted"]["message"]
