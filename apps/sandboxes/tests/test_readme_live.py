"""The README's curl example, run as written against the real stack."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from apps.sandboxes.models import Sandbox, State

README = Path(__file__).resolve().parents[3] / "README.md"
pytestmark = pytest.mark.timeout(180)


def _curl_block() -> str:
    text = README.read_text()
    section = text.split("## Try it with curl", 1)[1]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, "the README lost its curl example"
    return match.group(1)


def test_it_runs_the_readme_curl_example(live, make_tenant):
    _, secret = make_tenant()
    script = _curl_block().replace("<the printed key>", secret)
    script = script.replace(
        "export HEDGEROW_URL=http://127.0.0.1:8000", f"export HEDGEROW_URL={live.url}"
    )
    env = {**os.environ, "PATH": os.environ["PATH"]}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script + '\necho "SB=$SB"'],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert '"stdout":"hello\\n"' in out.replace(" ", "")
    assert "some bytes\n" in out
    sandbox_id = out.strip().splitlines()[-1].split("=", 1)[1]
    sandbox = Sandbox.objects.get(external_id=sandbox_id)
    assert sandbox.state in (State.TERMINATING, State.DELETED)
