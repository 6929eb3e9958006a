"""Directory trees up and down through the SDK, measured in one run (issue 26 defect 3).

    .venv/bin/python -m bench.tree_transfer [--files 204] [--size-kb 42] [--rounds 3]

A private stack (bench/_stack.py), one sandbox, a local tree of --files files of
--size-kb each (the issue's case: 204 files, 8.4 MiB). Per round: ``upload`` of the tree
(one archive request), ``download`` of it (stat + one archive request), and the
per-file way 0.2 used (``write_file`` / ``iter_file`` per file) for comparison; then a
single small file's GET against a stat (the "45 ms per GET" the issue measured).
Prints medians and the ratios download/upload and per-file/archive. Never a gate.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=204)
    parser.add_argument("--size-kb", type=int, default=42)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from bench._stack import private_stack

    with private_stack("trees", {}, lambda stack: None) as (stack, secret):
        from hedgerow import Client

        work = Path(tempfile.mkdtemp(prefix="hr-trees-"))
        tree = work / "tree"
        tree.mkdir()
        for i in range(args.files):
            (tree / f"f{i:04}.bin").write_bytes(os.urandom(args.size_kb * 1024))
        results: dict[str, list[float]] = {}

        def add(name: str, seconds: float) -> None:
            results.setdefault(name, []).append(seconds)

        with Client(stack.url, secret) as hr, hr.create_sandbox() as sb:

            def per_file_up(n: int) -> None:
                for path in sorted(tree.iterdir()):
                    sb.write_file(f"/workspace/p{n}/{path.name}", path.read_bytes())

            def per_file_down(n: int) -> None:
                target = work / f"p{n}"
                target.mkdir()
                for entry in sb.list_files(f"/workspace/p{n}"):
                    (target / entry.name).write_bytes(sb.read_file(entry.path))

            for n in range(args.rounds):
                add("archive up", timed(functools.partial(sb.upload, tree, f"/workspace/t{n}")))
                down = functools.partial(sb.download, f"/workspace/t{n}", work / f"d{n}")
                add("archive down", timed(down))
                add("per-file up", timed(functools.partial(per_file_up, n)))
                add("per-file down", timed(functools.partial(per_file_down, n)))
            small = "/workspace/t0/f0000.bin"
            for _ in range(50):
                add("one GET", timed(functools.partial(sb.read_file, small)))
                add("one stat", timed(functools.partial(sb.stat, small)))
        med = {k: statistics.median(v) for k, v in results.items()}
        mib = args.files * args.size_kb / 1024
        print(f"tree: {args.files} files, {mib:.1f} MiB, {args.rounds} rounds (medians)")
        for name, seconds in med.items():
            print(f"  {name:<14} {seconds * 1000:9.1f} ms")
        print(f"  download/upload (archive)  {med['archive down'] / med['archive up']:.2f}")
        print(f"  per-file/archive up        {med['per-file up'] / med['archive up']:.2f}")
        print(f"  per-file/archive down      {med['per-file down'] / med['archive down']:.2f}")
        print(f"  one GET/one stat           {med['one GET'] / med['one stat']:.2f}")


if __name__ == "__main__":
    main()
