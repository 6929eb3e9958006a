"""``hedgerow trajectories scan`` against the real stack: a file's secrets by kind
(nothing stored, exit 1 when any), and the stored episodes' redaction report; and
``hedgerow.content_hash`` as the episode's task hash."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hedgerow import Client, content_hash
from hedgerow.episode import Episode as SdkEpisode

pytestmark = pytest.mark.timeout(240)
SDK_DIR = Path(__file__).resolve().parents[1]


class Cli:
    """``python -m hedgerow.cli`` with its own config file (as in test_cli_live)."""

    def __init__(self, config: Path) -> None:
        self.env = {
            k: v for k, v in os.environ.items() if k not in ("HEDGEROW_URL", "HEDGEROW_API_KEY")
        }
        self.env.update({"HEDGEROW_CONFIG": str(config), "PYTHONPATH": str(SDK_DIR)})

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hedgerow.cli", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=180,
        )

    def json(self, *args: str) -> dict[str, object]:
        done = self("--json", *args)
        assert done.returncode == 0, done.stderr
        result: dict[str, object] = json.loads(done.stdout)
        return result


GITHUB = "ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"
AWS = "AKIAIOSFODNN7EXAMPLE"


def test_scan_reports_a_files_secrets_and_the_stored_ones_by_kind(live, make_tenant, tmp_path):
    from apps.trajectories.models import Episode, EpisodeSecret

    tenant, secret = make_tenant()
    cli = Cli(tmp_path / "config.json")
    assert cli("--url", live.url, "--key", secret, "login").returncode == 0

    dirty = tmp_path / "episodes.jsonl"
    dirty.write_text(
        json.dumps({"steps": [{"action": f"export GITHUB_TOKEN={GITHUB}"}]})
        + "\n"
        + json.dumps({"labels": {"aws": AWS}, "note": f"again {GITHUB}"})
        + "\n"
    )
    found = cli("--json", "trajectories", "scan", str(dirty))
    assert found.returncode == 1, found.stderr  # secrets found: refuse to publish
    report = json.loads(found.stdout)
    assert report["secrets"] == 2 and report["occurrences"] == 3
    assert report["by_kind"]["github_token"]["occurrences"] == 2
    assert GITHUB not in found.stdout and AWS not in found.stdout
    table = cli("trajectories", "scan", str(dirty))
    assert table.returncode == 1 and "github_token" in table.stdout
    assert not Episode.objects.filter(tenant=tenant).exists()  # a scan stores nothing

    clean = tmp_path / "clean.jsonl"
    clean.write_text(json.dumps({"steps": [{"action": "ls -la"}]}) + "\n")
    ok = cli("trajectories", "scan", str(clean))
    assert ok.returncode == 0 and "no secrets found" in ok.stdout

    with Client(live.url, secret) as hr:
        # the SDK's episode sends the provenance fields as given (no sandbox needed here)
        with SdkEpisode(
            hr,
            [],
            task_id="t-1",
            task_hash=content_hash({"prompt": "fix it", "tests": ["a"]}),
            policy_checkpoint="run-7/step-1200",
            harness_commit="3f2a9c1",
            verifier_commit="b71e0d4",
            sampling={"temperature": 0.7},
            attempt_id="a-3",
            labels={"k": GITHUB},
        ) as ep:
            ep.step(action="think")
        opened = ep.data
    components = opened["provenance"]["components"]
    assert (components["policy"], components["harness"], components["verifier"]) == (
        "run-7/step-1200",
        "3f2a9c1",
        "b71e0d4",
    )
    assert components["attempt"] == "a-3" and components["sampling"].startswith("sha256:")
    assert opened["provenance"]["components"]["task"] == (
        "sha256:" + hashlib.sha256(b'{"prompt":"fix it","tests":["a"]}').hexdigest()
    )
    stored = cli.json("trajectories", "scan", "--filter", "task=t-1")
    assert stored["by_kind"]["github_token"]["secrets"] == 1
    assert stored["episodes_with_secrets"] == 1
    none = cli.json("trajectories", "scan", "--filter", "task=other")
    assert none["by_kind"] == {} and none["episodes_scanned"] == 0
    assert EpisodeSecret.objects.filter(episode__tenant=tenant).count() == 1
