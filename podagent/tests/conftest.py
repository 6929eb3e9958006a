"""Fixtures: the real agent on 127.0.0.1 with a free port.

By default a subprocess (``python -m podagent``); with ``PODAGENT_TEST_LAUNCH=zygote``
a fork of a real zygote (zygote/daemon.py, plain spawn: no sandbox), with the
late-import guard on, so every test also proves the zygote preloads what it needs.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-token-0123456789"
LAUNCH = os.environ.get("PODAGENT_TEST_LAUNCH", "exec")
_ids = itertools.count()
_zygote: Dict[str, Any] = {}


def _zygote_call(request: Dict[str, Any]) -> Dict[str, Any]:
    if not _zygote:
        sock_dir = Path(tempfile.mkdtemp(prefix="podagent-zygote-"))
        _zygote["socket"] = str(sock_dir / "zygote.sock")
        subprocess.run(
            [sys.executable, "-E", "-s", "-S", "-m", "zygote", "--socket", _zygote["socket"]],
            cwd=str(REPO), check=True, timeout=60, env={"PATH": os.defpath},
        )  # fmt: skip
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(_zygote["socket"])
        s.sendall(json.dumps(request).encode() + b"\n")
        answer: Dict[str, Any] = json.loads(s.makefile("rb").readline())
    assert answer["ok"], answer
    return answer


class _Forked:
    """The bits of Popen the fixtures use, for an agent forked by the zygote."""

    def __init__(self, pid: int, stderr_path: Path) -> None:
        self.pid = pid
        self.stderr_path = stderr_path
        self.stderr = None

    def poll(self) -> Optional[int]:
        return None if pid_alive(self.pid) else -9

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        assert wait_gone([self.pid])
        return -9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Agent:
    def __init__(
        self, tmp: Path, extra_env: Optional[Dict[str, str]] = None, pass_fds: Tuple[int, ...] = ()
    ) -> None:
        self.tmp = tmp
        self.workdir = tmp / "work"
        self.workdir.mkdir()
        self.token_file = tmp / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.log_file = tmp / "agent.log"
        self.port = free_port()
        # Started as the local backend starts it: in its workdir, the package found
        # through PYTHONPATH, which the agent then hides from commands.
        env = dict(os.environ)
        env["HEDGEROW_AGENT_ENV_RESTORE"] = json.dumps({"PYTHONPATH": env.get("PYTHONPATH")})
        env["PYTHONPATH"] = str(REPO)
        env.update(extra_env or {})
        argv = [
            "--listen", f"127.0.0.1:{self.port}", "--token-file", str(self.token_file),
            "--workdir", str(self.workdir), "--log-file", str(self.log_file),
        ]  # fmt: skip
        self.proc: Any
        if LAUNCH == "zygote":
            stderr_path = tmp / "agent.stderr"
            answer = _zygote_call({
                "op": "spawn_plain", "log": str(stderr_path), "workdir": str(self.workdir),
                "env": env, "agent_args": argv, "umask": 0o022,
            })  # fmt: skip
            self.proc = _Forked(int(answer["agent_pid"]), stderr_path)
            self._wait_listening(lambda: stderr_path.read_text())
            return
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "podagent", *argv],
            cwd=str(self.workdir), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            pass_fds=pass_fds,
        )  # fmt: skip
        self._wait_listening(lambda: self.proc.stderr.read().decode() if self.proc.stderr else "")

    def _wait_listening(self, stderr: Any) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(stderr()) from None
                time.sleep(0.02)
        raise RuntimeError("agent did not start")

    def late_imports(self) -> List[str]:
        """Lines the zygote's late-import guard wrote (zygote launch only)."""
        path = getattr(self.proc, "stderr_path", None)
        if path is None or not path.exists():
            return []
        return [line for line in path.read_text().splitlines() if "late import" in line]

    def client(self, token: Optional[str] = TOKEN) -> "Client":
        return Client(self.port, token)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        assert self.late_imports() == [], "the zygote must preload every module the agent uses"

    def alive(self) -> bool:
        if self.proc.poll() is not None:
            return False
        status, body = self.client().get("/health")
        return status == 200 and body["status"] == "ok"

    def rss_hwm_kb(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM")


class Client:
    def __init__(self, port: int, token: Optional[str]) -> None:
        self.port = port
        self.token = token
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def headers(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        h = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        h.update(extra or {})
        return h

    def request(
        self, method: str, path: str, body: Any = None, headers: Optional[Dict[str, str]] = None
    ) -> Tuple[int, Any, http.client.HTTPResponse]:
        if body is not None and not isinstance(body, (bytes, str)) and not hasattr(body, "read"):
            body = json.dumps(body)
        self.conn.request(method, path, body=body, headers=self.headers(headers))
        resp = self.conn.getresponse()
        raw = resp.read()
        ctype = resp.getheader("Content-Type", "")
        data: Any = json.loads(raw) if ctype.startswith("application/json") else raw
        return resp.status, data, resp

    def get(self, path: str) -> Tuple[int, Any]:
        status, data, _ = self.request("GET", path)
        return status, data

    def exec(self, command: Any, **fields: Any) -> Dict[str, Any]:
        body = {"operation_id": fields.pop("operation_id", None) or new_op_id(), "command": command}
        body.update(fields)
        status, data, _ = self.request("POST", "/exec", body)
        assert status == 200, data
        return dict(data)

    def stream(self, body: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
        self.conn.request("POST", "/exec", body=json.dumps(body), headers=self.headers())
        resp = self.conn.getresponse()
        assert resp.status == 200
        assert resp.getheader("Content-Type") == "application/x-ndjson"
        while True:
            line = resp.readline()
            if not line:
                return
            yield json.loads(line)

    def close(self) -> None:
        self.conn.close()


def new_op_id() -> str:
    return f"op-{os.getpid()}-{next(_ids)}-{time.monotonic_ns()}"


def out(result: Dict[str, Any], stream: str = "stdout") -> str:
    s = result[stream]
    assert s["encoding"] == "utf-8"
    return str(s["head"]) + str(s["tail"])


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_gone(pids: List[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="session", autouse=True)
def _stop_zygote() -> Iterator[None]:
    yield
    if _zygote:
        with contextlib.suppress(OSError, AssertionError, ValueError):
            _zygote_call({"op": "shutdown"})


@pytest.fixture(scope="session")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    a = Agent(tmp_path_factory.mktemp("agent"), {"HEDGEROW_AGENT_TOKEN": "leaked-secret"})
    yield a
    a.stop()


@pytest.fixture
def client(agent: Agent) -> Iterator[Client]:
    c = agent.client()
    yield c
    c.close()
