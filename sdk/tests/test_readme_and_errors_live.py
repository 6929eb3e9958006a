"""The README's Python quick start runs verbatim and prints what its comments say,
and user-facing failures are one line with the cause and the fix (issue 26 defect 6)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hedgerow import Client, HedgerowConnectionError

from apps.orchard.tests.live import wait_all_deleted

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]
SDK_DIR = ROOT / "sdk"


def quick_start() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Python SDK quick start") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def env_for(url: str, key: str, tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "HEDGEROW_URL": url, "HEDGEROW_API_KEY": key}
    env.update({"PYTHONPATH": str(SDK_DIR), "HEDGEROW_CONFIG": str(tmp_path / "none.json")})
    return env


def test_it_runs_the_readme_quick_start_verbatim(live, make_tenant, tmp_path):
    tenant, secret = make_tenant()
    code = quick_start()
    promised = [
        line.split("#")[-1].strip()
        for line in code.splitlines()
        if line.lstrip().startswith("print(") and "#" in line
    ]
    assert len(promised) == 4
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env_for(live.url, secret, tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == promised
    wait_all_deleted(tenant)


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hedgerow.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_it_reports_failures_in_one_line_with_the_cause_and_the_fix(live, make_tenant, tmp_path):
    tenant, secret = make_tenant()
    nowhere = "http://127.0.0.1:9"
    with pytest.raises(HedgerowConnectionError) as unreachable:
        Client(nowhere, secret, max_retries=0, cleanup=False).list()
    message = str(unreachable.value)
    assert "\n" not in message and f"cannot reach Hedgerow at {nowhere}" in message
    assert "HEDGEROW_URL" in message
    assert unreachable.value.__suppress_context__ and unreachable.value.__cause__ is None

    env = env_for(live.url, secret, tmp_path)
    down = cli({**env, "HEDGEROW_URL": nowhere}, "sandbox", "ls")
    assert down.returncode == 1
    assert down.stderr.count("\n") == 1 and "cannot reach Hedgerow" in down.stderr

    with Client(live.url, secret) as hr, hr.create_sandbox() as sandbox:
        bad_key = cli({**env, "HEDGEROW_API_KEY": "hr_bogus"}, "sandbox", "shell", sandbox.id)
        assert bad_key.returncode == 1, bad_key.stderr
        assert bad_key.stderr.count("\n") == 1 and "Traceback" not in bad_key.stderr
        assert "hedgerow login" in bad_key.stderr

        unknown = cli(env, "sandbox", "shell", "sb-0000000000000000")
        assert unknown.returncode == 1 and unknown.stderr.count("\n") == 1
        assert "sandbox ls" in unknown.stderr

        missing = cli(env, "sandbox", "cp", str(tmp_path / "nope"), f"{sandbox.id}:/workspace/x")
        assert missing.returncode == 1 and missing.stderr.count("\n") == 1
        assert "does not exist" in missing.stderr and "check the path" in missing.stderr
