"""Which interpreter the agent zygote (and so every zygote-started agent) runs.

An idle agent's private memory is mostly the pages CPython's reference counting writes
after the zygote forks it. Python 3.12's immortal objects leave those pages shared:
an idle agent holds 3.3 MiB of private pages on 3.12 against 3.9 MiB on 3.11
(docs/benchmarks.md, "Density"). ``HEDGEROW_LOCAL_ZYGOTE_PYTHON=auto`` (what `make up`
sets) picks a CPython 3.12 when the machine has one and the control plane itself runs
an older one; a path names one explicitly; empty means the control plane's own.

Only 3.12 is looked for: the agent is tested on it (the zygote tests and the density
benchmark run their agents there); 3.13 changed the C API the agent's ctypes calls rely
on less than it changed the stdlib, but it has not been measured or tested here.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

AUTO = "auto"
WANTED = (3, 12)
_PYENV_VERSION = re.compile(r"^3\.12\.(\d+)$")


def is_interpreter_binary(path: str | Path) -> bool:
    """An executable ELF file (symlinks followed). A pyenv or asdf *shim* is a shell
    script that picks the real interpreter from its own name: the zygote runs under
    another name (hedgerow-zygote), so a shim would fail to start it."""
    real = os.path.realpath(path)
    try:
        with open(real, "rb") as f:
            magic = f.read(4)
    except OSError:
        return False
    return magic == b"\x7fELF" and os.access(real, os.X_OK)


def pyenv_candidates(root: Path) -> list[Path]:
    """``<pyenv root>/versions/3.12.N/bin/python3.12``, newest patch release first."""
    versions = root / "versions"
    found: list[tuple[int, Path]] = []
    if versions.is_dir():
        for entry in versions.iterdir():
            match = _PYENV_VERSION.match(entry.name)
            exe = entry / "bin" / "python3.12"
            if match and is_interpreter_binary(exe):
                found.append((int(match.group(1)), exe))
    return [exe for _, exe in sorted(found, reverse=True)]


def resolve(
    value: str,
    *,
    own_version: tuple[int, int] = (sys.version_info.major, sys.version_info.minor),
    path: str | None = None,
    pyenv_root: Path | None = None,
) -> str | None:
    """The interpreter to run the zygote on: ``None`` for the control plane's own.
    ``value`` is the setting: a path (returned as given; the zygote client checks it),
    empty (own), or ``auto``."""
    if value != AUTO:
        return value or None
    if own_version >= WANTED:
        return None
    on_path = shutil.which("python3.12", path=path)
    if on_path and is_interpreter_binary(on_path):
        return os.path.realpath(on_path)
    root = pyenv_root or Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    candidates = pyenv_candidates(root)
    return str(candidates[0]) if candidates else None
