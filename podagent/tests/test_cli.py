"""The agent's command line: launchers' plain forms are read without argparse, with
exactly argparse's result; everything else still goes through argparse."""

from __future__ import annotations

import argparse
from typing import Any, List

import pytest

from podagent.__main__ import build_parser, parse_args

# what the local backend passes (process.agent_args) plus the zygote's --listening-fd
LAUNCHER_ARGS = [
    "--listen",
    "0.0.0.0:8000",
    "--token-file",
    "/run/hedgerow/token",
    "--unlink-token",
    "--workdir",
    "/workspace",
    "--log-file",
    "/dev/stdout",
    "--listening-fd",
    "7",
]

SAME_AS_ARGPARSE = [
    LAUNCHER_ARGS,
    ["--listen", "127.0.0.1:0"],
    ["--listen", "[::1]:9000", "--max-pty", "3", "--workdir", "/w"],
    ["--unlink-token", "--listen", ":80", "--token-file", "t", "--unlink-token"],
    ["--listen", "a:1", "--listen", "b:2"],  # the last one wins
    ["--listen=127.0.0.1:1", "--max-pty=2"],  # argparse's own forms
    ["--listen", "127.0.0.1:1", "--work", "/w"],  # an abbreviation argparse accepts
]


@pytest.mark.parametrize("argv", SAME_AS_ARGPARSE)
def test_it_parses_like_argparse(argv: List[str]) -> None:
    assert vars(parse_args(argv)) == vars(build_parser().parse_args(argv))


@pytest.mark.parametrize(
    "argv",
    [
        [],  # --listen is required
        ["--listen", "nonsense"],
        ["--listen", "127.0.0.1:1", "--max-pty", "many"],
        ["--listen", "127.0.0.1:1", "--bogus"],
        ["--listen", "127.0.0.1:1", "--token-file"],
        ["--help"],
    ],
)
def test_it_leaves_anything_else_to_argparse_and_its_errors(
    argv: List[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        parse_args(argv)
    with pytest.raises(SystemExit) as expected:
        build_parser().parse_args(argv)
    assert caught.value.code == expected.value.code
    assert capsys.readouterr().err.count("podagent") >= 1 or caught.value.code == 0


def test_it_reads_the_launchers_arguments_without_building_a_parser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_parser(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a parser was built")

    monkeypatch.setattr(argparse, "ArgumentParser", no_parser)
    args = parse_args(LAUNCHER_ARGS)
    assert args.listen == ("0.0.0.0", 8000)
    assert (args.unlink_token, args.listening_fd, args.max_pty) == (True, 7, 8)
