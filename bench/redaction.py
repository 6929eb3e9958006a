"""What secret redaction costs a step at ingestion, measured in one run on this machine.

    .venv/bin/python -m bench.redaction [--n 200] [--kb 23]

Redacts a synthetic step (a model action, an exec request, stdout/stderr records of
``--kb`` KiB of pytest-like text in all) with ``apps.trajectories.redaction.Redactor``,
no database: (a) a clean step, (b) the same step with ten secrets of different kinds
planted in its output. CPU time per step (``time.process_time``: the machine's other
load does not count), p50/p95/p99 in milliseconds, and the throughput in KiB/s.
"""

from __future__ import annotations

import argparse
import random
import string
import time
from typing import Any

from apps.trajectories.redaction import Redactor

WORDS = ["def", "return", "import", "pytest", "assert", "self", "value", "PASSED", "FAILED"]
WORDS += ["==", "tests/test_app.py::test_", "E   AssertionError:", "line", "error", "0x7f"]
PLANTED = [
    "ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789",
    "AKIAIOSFODNN7EXAMPLE",
    "AIzaSyA1234567890abcdefghijklmnopqrstuv",
    "glpat-xY7zQ2wE9rT4uI1oP6aS",
    "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
    "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z",
    "password: 'q8Zr!v2Lp@x9Wm'",
    "https://api.example.com/v1?token=9fJ2kL8mN3pQ7rS1",
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0",
    "hr_A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8S9t0uVw",
]


def prose(rng: random.Random, n: int) -> str:
    out: list[str] = []
    size = 0
    while size < n:
        word = rng.choice(WORDS) + "".join(rng.choices(string.ascii_lowercase, k=rng.randint(0, 6)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def step(kb: int, planted: bool, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    total = kb * 1024
    head = prose(rng, int(total * 0.7))
    if planted:
        words = head.split(" ")
        for secret in PLANTED:
            words.insert(rng.randrange(len(words)), secret)
        head = " ".join(words)
    return {
        "action": prose(rng, int(total * 0.09)),
        "request": {"command": prose(rng, 200)},
        "observation": {
            "stdout": {"head": head, "tail": prose(rng, int(total * 0.17)), "encoding": "utf-8"},
            "stderr": {"head": prose(rng, int(total * 0.04)), "tail": "", "encoding": "utf-8"},
        },
        "model_call": {"tokens_in": 812, "tokens_out": 64},
    }


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(kb: int, planted: bool, n: int) -> tuple[list[float], int]:
    samples: list[float] = []
    found = 0
    data = [step(kb, planted, seed) for seed in range(n)]
    for item in data:
        redactor = Redactor(scope="abcd1234", fingerprint=lambda value: value)
        start = time.process_time()
        redactor.value(item)
        samples.append((time.process_time() - start) * 1000)
        found += len(redactor.found)
    return samples, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--kb", type=int, default=23)
    args = parser.parse_args()
    for label, planted in (("clean step", False), ("10 secrets planted", True)):
        samples, found = measure(args.kb, planted, args.n)
        p50 = pct(samples, 0.5)
        print(
            f"{label:<20} {args.kb} KiB: p50 {p50:.2f} ms  p95 {pct(samples, 0.95):.2f} ms  "
            f"p99 {pct(samples, 0.99):.2f} ms  ({args.kb / (p50 / 1000):.0f} KiB/s)  "
            f"secrets found per step: {found / args.n:.1f}"
        )


if __name__ == "__main__":
    main()
