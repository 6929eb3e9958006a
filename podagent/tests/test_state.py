"""``GET /state``: listening ports, processes and environment for a snapshot's
fingerprint (podagent/state.py). The test agent runs on the host (no namespaces), so
what it sees is the host's: the tests look for what they themselves started."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from podagent.state import listening_ports, processes

from .conftest import Agent, Client


def test_it_requires_a_token(agent: Agent) -> None:
    status, body = agent.client(None).get("/state")
    assert status == 401 and body["error"]["code"] == "unauthorized"


def test_it_lists_a_listening_port_a_process_and_the_commands_environment(
    agent: Agent, client: Client
) -> None:
    marker = f"hedgerow-state-{agent.port}"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        child = subprocess.Popen(  # an argv the process list must show
            [sys.executable, "-c", "import sys, time; time.sleep(60)", marker]
        )
        try:
            status, state = client.get("/state")
        finally:
            child.kill()
            child.wait()
    assert status == 200
    assert {"proto": "tcp", "address": "loopback", "port": port} in state["ports"]
    # the agent's own port is not the sandbox's
    assert all(p["port"] != agent.port or p["proto"] != "tcp" for p in state["ports"])
    assert [sys.executable, "-c", "import sys, time; time.sleep(60)", marker] in state["processes"]
    assert state["processes"] == sorted(state["processes"])
    # the environment commands get: no agent bookkeeping (the token), PYTHONPATH restored
    env = state["env"]
    assert not [k for k in env if k.startswith("HEDGEROW_")]
    echoed = client.exec("echo $PATH")["stdout"]["head"]
    assert env["PATH"] + "\n" == echoed


def _net(rows: list[str]) -> str:
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
    return head + "".join(f"   0: {row} 00000000 00:00000000 00000000  0\n" for row in rows)


def test_it_reduces_addresses_to_their_kind_and_keeps_only_listening_sockets(
    tmp_path: Path,
) -> None:
    net = tmp_path / "net"
    net.mkdir()
    (net / "tcp").write_text(
        _net(
            [
                "00000000:1538 00000000:0000 0A",  # 0.0.0.0:5432 listening
                "0100007F:1F90 00000000:0000 0A",  # 127.0.0.1:8080 listening
                "0A00050A:0050 00000000:0000 0A",  # 10.5.0.10:80: the sandbox's own address
                "0100007F:1F91 0100007F:C350 01",  # an established connection: not a port
                "0100007F:C350 00000000:0000 0A",  # the agent's own port (50000)
            ]
        )
    )
    (net / "tcp6").write_text(
        _net(
            [
                "00000000000000000000000000000000:1538 "
                "00000000000000000000000000000000:0000 0A",  # [::]:5432, the same port
                "00000000000000000000000001000000:0016 "
                "00000000000000000000000000000000:0000 0A",  # [::1]:22
            ]
        )
    )
    (net / "udp").write_text(_net(["00000000:0035 00000000:0000 07"]))  # *:53
    assert listening_ports(50000, proc=str(tmp_path)) == [
        {"proto": "tcp", "address": "*", "port": 5432},
        {"proto": "tcp", "address": "address", "port": 80},
        {"proto": "tcp", "address": "loopback", "port": 22},
        {"proto": "tcp", "address": "loopback", "port": 8080},
        {"proto": "udp", "address": "*", "port": 53},
    ]


def test_it_lists_processes_but_init_itself_and_kernel_threads(tmp_path: Path) -> None:
    for pid, cmdline in (
        (1, b"/pause\0"),
        (7, b"postgres\0-D\0/workspace/pg\0"),
        (9, b"sleep\x00100\x00"),
        (11, b""),  # a kernel thread or a zombie
        (42, b"python3\0-m\0podagent\0"),  # the agent (own pid)
    ):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(cmdline)
    (tmp_path / "self").mkdir()
    assert processes(42, proc=str(tmp_path)) == [
        ["postgres", "-D", "/workspace/pg"],
        ["sleep", "100"],
    ]
