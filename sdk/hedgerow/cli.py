"""The ``hedgerow`` command line.

    hedgerow login --url http://HOST:8000 --key hr_...
    hedgerow sandbox create [--count N] · ls · get ID · rm ID... · exec ID -- CMD...
    hedgerow sandbox shell ID · cp SRC DST (ID:/path on either side)
    hedgerow ops get SANDBOX OP · keys ls|create|revoke · trajectories import|export
    hedgerow bench exec|create

``--json`` prints machine-readable output. ``sandbox exec`` exits with the command's
exit code (128+N for a signal, 124 for a timeout); other commands exit 0, or 1 with
the server's error on stderr (2 for usage errors).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import httpx

from hedgerow import _common as common
from hedgerow.client import Client, Sandbox
from hedgerow.errors import HedgerowError


class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, label: str, total: int, *, unit: str = "") -> None:
        self.label, self.total, self.unit, self.done = label, max(total, 1), unit, 0
        self.enabled = sys.stderr.isatty() or os.environ.get("HEDGEROW_PROGRESS") == "1"
        self._draw()

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 30
        filled = int(width * min(self.done / self.total, 1.0))
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(f"\r{self.label} [{bar}] {self.done}/{self.total}{self.unit}")
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _out(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(text())


def _client(args: argparse.Namespace) -> Client:
    # The CLI's sandboxes outlive the command: cleanup is for programs, not for `create`.
    return Client(args.url, args.key, cleanup=False)


def _row(data: Dict[str, Any]) -> str:
    return f"{data['id']:<24} {data['state']:<12} {data.get('image', ''):<12} {data.get('cpu', '')}"


# -- login ------------------------------------------------------------------------
def cmd_login(args: argparse.Namespace) -> int:
    url = (
        args.url or input("Hedgerow URL [http://127.0.0.1:8000]: ") or common.DEFAULT_URL
    ).rstrip("/")
    key = args.key or os.environ.get("HEDGEROW_API_KEY") or input("API key: ").strip()
    Client(url, key, cleanup=False).list(limit=1)  # fails loudly on a bad URL or key
    path = common.config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Created 0600 from the start: the key is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"url": url, "api_key": key}, handle)
    os.chmod(path, 0o600)
    _out(args, {"url": url, "config": str(path)}, lambda: f"logged in to {url} ({path})")
    return 0


# -- sandboxes ----------------------------------------------------------------------
def cmd_sandbox_ls(args: argparse.Namespace) -> int:
    sandboxes = _client(args).list(state=args.state, limit=args.limit)
    rows = [s.data for s in sandboxes]
    _out(args, rows, lambda: "\n".join(_row(r) for r in rows) or "(no sandboxes)")
    return 0


def cmd_sandbox_create(args: argparse.Namespace) -> int:
    hr = _client(args)
    progress = Progress("creating", args.count)

    def one(_: int) -> Dict[str, Any]:
        sandbox = hr.create_sandbox(
            args.image,
            cpu=args.cpu,
            memory=args.memory,
            network_access=args.network,
            ttl_seconds=args.ttl,
            wait=not args.no_wait,
        )
        progress.advance()
        return sandbox.data

    with ThreadPoolExecutor(max_workers=min(args.count, 16)) as pool:
        rows = list(pool.map(one, range(args.count)))
    progress.finish()
    _out(args, rows if args.count > 1 else rows[0], lambda: "\n".join(r["id"] for r in rows))
    return 0


def cmd_sandbox_get(args: argparse.Namespace) -> int:
    data = _client(args).get(args.id).data
    _out(args, data, lambda: "\n".join(f"{k}: {v}" for k, v in data.items()))
    return 0


def cmd_sandbox_rm(args: argparse.Namespace) -> int:
    hr = _client(args)
    ids = list(args.ids)
    if args.all:
        ids += [s.id for s in hr.list(state="requested,provisioning,ready,queued", limit=1000)]
    progress = Progress("deleting", len(ids))
    failed: List[str] = []
    for sandbox_id in ids:
        try:
            hr.delete(sandbox_id)
        except HedgerowError as exc:
            failed.append(sandbox_id)
            print(f"{sandbox_id}: {exc}", file=sys.stderr)
        progress.advance()
    progress.finish()
    _out(args, {"deleted": [i for i in ids if i not in failed], "failed": failed}, lambda: "")
    return 1 if failed else 0


def exit_code_of(result: Any) -> int:
    if result.timed_out:
        return 124
    if result.signal:
        return 128 + int(result.signal)
    if result.exit_code is None:
        return 1
    return int(result.exit_code)


def cmd_sandbox_exec(args: argparse.Namespace) -> int:
    command: Any = args.command
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("hedgerow sandbox exec: give a command after the sandbox id", file=sys.stderr)
        return 2
    if len(command) == 1:
        command = command[0]  # one word: a shell string ("ls -l | wc -l")
    stdin = sys.stdin.buffer.read() if args.stdin else None
    sandbox = Sandbox(_client(args), {"id": args.id, "state": "ready"})
    result = sandbox.exec(
        command, cwd=args.cwd, timeout=args.timeout, stdin=stdin, env=dict(args.env or [])
    )
    if args.json:
        print(json.dumps(result.raw, indent=2, default=str))
    else:
        sys.stdout.write(result.stdout)
        sys.stdout.flush()
        sys.stderr.write(result.stderr)
    return exit_code_of(result)


def _split(spec: str) -> tuple[Optional[str], str]:
    """``ID:/path`` → (ID, /path); a local path → (None, path)."""
    head, sep, tail = spec.partition(":")
    if sep and tail.startswith("/") and "/" not in head and head:
        return head, tail
    return None, spec


def cmd_sandbox_cp(args: argparse.Namespace) -> int:
    src_box, src = _split(args.src)
    dst_box, dst = _split(args.dst)
    if (src_box is None) == (dst_box is None):
        print("hedgerow sandbox cp: exactly one side must be ID:/path", file=sys.stderr)
        return 2
    hr = _client(args)
    if src_box is None:
        assert dst_box is not None
        local = Path(src)
        total = (
            sum(p.stat().st_size for p, _ in common.local_files(local))
            if local.is_dir()
            else (local.stat().st_size)
        )
        progress = Progress("uploading", total, unit=" B")
        sent = Sandbox(hr, {"id": dst_box}).upload(local, dst, progress=progress.advance)
        progress.finish()
        _out(args, {"bytes": sent, "to": args.dst}, lambda: f"{sent} bytes → {args.dst}")
        return 0
    sandbox = Sandbox(hr, {"id": src_box})
    stat = sandbox.stat(src)
    progress = Progress("downloading", int(stat.get("size") or 0), unit=" B")
    received = sandbox.download(src, dst, progress=progress.advance)
    progress.finish()
    _out(args, {"bytes": received, "to": dst}, lambda: f"{received} bytes → {dst}")
    return 0


def cmd_sandbox_shell(args: argparse.Namespace) -> int:
    from hedgerow.shell import run_shell

    hr = _client(args)
    return run_shell(hr.url, hr.api_key, args.id, cmd=args.command or None)


# -- operations, keys, trajectories --------------------------------------------------
def cmd_ops_get(args: argparse.Namespace) -> int:
    result = _client(args).operation(args.sandbox, args.op)
    _out(
        args,
        result.raw,
        lambda: f"{result.operation_id}: {result.status} {result.termination} "
        f"exit={result.exit_code}\n{result.stdout}{result.stderr}",
    )
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    hr = _client(args)
    if args.keys_cmd == "ls":
        keys = hr.list_keys()
        _out(
            args,
            keys,
            lambda: "\n".join(
                f"{k['id']}  {k.get('prefix', '')}…  {k.get('name', '')}  "
                f"{'revoked' if k.get('revoked_at') else 'active'}"
                for k in keys
            ),
        )
    elif args.keys_cmd == "create":
        key = hr.create_key(args.name, scopes=args.scopes)
        _out(args, key, lambda: f"{key['id']}\n{key['secret']}  (shown once)")
    else:
        key = hr.revoke_key(args.id)
        _out(args, key, lambda: f"revoked {key['id']}")
    return 0


def cmd_trajectories(args: argparse.Namespace) -> int:
    hr = _client(args)
    if args.traj_cmd == "export":
        out = open(args.output, "wb") if args.output else sys.stdout.buffer  # noqa: SIM115
        count = 0
        with hr._http.stream("GET", "/episodes/export", timeout=600) as response:
            if response.status_code >= 400:
                response.read()
                raise HedgerowError(response.text[:500], code="export_failed")
            for line in response.iter_lines():
                if line:
                    out.write(line.encode() + b"\n")
                    count += 1
        if args.output:
            out.close()
            print(f"exported {count} episodes to {args.output}", file=sys.stderr)
        return 0
    data = Path(args.file).read_bytes()
    lines = data.count(b"\n") or 1
    progress = Progress("importing", lines, unit=" lines")
    params = {"dry_run": "true"} if args.dry_run else None
    response = hr._http.post(
        "/episodes/import",
        content=data,
        params=params,
        headers={"Content-Type": "application/x-ndjson"},
        timeout=600,
    )
    progress.advance(lines)
    progress.finish()
    report = response.json()
    if response.status_code >= 400:
        raise HedgerowError(json.dumps(report)[:500], code="import_failed")
    _out(args, report, lambda: json.dumps(report))
    return 0 if response.status_code == 200 else 1


# -- bench ------------------------------------------------------------------------------
def _stats(samples: List[float]) -> Dict[str, float]:
    ordered = sorted(samples)

    def pct(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)

    return {
        "n": len(ordered),
        "p50_ms": pct(0.5),
        "p95_ms": pct(0.95),
        "p99_ms": pct(0.99),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 2),
    }


def cmd_bench(args: argparse.Namespace) -> int:
    hr = Client(args.url, args.key, cleanup=True)
    with hr:
        if args.bench_cmd == "exec":
            sandbox = hr.create_sandbox()
            progress = Progress("exec", args.n)
            samples = []
            for _ in range(args.n):
                start = time.perf_counter()
                sandbox.exec("echo hi")
                samples.append(time.perf_counter() - start)
                progress.advance()
            progress.finish()
            report = {"bench": "exec", "command": "echo hi", **_stats(samples)}
        else:
            progress = Progress("create", args.n)

            def one(_: int) -> float:
                start = time.perf_counter()
                hr.create_sandbox().delete()
                progress.advance()
                return time.perf_counter() - start

            with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
                samples = list(pool.map(one, range(args.n)))
            progress.finish()
            report = {"bench": "create_ready_delete", "concurrency": args.concurrency}
            report.update(_stats(samples))
    _out(args, report, lambda: " ".join(f"{k}={v}" for k, v in report.items()))
    return 0


# -- parser -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hedgerow", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="server URL (default: HEDGEROW_URL or the login file)")
    parser.add_argument("--key", help="API key (default: HEDGEROW_API_KEY or the login file)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="group", required=True)

    sub.add_parser("login", help="store URL and key (0600)").set_defaults(func=cmd_login)

    sandbox = sub.add_parser("sandbox", help="sandboxes").add_subparsers(dest="cmd", required=True)
    ls = sandbox.add_parser("ls")
    ls.add_argument("--state")
    ls.add_argument("--limit", type=int, default=50)
    ls.set_defaults(func=cmd_sandbox_ls)
    create = sandbox.add_parser("create")
    create.add_argument("--image", default="host")
    create.add_argument("--cpu")
    create.add_argument("--memory")
    create.add_argument("--network", action="store_true", help="allow network access")
    create.add_argument("--ttl", type=int)
    create.add_argument("--count", type=int, default=1)
    create.add_argument("--no-wait", action="store_true")
    create.set_defaults(func=cmd_sandbox_create)
    get = sandbox.add_parser("get")
    get.add_argument("id")
    get.set_defaults(func=cmd_sandbox_get)
    rm = sandbox.add_parser("rm")
    rm.add_argument("ids", nargs="*")
    rm.add_argument("--all", action="store_true", help="every live sandbox of the team")
    rm.set_defaults(func=cmd_sandbox_rm)
    run = sandbox.add_parser("exec")
    run.add_argument("id")
    run.add_argument("--cwd")
    run.add_argument("--timeout", type=float)
    run.add_argument("--env", action="append", type=lambda s: tuple(s.split("=", 1)))
    run.add_argument("--stdin", action="store_true", help="send this process's stdin")
    run.add_argument("command", nargs=argparse.REMAINDER)
    run.set_defaults(func=cmd_sandbox_exec)
    shell = sandbox.add_parser("shell")
    shell.add_argument("id")
    shell.add_argument("command", nargs=argparse.REMAINDER)
    shell.set_defaults(func=cmd_sandbox_shell)
    cp = sandbox.add_parser("cp", help="SRC DST, one of them ID:/path")
    cp.add_argument("src")
    cp.add_argument("dst")
    cp.set_defaults(func=cmd_sandbox_cp)

    ops = sub.add_parser("ops").add_subparsers(dest="cmd", required=True)
    op_get = ops.add_parser("get")
    op_get.add_argument("sandbox")
    op_get.add_argument("op")
    op_get.set_defaults(func=cmd_ops_get)

    keys = sub.add_parser("keys").add_subparsers(dest="keys_cmd", required=True)
    keys.add_parser("ls").set_defaults(func=cmd_keys)
    key_create = keys.add_parser("create")
    key_create.add_argument("name")
    key_create.add_argument("--scopes", nargs="*")
    key_create.set_defaults(func=cmd_keys)
    key_revoke = keys.add_parser("revoke")
    key_revoke.add_argument("id")
    key_revoke.set_defaults(func=cmd_keys)

    traj = sub.add_parser("trajectories").add_subparsers(dest="traj_cmd", required=True)
    export = traj.add_parser("export")
    export.add_argument("-o", "--output")
    export.set_defaults(func=cmd_trajectories)
    imp = traj.add_parser("import")
    imp.add_argument("file")
    imp.add_argument("--dry-run", action="store_true")
    imp.set_defaults(func=cmd_trajectories)

    bench = sub.add_parser("bench").add_subparsers(dest="bench_cmd", required=True)
    bench_exec = bench.add_parser("exec", help="exec latency through the API")
    bench_exec.add_argument("--n", type=int, default=100)
    bench_exec.set_defaults(func=cmd_bench)
    bench_create = bench.add_parser("create", help="create→ready→delete latency")
    bench_create.add_argument("--n", type=int, default=10)
    bench_create.add_argument("--concurrency", type=int, default=4)
    bench_create.set_defaults(func=cmd_bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except HedgerowError as exc:
        if args.json:
            print(json.dumps({"error": {"code": exc.code, "message": exc.message}}))
        print(f"hedgerow: {exc}", file=sys.stderr)
        return 1
    except (OSError, httpx.HTTPError) as exc:
        print(f"hedgerow: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
