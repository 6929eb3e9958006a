"""A SWE-style task image for the tests, the live flow and docs/images.md: the Debian
userland (python3, pytest, git; ocibuild.userland_layer, built once per machine) with a
git repository at ``/testbed`` whose test fails until ``PATCH`` is applied.

``python -m apps.sandboxes.backends.local.images.tests.swe`` builds the userland layer
(cached in /var/cache/hedgerow/userland): ``make test`` runs it once before pytest, so
no test waits minutes for mmdebstrap inside its own timeout.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from apps.sandboxes.backends.local.images.tests.ocibuild import E, Layout, layer, userland_layer

TESTBED_FILES = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
}
# the policy's right answer: the test passes
PATCH = """\
--- a/calc.py
+++ b/calc.py
@@ -1,2 +1,2 @@
 def add(a, b):
-    return a - b
+    return a + b
"""
# a wrong answer that applies cleanly: the test still fails
WRONG_PATCH = """\
--- a/calc.py
+++ b/calc.py
@@ -1,2 +1,2 @@
 def add(a, b):
-    return a - b
+    return a * b
"""
SWE_CONFIG = {"WorkingDir": "/testbed", "Env": ["PYTHONDONTWRITEBYTECODE=1"]}


def testbed_layer(tmp: Path) -> tuple[bytes, str]:
    """/testbed: a git repository with a failing test, as a layer."""
    repo = tmp / "testbed"
    repo.mkdir()
    for name, text in TESTBED_FILES.items():
        (repo / name).write_text(text)
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp),
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True, env=env)
    entries = [E("testbed", "dir", mode=0o755)]
    for path in sorted(repo.rglob("*")):
        rel = "testbed/" + str(path.relative_to(repo))
        if path.is_symlink():
            entries.append(E(rel, "symlink", link=os.readlink(path)))
        elif path.is_dir():
            entries.append(E(rel, "dir", mode=0o755))
        else:
            entries.append(E(rel, data=path.read_bytes(), mode=path.stat().st_mode & 0o777))
    return layer(entries)


def push_swe_image(tmp: Path, ref: str, creds: str | None) -> str:
    """Builds the SWE image in tmp and pushes it to ref; returns its manifest digest."""
    userland, diff_id = userland_layer()
    lay = Layout(tmp / "swe-layout")
    desc = lay.image([(userland.read_bytes(), diff_id), testbed_layer(tmp)], SWE_CONFIG)
    lay.tag("v1", desc)
    lay.push("v1", ref, creds)
    return str(desc["digest"])


def main(argv: list[str]) -> int:
    """No arguments: build (or find) the userland layer. ``--push REF [--creds U:P]``:
    also build the SWE image and push it to REF (docs/images.md, the user's guide);
    the push does not verify TLS (test registries)."""
    parser = argparse.ArgumentParser(prog="swe")
    parser.add_argument("--push", metavar="REF", help="push the SWE image to this reference")
    parser.add_argument("--creds", metavar="USER:PASSWORD", help="the registry's login")
    args = parser.parse_args(argv)
    path, diff_id = userland_layer()
    print(f"userland layer {path} ({diff_id})", file=sys.stderr)
    if args.push:
        with tempfile.TemporaryDirectory() as tmp:
            print(push_swe_image(Path(tmp), args.push, args.creds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
