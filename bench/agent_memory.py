"""Private memory of zygote-forked agents (issue 20): where an idle sandbox's pages are.

    sudo .venv/bin/python -m bench.agent_memory [N] [--zygote-python PATH]

Starts N `host` sandboxes on a private local-backend instance (no control plane: the
backend as the tests use it), reads each agent's USS (private clean + dirty pages,
/proc/PID/smaps_rollup) once it answers /health and again after one exec, and prints
the mappings that hold them (smaps). USS is what the machine gets back when the agent
exits: the zygote's pages the agent (or the handler it was forked from) wrote to. The
first agent after the zygote starts is ~0.3 MiB above the rest. Removes everything.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import uuid
from collections import Counter
from dataclasses import replace
from pathlib import Path

from apps.sandboxes.backends.local import LocalBackend, wait_healthy
from apps.sandboxes.backends.tests.conftest import make_config, new_spec


def uss_kib(pid: int) -> int:
    lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    return sum(
        int(line.split()[1])
        for line in lines
        if line.startswith(("Private_Clean:", "Private_Dirty:"))
    )


def private_by_mapping(pid: int) -> Counter[str]:
    sizes: Counter[str] = Counter()
    name = "?"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and ":" not in fields[0]:
            name = fields[5] if len(fields) > 5 else "[anon]"
        elif fields and fields[0] in ("Private_Dirty:", "Private_Clean:"):
            sizes[name] += int(fields[1])
    return sizes


def one_exec(host: str, port: int, token: str) -> None:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    body = {"operation_id": uuid.uuid4().hex, "command": "true", "timeout": 10}
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    conn.request("POST", "/exec", json.dumps(body), headers)
    response = conn.getresponse()
    response.read()
    conn.close()
    if response.status != 200:
        raise RuntimeError(f"exec answered {response.status}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", type=int, nargs="?", default=5)
    parser.add_argument(
        "--zygote-python", help="the zygote's interpreter (HEDGEROW_LOCAL_ZYGOTE_PYTHON)"
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="agent-memory-"))
    os.chmod(tmp, 0o755)
    config = replace(
        make_config(tmp, f"am{os.getpid()}", "netns"), zygote_python=args.zygote_python
    )
    backend = LocalBackend(config)
    made: list[str] = []
    healthy: list[int] = []
    after: list[int] = []
    mappings: Counter[str] = Counter()
    try:
        for _ in range(args.n):
            spec = new_spec()
            made.append(spec.sandbox_id)
            endpoint = backend.provision(spec)
            wait_healthy(endpoint, spec.agent_token, timeout=30)
            meta = json.loads((backend._dir(spec.sandbox_id) / "meta.json").read_text())
            pid = int(meta["agent_pid"])
            healthy.append(uss_kib(pid))
            one_exec(endpoint.host, endpoint.port, spec.agent_token)
            after.append(uss_kib(pid))
            mappings.update(private_by_mapping(pid))
        print(f"{args.n} agents, USS KiB after /health: {healthy}")
        print(f"{args.n} agents, USS KiB after one exec: {after}")
        print(
            f"mean after one exec: {sum(after) / len(after):.0f} KiB; without the first: ", end=""
        )
        rest = after[1:] or after
        print(f"{sum(rest) / len(rest):.0f} KiB")
        for where, kib in mappings.most_common(5):
            print(f"  {kib / args.n:7.0f} KiB {where}")
    finally:
        for sandbox_id in made:
            backend.destroy(sandbox_id)
        backend.teardown_instance()
    return 0


if __name__ == "__main__":
    sys.exit(main())
