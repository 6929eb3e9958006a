"""The pod agent's own exec cost, without a control plane or a sandbox.

    .venv/bin/python -m bench.agent_exec [--n 500] [--cpu-n 2000] [--python /usr/bin/python3]
                                         [--agent-root DIR]

Starts `python -m podagent` on 127.0.0.1 (the interpreter the local backend runs it
with, logging JSON lines to a file as it does in a sandbox) and measures
`bash -c 'echo hi'`, interleaved, n rounds:
(a) a bare subprocess as `bench.exec_latency` runs it (stdout to /dev/null),
(a') a bare subprocess capturing stdout and stderr through pipes, as the agent does,
(b) a keep-alive POST /exec to the agent, as `bench.exec_latency` sends it (`LeanHttp`).
Then the agent's CPU per exec over cpu-n sequential execs: the agent's own threads
(/proc/<pid>/task/*/schedstat) and the children it reaped (cutime+cstime, the bash).
CPU time does not depend on the load the other engineers put on the machine; the
latency ratios are comparable only because the paths are interleaved. `--agent-root`
runs the `podagent` package found in another directory (e.g. a copy of an older
version), to compare two versions of the agent on the same machine minutes apart.
`--helper` also starts a second agent that starts every command through the exec helper
(exec_helper.c: what a zygote-started agent does since issue 22, so that commands run as
other real uids than the agent's) and interleaves (b') its execs with (b): the
helper's cost in one run, latency and CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from bench.exec_latency import COMMAND, LeanHttp, pct, summary, timed_interleaved

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-token-0123456789"


def _agent_cpu_ns(pid: int) -> int:
    """CPU time of the agent's threads in ns (schedstat: exact, where utime/stime are
    sampled at the tick and drift under load). The keep-alive connection's thread lives
    through the whole measurement."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def _children_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state): cutime/cstime, the reaped children's, are 16/17
    return int(fields[13]) + int(fields[14])


def start_agent(
    python: str, tmp: Path, root: Path = REPO, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], int]:
    (tmp / "work").mkdir()
    (tmp / "token").write_text(TOKEN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    argv = [python, "-m", "podagent", "--listen", f"127.0.0.1:{port}"]
    argv += ["--token-file", str(tmp / "token"), "--workdir", str(tmp / "work")]
    argv += ["--log-file", str(tmp / "agent.log"), *extra]
    # as the local backend starts it: in its workdir, with bwrap's --clearenv + these
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(tmp / "work")}
    env.update(LANG="C.UTF-8", PYTHONPATH=str(root))
    env["HEDGEROW_AGENT_ENV_RESTORE"] = json.dumps({"PYTHONPATH": None})
    proc = subprocess.Popen(
        argv, cwd=tmp / "work", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, port
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError("agent did not start")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=500, help="interleaved latency rounds")
    parser.add_argument("--cpu-n", type=int, default=2000, help="execs for the CPU figure")
    parser.add_argument("--python", default="/usr/bin/python3", help="runs the agent")
    parser.add_argument("--agent-root", type=Path, default=REPO, help="holds podagent/")
    parser.add_argument("--pause", action="store_true", help="wait for Enter before the CPU run")
    parser.add_argument("--helper", action="store_true", help="also (b') through the exec helper")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        proc, port = start_agent(args.python, Path(tmp), args.agent_root)
        try:
            conn = LeanHttp("127.0.0.1", port, {"Authorization": f"Bearer {TOKEN}"})

            def post(agent: LeanHttp) -> None:
                body = {"operation_id": uuid.uuid4().hex, "command": COMMAND, "timeout": 30}
                status, data = agent.post("/exec", body)
                assert status == 200 and data["termination"]["exit_code"] == 0, data

            def direct() -> None:
                post(conn)

            def bare() -> None:
                subprocess.run(["bash", "-c", COMMAND], stdout=subprocess.DEVNULL, check=True)

            def bare_piped() -> None:
                subprocess.run(["bash", "-c", COMMAND], capture_output=True, check=True)

            paths: dict[str, Callable[[], None]] = {
                "a bare subprocess": bare,
                "a' bare, stdout+stderr piped": bare_piped,
                "b direct agent": direct,
            }
            helped: tuple[subprocess.Popen[bytes], LeanHttp] | None = None
            if args.helper:
                from apps.sandboxes.backends.local.zygote import build_pause, exec_helper_path

                second = Path(tmp) / "helped"
                second.mkdir()
                build_pause(second / "bin")
                helper = str(exec_helper_path(second / "bin"))
                hproc, hport = start_agent(
                    args.python, second, args.agent_root, ("--exec-helper", helper)
                )
                stack.callback(hproc.wait)
                stack.callback(hproc.kill)
                hconn = LeanHttp("127.0.0.1", hport, {"Authorization": f"Bearer {TOKEN}"})
                helped = (hproc, hconn)
                paths["b' direct agent, through the exec helper"] = lambda: post(hconn)
            load0 = os.getloadavg()[0]
            results = {k: summary(v) for k, v in timed_interleaved(args.n, paths).items()}
            print(f"\nexec `bash -c '{COMMAND}'`, n={args.n}, agent on {args.python}, "
                  f"interleaved, load average {load0:.1f} → {os.getloadavg()[0]:.1f}")  # fmt: skip
            print("| path | p50 ms | p95 ms | p99 ms | mean ms |\n|---|---:|---:|---:|---:|")
            for name, s in results.items():
                print(f"| {name} | {s['p50']:.2f} | {s['p95']:.2f} | {s['p99']:.2f} "
                      f"| {s['mean']:.2f} |")  # fmt: skip
            a = results["a bare subprocess"]["p50"]
            a2 = results["a' bare, stdout+stderr piped"]["p50"]
            b = results["b direct agent"]["p50"]
            print(f"\nratios of p50: b/a = {b / a:.2f} (target ≤ 1.3), b/a' = {b / a2:.2f}")
            if helped is not None:
                b2 = results["b' direct agent, through the exec helper"]["p50"]
                print(f"b'/b = {b2 / b:.3f} (+{b2 - b:.3f} ms p50)")
            # the agent's own view: request parsed → response sent, from its log lines
            inside = sorted(
                float(line["ms"])
                for line in map(json.loads, (Path(tmp) / "agent.log").read_text().splitlines())
                if line.get("event") == "request" and line.get("path") == "/exec"
            )
            print(f"agent-side p50 (headers parsed → response sent): {pct(inside, 0.5):.2f} ms")

            if args.pause:
                input(f"agent pid {proc.pid}; Enter to start the CPU run ")
            agents = [("b", proc, conn)]
            if helped is not None:
                agents.append(("b'", helped[0], helped[1]))
            for name, agent, agent_conn in agents:
                _cpu_run(name, agent, agent_conn, args.cpu_n, post)
            conn.close()
        finally:
            proc.kill()
            proc.wait()
    return 0


def _cpu_run(
    name: str,
    agent: subprocess.Popen[bytes],
    conn: LeanHttp,
    n: int,
    post: Callable[[LeanHttp], None],
) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    self0, children0 = _agent_cpu_ns(agent.pid), _children_ticks(agent.pid)
    start = time.perf_counter()
    for _ in range(n):
        post(conn)
    wall = time.perf_counter() - start
    self1, children1 = _agent_cpu_ns(agent.pid), _children_ticks(agent.pid)
    print(f"({name}) agent CPU per exec over {n} execs: "
          f"agent {(self1 - self0) / 1e6 / n:.3f} ms, reaped children "
          f"{(children1 - children0) * 1e3 / hz / n:.3f} ms; "
          f"{n / wall:.0f} exec/s sequential; "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
