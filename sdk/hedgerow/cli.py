"""The ``hedgerow`` command line.

    hedgerow login --url http://HOST:8000 --key hr_...
    hedgerow sandbox create [--count N] · ls · get ID · rm ID... · exec ID -- CMD...
    hedgerow sandbox shell ID · cp SRC DST (ID:/path on either side)
    hedgerow image pull REF · ls · rm ID... · import PATH --reference REF
    hedgerow ops get|wait|kill SANDBOX OP · keys ls|create|revoke · trajectories import|export|scan
    hedgerow bench exec|create

``--json`` prints machine-readable output. ``sandbox exec`` exits with the command's
exit code (128+N for a signal, 124 for a timeout); other commands exit 0, or 1 with
the server's error on stderr (2 for usage errors).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import posixpath
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import httpx

from hedgerow import _common as common
from hedgerow._common import VERSION as __version__
from hedgerow.cleanup import registry
from hedgerow.client import Client, Sandbox
from hedgerow.errors import AuthError, HedgerowError, NotFound
from hedgerow.images import Image
from hedgerow.records import FileInfo
from hedgerow.shapes import SandboxData


class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, label: str, total: int, *, unit: str = "") -> None:
        self.label, self.total, self.unit, self.done = label, max(total, 1), unit, 0
        self.enabled = sys.stderr.isatty() or os.environ.get("HEDGEROW_PROGRESS") == "1"
        self._draw()

    def set_total(self, total: int) -> None:
        self.total = max(total, 1)
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


_HEADER = f"{'ID':<24} {'STATE':<12} {'IMAGE':<16} {'CPU':<6} {'MEMORY':<8} CREATED"


def _row(data: Mapping[str, Any]) -> str:
    return (
        f"{data['id']:<24} {data['state']:<12} {data.get('image', '')!s:<16} "
        f"{data.get('cpu', '')!s:<6} {data.get('memory', '')!s:<8} "
        f"{data.get('created_at', '')}"
    )


# -- login ------------------------------------------------------------------------
def _read_key() -> str:
    """The key from a prompt that does not echo it (a terminal) or from stdin (a pipe:
    ``hedgerow login --url URL < keyfile``); never from argv unless --key is given."""
    if sys.stdin.isatty():
        return getpass.getpass("API key: ").strip()
    return sys.stdin.readline().strip()


def cmd_login(args: argparse.Namespace) -> int:
    url = args.url
    if not url:
        url = input("Hedgerow URL [http://127.0.0.1:8000]: ") if sys.stdin.isatty() else ""
    url = (url or common.DEFAULT_URL).rstrip("/")
    key = args.key or os.environ.get("HEDGEROW_API_KEY") or _read_key()
    if not key:
        print("hedgerow login: no API key given (prompt, stdin or --key)", file=sys.stderr)
        return 2
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
    sandboxes = _client(args).list(
        state=args.state, labels=dict(args.label or []) or None, limit=args.limit
    )
    rows = [s.data for s in sandboxes]
    _out(args, rows, lambda: "\n".join([_HEADER, *(_row(r) for r in rows)]))
    return 0


def cmd_sandbox_label(args: argparse.Namespace) -> int:
    sandbox = Sandbox(_client(args), {"id": args.id})  # one PATCH, no read first
    labels = sandbox.update_labels(dict(args.changes))
    _out(args, labels, lambda: "\n".join(f"{k}={v}" for k, v in sorted(labels.items())))
    return 0


def cmd_sandbox_create(args: argparse.Namespace) -> int:
    """Creates ``--count`` sandboxes, printing each id as it is created. All or
    nothing: on Ctrl-C, SIGTERM or a failed create, every sandbox this command created
    (or was creating) is deleted; on success they outlive the command (no heartbeat
    timeout: nobody heartbeats them once the command has exited)."""
    hr = Client(args.url, args.key, cleanup=True)
    progress = Progress("creating", args.count)
    rows: List[SandboxData] = []
    failures: List[BaseException] = []
    lock = threading.Lock()
    todo = iter(range(args.count))

    def worker() -> None:
        while True:
            with lock:
                if failures or next(todo, None) is None:
                    return
            try:
                sandbox = hr.create_sandbox(
                    args.image,
                    cpu=args.cpu,
                    memory=args.memory,
                    network_access=args.network,
                    egress=args.egress,
                    ttl_seconds=args.ttl,
                    labels=dict(args.label or []) or None,
                    wait=not args.no_wait,
                    heartbeat=False,
                )
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                with lock:
                    failures.append(exc)
                return
            with lock:
                rows.append(sandbox.data)
                if not args.json:
                    print(sandbox.id, flush=True)
            progress.advance()

    # Daemon threads: after Ctrl-C the command exits at once, whatever they are doing.
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(args.count, 16))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except KeyboardInterrupt:
        progress.finish()
        print("hedgerow: interrupted; deleted the sandboxes this command created", file=sys.stderr)
        raise
    progress.finish()
    if failures:
        hr.cleanup_sandboxes()
        raise failures[0]
    for sandbox_id in list(hr._created):
        registry.discard(hr.url, sandbox_id)  # on success they outlive the command
    hr._created.clear()
    if args.json:
        _out(args, rows if args.count > 1 else rows[0], lambda: "")
    return 0


def cmd_sandbox_get(args: argparse.Namespace) -> int:
    data = _client(args).get(args.id).data
    _out(args, data, lambda: "\n".join(f"{k}: {v}" for k, v in data.items()))
    return 0


def cmd_sandbox_rm(args: argparse.Namespace) -> int:
    hr = _client(args)
    ids = list(args.ids)
    if not ids and not args.all:
        print("hedgerow sandbox rm: give sandbox ids, or --all", file=sys.stderr)
        return 2
    if args.all:
        everything = [s.id for s in hr.list(state=LIVE_STATES, limit=1000)]
        if everything and not args.yes:
            question = f"Delete all {len(everything)} live sandboxes of the team? [y/N] "
            if not sys.stdin.isatty():
                print(
                    "hedgerow sandbox rm --all: refusing without a terminal to confirm; add --yes",
                    file=sys.stderr,
                )
                return 2
            if input(question).strip().lower() not in ("y", "yes"):
                print("nothing deleted", file=sys.stderr)
                return 1
        ids += everything
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
    deleted = [i for i in ids if i not in failed]
    _out(args, {"deleted": deleted, "failed": failed}, lambda: "\n".join(deleted))
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
    command: Any = list(args.command)
    if not command:
        print("hedgerow sandbox exec: give a command: exec ID -- CMD...", file=sys.stderr)
        return 2
    if len(command) == 1:
        command = command[0]  # one word: a shell string ("ls -l | wc -l")
    stdin = sys.stdin.buffer.read() if args.stdin else None
    if args.stdin_open and not args.background:
        print("hedgerow sandbox exec: --stdin-open needs --background", file=sys.stderr)
        return 2
    sandbox = Sandbox(_client(args), {"id": args.id, "state": "ready"})

    def write(stream: Any) -> Callable[[str], None]:
        def emit(text: str) -> None:
            stream.write(text)
            stream.flush()

        return emit

    if args.background:
        handle = sandbox.exec(
            command, cwd=args.cwd, timeout=args.timeout, stdin=stdin,
            env=dict(args.env or []), background=True, stdin_open=args.stdin_open,
        )  # fmt: skip
        _out(args, handle.data, lambda: handle.id)
        return 0
    # Text mode streams output as it is produced; --json prints the record at the end.
    result = sandbox.exec(
        command,
        cwd=args.cwd,
        timeout=args.timeout,
        stdin=stdin,
        env=dict(args.env or []),
        on_stdout=None if args.json else write(sys.stdout),
        on_stderr=None if args.json else write(sys.stderr),
    )
    if args.json:
        print(json.dumps(result.raw, indent=2, default=str))
    elif result.error is not None:
        print(f"hedgerow: {result.error}", file=sys.stderr)
    return exit_code_of(result)


def _split(spec: str) -> tuple[Optional[str], str]:
    """``ID:/path`` → (ID, /path); a local path → (None, path)."""
    head, sep, tail = spec.partition(":")
    if sep and tail.startswith("/") and "/" not in head and head:
        return head, tail
    return None, spec


def cmd_sandbox_cp(args: argparse.Namespace) -> int:
    """cp(1)'s rules both ways: into an existing directory, SRC keeps its name there;
    otherwise DST is the new name. Trees go as one archive (modes, symlinks, empty
    directories kept); the progress bar counts the bytes of the whole transfer."""
    src_box, src = _split(args.src)
    dst_box, dst = _split(args.dst)
    if (src_box is None) == (dst_box is None):
        print("hedgerow sandbox cp: exactly one side must be ID:/path", file=sys.stderr)
        return 2
    hr = _client(args)
    if src_box is None:
        assert dst_box is not None
        local = common.local_source(src)
        sandbox = Sandbox(hr, {"id": dst_box})
        try:
            into = sandbox.stat(dst).type == "directory"
        except NotFound:
            into = False
        if into:
            dst = f"{dst.rstrip('/')}/{local.resolve().name}"
        progress = Progress("uploading", 0, unit=" B")
        sent = sandbox.upload(local, dst, progress=progress.advance, on_total=progress.set_total)
        progress.finish()
        where = f"{dst_box}:{dst}"
        _out(args, {"bytes": sent, "to": where}, lambda: f"{sent} bytes → {where}")
        return 0
    sandbox = Sandbox(hr, {"id": src_box})
    target = Path(dst)
    if target.is_dir():
        target = target / (posixpath.basename(src.rstrip("/")) or "root")
    progress = Progress("downloading", 0, unit=" B")
    received = sandbox.download(src, target, progress=progress.advance, on_total=progress.set_total)
    progress.finish()
    _out(args, {"bytes": received, "to": str(target)}, lambda: f"{received} bytes → {target}")
    return 0


def cmd_sandbox_shell(args: argparse.Namespace) -> int:
    from hedgerow.shell import run_shell

    hr = _client(args)
    return run_shell(hr.url, hr.api_key, args.id, cmd=args.command or None)


# -- images -----------------------------------------------------------------------------
_IMAGE_HEADER = f"{'ID':<36} {'STATUS':<8} {'SIZE':>10} {'SANDBOXES':>9}  REFERENCE"


def _image_row(image: Image) -> str:
    return f"{image.id:<36} {image.status:<8} {image.size_bytes:>10} {image.sandboxes:>9}  " + (
        image.reference
    )


class PullProgress:
    """A progress bar of bytes on a terminal (stderr); plain lines otherwise."""

    def __init__(self, reference: str) -> None:
        self.reference = reference
        self.tty = sys.stderr.isatty() or os.environ.get("HEDGEROW_PROGRESS") == "1"
        self.drawn = False

    def __call__(self, progress: Dict[str, Any]) -> None:
        phase = str(progress.get("phase", ""))
        done, total = int(progress.get("bytes") or 0), int(progress.get("total") or 0)
        layers = progress.get("layers", "")
        if self.tty:
            width = 30
            filled = int(width * min(done / total, 1.0)) if total else 0
            bar = "#" * filled + "-" * (width - filled)
            sys.stderr.write(f"\rpulling {self.reference} {phase:<10} [{bar}] {done}/{total} B")
            self.drawn = True
        else:
            sys.stderr.write(f"{phase} layers={layers} bytes={done}/{total}\n")
        sys.stderr.flush()

    def finish(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()


def cmd_image(args: argparse.Namespace) -> int:
    hr = _client(args)
    if args.image_cmd == "pull":
        bar = PullProgress(args.reference)
        try:
            image = hr.images.pull(args.reference, progress=bar, wait=not args.no_wait)
        finally:
            bar.finish()
        _out(args, image.raw, lambda: f"{image.id} {image.status} {image.digest}")
        return 0
    if args.image_cmd == "ls":
        images = hr.images.list()
        _out(
            args,
            [i.raw for i in images],
            lambda: "\n".join([_IMAGE_HEADER, *(_image_row(i) for i in images)]),
        )
        return 0
    if args.image_cmd == "import":
        image = hr.images.import_(args.path, args.reference)
        _out(args, image.raw, lambda: f"{image.id} {image.status} {image.digest}")
        return 0
    failed = 0
    for image_id in args.ids:
        try:
            hr.images.remove(image_id)
        except HedgerowError as exc:
            failed += 1
            print(f"hedgerow: {image_id}: {exc}", file=sys.stderr)
    return 1 if failed else 0


# -- snapshots (docs/snapshots.md) ---------------------------------------------------
_SNAPSHOT_HEADER = f"{'ID':<36} {'STATE':<10} {'SANDBOX':<24} {'BYTES':>12}  NAME"


def _snapshot_row(data: Mapping[str, Any]) -> str:
    return (
        f"{data['id']:<36} {data['state']:<10} {data.get('sandbox', '')!s:<24} "
        f"{data.get('size_bytes', 0):>12}  {data.get('name', '')}"
    )


def cmd_sandbox_pause(args: argparse.Namespace) -> int:
    sandbox = _client(args).get(args.id)
    sandbox = sandbox.pause() if args.cmd == "pause" else sandbox.resume()
    _out(args, sandbox.data, lambda: f"{sandbox.id} {sandbox.state} gen={sandbox.generation}")
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    hr = _client(args)
    if args.snapshot_cmd == "create":
        manifest = json.loads(Path(args.manifest).read_text()) if args.manifest else None
        probes = [{"name": f"probe{i}", "command": c} for i, c in enumerate(args.probe or [])]
        snap = hr.get(args.sandbox).snapshot(
            name=args.name, manifest=manifest, probes=probes or None, wait=not args.no_wait
        )
        _out(args, snap.data, lambda: f"{snap.id} {snap.state} {snap.fingerprint.get('tree', '')}")
        return 0
    if args.snapshot_cmd == "ls":
        snaps = hr.snapshots()
        _out(
            args,
            [x.data for x in snaps],
            lambda: "\n".join([_SNAPSHOT_HEADER, *(_snapshot_row(x.data) for x in snaps)]),
        )
        return 0
    if args.snapshot_cmd == "fork":
        children = hr.fork(args.id, args.count, wait=not args.no_wait)
        _out(args, [c.data for c in children], lambda: "\n".join(c.id for c in children))
        return 0
    failed = 0
    for snapshot_id in args.ids:
        try:
            hr.get_snapshot(snapshot_id).delete()
        except HedgerowError as exc:
            failed += 1
            print(f"hedgerow: {snapshot_id}: {exc}", file=sys.stderr)
    return 1 if failed else 0


def cmd_sandbox_timeout(args: argparse.Namespace) -> int:
    sandbox = Sandbox(_client(args), {"id": args.id})
    sandbox.set_timeout(args.seconds)
    _out(args, sandbox.data, lambda: f"{sandbox.id} ends at {sandbox.data.get('expires_at')}")
    return 0


# -- files in a sandbox: fs ls|stat|mkdir|mv|rm|watch ID:/path ------------------------
def _remote_path(spec: str) -> Tuple[str, str]:
    sandbox_id, sep, path = spec.partition(":")
    if not sep or not sandbox_id or not path.startswith("/"):
        raise argparse.ArgumentTypeError(f"expected ID:/absolute/path, got {spec!r}")
    return sandbox_id, path


def _entry_line(info: FileInfo) -> str:
    name = info.name + ("/" if info.type == "directory" else "")
    if info.target:
        name += f" -> {info.target}"
    return f"{info.mode:<5} {info.size:>12} {name}"


def cmd_fs(args: argparse.Namespace) -> int:
    sandbox_id, path = args.target
    sandbox = Sandbox(_client(args), {"id": sandbox_id, "state": "ready"})
    if args.cmd == "ls":
        entries = sandbox.list_files(path)
        _out(args, [e.raw for e in entries], lambda: "\n".join(map(_entry_line, entries)))
    elif args.cmd == "stat":
        info = sandbox.stat(path)
        _out(args, info.raw, lambda: f"{info.type} {_entry_line(info)}")
    elif args.cmd == "mkdir":
        info = sandbox.mkdir(path)
        _out(args, info.raw, lambda: info.path)
    elif args.cmd == "mv":
        info = sandbox.rename(path, args.to)
        _out(args, info.raw, lambda: info.path)
    elif args.cmd == "rm":
        sandbox.remove(path, recursive=args.recursive)
    else:  # watch: one line per change, as it happens, until Ctrl-C or --count
        seen = 0
        with sandbox.watch(path, recursive=args.recursive) as watcher:
            # On stderr: the changes from now on are reported (stdout stays the events).
            print(f"watching {sandbox_id}:{path} (Ctrl-C stops)", file=sys.stderr, flush=True)
            for event in watcher:
                line = {"type": event.type, "name": event.name}
                print(json.dumps(line) if args.json else f"{event.type} {event.name}", flush=True)
                seen += 1
                if args.count and seen >= args.count:
                    break
    return 0


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


def cmd_ops_stdin(args: argparse.Namespace) -> int:
    """``ops stdin``: this process's stdin, sent as it arrives (``tail -f log | hedgerow
    ops stdin SB OP``), to a command started with ``--stdin-open``; ``--eof`` closes the
    command's stdin once ours ends."""
    handle = Sandbox(_client(args), {"id": args.sandbox}).command(args.op)
    sent = 0
    if args.text is not None:
        sent += handle.send_stdin(args.text)
    else:
        while chunk := os.read(sys.stdin.fileno(), 65536):
            sent += handle.send_stdin(chunk)
    if args.eof:
        handle.close_stdin()
    _out(args, {"operation_id": args.op, "sent": sent, "eof": args.eof}, lambda: "")
    return 0


def cmd_ops_end(args: argparse.Namespace) -> int:
    """``ops wait`` / ``ops kill``: the command's end, exit code as ``sandbox exec``."""
    handle = Sandbox(_client(args), {"id": args.sandbox}).command(args.op)
    result = handle.kill() if args.cmd == "kill" else handle.wait(timeout=args.timeout)
    _out(
        args,
        result.raw,
        lambda: f"{result.operation_id}: {result.status} {result.termination} "
        f"exit={result.exit_code}",
    )
    return exit_code_of(result)


def cmd_keys(args: argparse.Namespace) -> int:
    hr = _client(args)
    if args.keys_cmd == "ls":
        keys = hr.list_keys()
        _out(
            args,
            [k.raw for k in keys],
            lambda: "\n".join(
                f"{k['id']}  {k.get('prefix', '')}…  {k.get('name', '')}  "
                f"{'revoked' if k.get('revoked_at') else 'active'}"
                for k in keys
            ),
        )
    elif args.keys_cmd == "create":
        key = hr.create_key(args.name, scopes=args.scopes)
        _out(args, key.raw, lambda: f"{key.id}\n{key.secret}  (shown once)")
    else:
        key = hr.revoke_key(args.id)
        _out(args, key.raw, lambda: f"revoked {key.id}")
    return 0


def _scan_text(report: Dict[str, Any], where: str) -> str:
    kinds = report.get("by_kind") or {}
    if not kinds:
        return f"no secrets found in {where}"
    lines = [f"{'KIND':<22} {'SECRETS':>8} {'OCCURRENCES':>12}  WHERE"]
    for kind, entry in kinds.items():
        paths = entry.get("paths")
        shown = ", ".join(paths[:3]) + (" …" if len(paths) > 3 else "") if paths else ""
        lines.append(
            f"{kind:<22} {entry.get('secrets', 0):>8} {entry.get('occurrences', 0):>12}  {shown}"
        )
    return "\n".join(lines)


def cmd_trajectories_scan(args: argparse.Namespace) -> int:
    """A file: what redaction would replace in it, by kind (nothing is stored; exit 1 when
    anything was found, so a pipeline can refuse to publish it). No file: what redaction
    replaced in the team's stored episodes (matching ``--filter``s)."""
    hr = _client(args)
    if args.file:
        data = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
        response = hr._http.post(
            "/episodes/scan",
            content=data,
            headers={"Content-Type": "application/x-ndjson"},
            timeout=600,
        )
        where = "stdin" if args.file == "-" else args.file
    else:
        params: Dict[str, str] = {}
        for item in args.filter or []:
            key, sep, value = item.partition("=")
            if not sep:
                raise HedgerowError(f"--filter takes key=value (got {item!r})", code="usage")
            params[key] = value
        response = hr._http.get("/episodes/secrets/report", params=params, timeout=600)
        where = "the stored episodes"
    if response.status_code >= 400:
        raise HedgerowError(response.text[:500], code="scan_failed")
    report = response.json()
    _out(args, report, lambda: _scan_text(report, where))
    return 1 if args.file and report.get("secrets") else 0


def cmd_trajectories(args: argparse.Namespace) -> int:
    hr = _client(args)
    if args.traj_cmd == "scan":
        return cmd_trajectories_scan(args)
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
LIVE_STATES = "requested,provisioning,ready,queued"
STATES = (
    "queued", "requested", "provisioning", "ready", "terminating", "deleted", "failed", "lost",
)  # fmt: skip


def _states(value: str) -> Optional[str]:
    """``--state``: a comma list of states, ``live`` (default) or ``all``."""
    if value == "all":
        return None
    if value == "live":
        return LIVE_STATES
    wanted = [part.strip() for part in value.split(",") if part.strip()]
    unknown = [part for part in wanted if part not in STATES]
    if unknown or not wanted:
        raise argparse.ArgumentTypeError(
            f"unknown state {', '.join(unknown) or repr(value)}; "
            f"use live, all or a comma list of: {', '.join(STATES)}"
        )
    return ",".join(wanted)


def _egress(value: str) -> Any:
    """none, all, or a JSON policy ({"allow": [...]}; docs/egress.md)."""
    if value in ("none", "all"):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f'expected none, all or a JSON policy like \'{{"allow": ["pkg.example.org"]}}\', '
            f"got {value!r}"
        ) from None


def _pair(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return key, val


def _label_filter(value: str) -> tuple[str, Optional[str]]:
    key, sep, val = value.partition("=")
    if not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE or KEY, got {value!r}")
    return key, (val if sep else None)


def _label_change(value: str) -> tuple[str, Optional[str]]:
    """KEY=VALUE sets a label, KEY- removes it (as kubectl label)."""
    key, sep, val = value.partition("=")
    if sep and key:
        return key, val
    if not sep and len(value) > 1 and value.endswith("-"):
        return value[:-1], None
    raise argparse.ArgumentTypeError(f"expected KEY=VALUE (set) or KEY- (remove), got {value!r}")


def _global_options(*, top: bool) -> argparse.ArgumentParser:
    """--url/--key/--json, accepted before or after any subcommand. Only the top level
    has defaults, so an option given earlier is not reset by a later parser."""
    options = argparse.ArgumentParser(add_help=False)
    default: Any = argparse.SUPPRESS
    options.add_argument(
        "--url",
        default=None if top else default,
        help="server URL (default: HEDGEROW_URL, then the login file)",
    )
    options.add_argument(
        "--key",
        default=None if top else default,
        help="API key (default: HEDGEROW_API_KEY, then the login file); `login` prompts "
        "for it without echo, or reads it from stdin, when not given",
    )
    options.add_argument(
        "--json",
        action="store_true",
        default=False if top else default,
        help="machine-readable output",
    )
    return options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hedgerow",
        description=__doc__.split("\n\n")[0],
        parents=[_global_options(top=True)],
    )
    parser.add_argument("--version", action="version", version=f"hedgerow {__version__}")
    common_options = [_global_options(top=False)]
    sub = parser.add_subparsers(dest="group", required=True, metavar="COMMAND")

    def command(group: Any, name: str, help_text: str) -> argparse.ArgumentParser:
        made: argparse.ArgumentParser = group.add_parser(
            name, help=help_text, description=help_text, parents=common_options
        )
        return made

    command(sub, "login", "check a URL and key and store them (file mode 0600)").set_defaults(
        func=cmd_login
    )

    sandbox = command(sub, "sandbox", "create, list, use and delete sandboxes").add_subparsers(
        dest="cmd", required=True, metavar="SUBCOMMAND"
    )
    ls = command(sandbox, "ls", "list the team's sandboxes (live ones unless --state)")
    ls.add_argument(
        "--state",
        type=_states,
        default=LIVE_STATES,
        help=f"live (default), all, or a comma list of: {', '.join(STATES)}",
    )
    ls.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    ls.add_argument(
        "--label",
        action="append",
        type=_label_filter,
        metavar="KEY=VALUE|KEY",
        help="only sandboxes with this label value (or, KEY alone, this label); repeatable",
    )
    ls.set_defaults(func=cmd_sandbox_ls)
    label = command(sandbox, "label", "change labels: label ID KEY=VALUE (set) KEY- (remove)...")
    label.add_argument("id", metavar="ID")
    label.add_argument("changes", nargs="+", type=_label_change, metavar="KEY=VALUE|KEY-")
    label.set_defaults(func=cmd_sandbox_label)
    timeout = command(
        sandbox, "timeout", "end a sandbox SECONDS from now (extend or shorten its lifetime)"
    )
    timeout.add_argument("id", metavar="ID")
    timeout.add_argument("seconds", type=int, metavar="SECONDS")
    timeout.set_defaults(func=cmd_sandbox_timeout)
    create = command(sandbox, "create", "create sandboxes, printing each id as it is created")
    create.add_argument("--image", default="host", help="image name (default: host)")
    create.add_argument("--cpu", help="cores: 1, 0.5 or 500m (default 1)")
    create.add_argument("--memory", help="MiB or 512Mi, 2Gi (default 1024 MiB)")
    create.add_argument("--network", action="store_true", help="allow network access")
    create.add_argument(
        "--egress",
        type=_egress,
        help="none, all or a JSON allowlist: "
        '\'{"allow": ["pkg.example.org", "*.git.example.com"]}\' (docs/egress.md)',
    )
    create.add_argument("--ttl", type=int, help="lifetime in seconds (default 3600)")
    create.add_argument(
        "--label", action="append", type=_pair, metavar="KEY=VALUE", help="a label (repeatable)"
    )
    create.add_argument("--count", type=int, default=1, help="how many (default 1)")
    create.add_argument("--no-wait", action="store_true", help="do not wait until ready")
    create.set_defaults(func=cmd_sandbox_create)
    get = command(sandbox, "get", "show one sandbox")
    get.add_argument("id")
    get.set_defaults(func=cmd_sandbox_get)
    rm = command(sandbox, "rm", "delete sandboxes")
    rm.add_argument("ids", nargs="*", metavar="ID")
    rm.add_argument("--all", action="store_true", help="every live sandbox of the team")
    rm.add_argument("-y", "--yes", action="store_true", help="do not ask before --all")
    rm.set_defaults(func=cmd_sandbox_rm)
    run = command(
        sandbox,
        "exec",
        "run a command: exec [OPTIONS] ID -- CMD... (exits with the command's exit code)",
    )
    run.add_argument("id")
    run.add_argument("--cwd", help="working directory")
    run.add_argument("--timeout", type=float, help="seconds (default 600)")
    run.add_argument(
        "--env", action="append", type=_pair, metavar="KEY=VALUE", help="environment variable"
    )
    run.add_argument("--stdin", action="store_true", help="send this process's stdin")
    run.add_argument(
        "--background",
        action="store_true",
        help="start it and print its operation id at once (then: ops get|wait|kill)",
    )
    run.add_argument(
        "--stdin-open",
        action="store_true",
        help="with --background: keep its stdin open for `ops stdin` (EOF: ops stdin --eof)",
    )
    run.add_argument("command", nargs="*", help="the command, after --")
    run.set_defaults(func=cmd_sandbox_exec)
    shell = command(sandbox, "shell", "an interactive shell (or CMD) in a sandbox")
    shell.add_argument("id")
    shell.add_argument("command", nargs="*", help="a command instead of the shell, after --")
    shell.set_defaults(func=cmd_sandbox_shell)
    cp = command(sandbox, "cp", "copy files or trees: SRC DST, one of them ID:/path")
    cp.add_argument("src")
    cp.add_argument("dst")
    cp.set_defaults(func=cmd_sandbox_cp)

    pause = command(sandbox, "pause", "capture the state and release the compute")
    pause.add_argument("id", metavar="ID")
    pause.set_defaults(func=cmd_sandbox_pause)
    resume = command(sandbox, "resume", "restore a paused sandbox (generation + 1)")
    resume.add_argument("id", metavar="ID")
    resume.set_defaults(func=cmd_sandbox_pause)

    image = command(sub, "image", "the team's OCI images").add_subparsers(
        dest="image_cmd", required=True, metavar="SUBCOMMAND"
    )
    pull = command(image, "pull", "pull an image (a progress bar on a terminal)")
    pull.add_argument("reference", help="an OCI reference: python:3.12-slim, ghcr.io/o/i:tag")
    pull.add_argument("--no-wait", action="store_true", help="return once the pull started")
    pull.set_defaults(func=cmd_image)
    command(image, "ls", "list the team's images").set_defaults(func=cmd_image)
    image_rm = command(image, "rm", "forget images (refused while a live sandbox uses one)")
    image_rm.add_argument("ids", nargs="+", metavar="ID")
    image_rm.set_defaults(func=cmd_image)
    image_import = command(image, "import", "upload an OCI layout or `docker save` tarball")
    image_import.add_argument("path", help="a tarball, or an OCI layout directory")
    image_import.add_argument("--reference", required=True, help="the name to give it")
    image_import.set_defaults(func=cmd_image)

    snapshot = command(sub, "snapshot", "capture, list, fork and delete snapshots").add_subparsers(
        dest="snapshot_cmd", required=True, metavar="SUBCOMMAND"
    )
    snap_create = command(snapshot, "create", "capture a sandbox's filesystem state")
    snap_create.add_argument("sandbox", metavar="SANDBOX")
    snap_create.add_argument("--name")
    snap_create.add_argument("--manifest", help="a JSON file: your cognitive state")
    snap_create.add_argument(
        "--probe", action="append", help="a read-only command each child must answer alike"
    )
    snap_create.add_argument("--no-wait", action="store_true", help="return while capturing")
    snap_create.set_defaults(func=cmd_snapshot)
    command(snapshot, "ls", "list the team's snapshots").set_defaults(func=cmd_snapshot)
    snap_fork = command(snapshot, "fork", "start COUNT sandboxes from a snapshot (prints ids)")
    snap_fork.add_argument("id", metavar="ID")
    snap_fork.add_argument("count", type=int, metavar="COUNT")
    snap_fork.add_argument("--no-wait", action="store_true", help="do not wait until ready")
    snap_fork.set_defaults(func=cmd_snapshot)
    snap_rm = command(snapshot, "rm", "delete snapshots (their children keep their state)")
    snap_rm.add_argument("ids", nargs="+", metavar="ID")
    snap_rm.set_defaults(func=cmd_snapshot)

    fs = command(sub, "fs", "files in a sandbox: ls, stat, mkdir, mv, rm, watch").add_subparsers(
        dest="cmd", required=True, metavar="SUBCOMMAND"
    )
    for name, help_text in (
        ("ls", "list a directory: fs ls ID:/path"),
        ("stat", "one entry (a symlink described, not followed)"),
        ("mkdir", "make a directory and its parents"),
        ("mv", "rename: fs mv ID:/from /to"),
        ("rm", "remove a file (a directory with -r)"),
        ("watch", "print each change under a directory as it happens (Ctrl-C stops)"),
    ):
        fs_cmd = command(fs, name, help_text)
        fs_cmd.add_argument("target", type=_remote_path, metavar="ID:/path")
        if name == "mv":
            fs_cmd.add_argument("to", metavar="/to")
        if name in ("rm", "watch"):
            fs_cmd.add_argument(
                "-r", "--recursive", action="store_true", help="a directory and all below it"
            )
        if name == "watch":
            fs_cmd.add_argument("--count", type=int, default=0, help="stop after N changes")
        fs_cmd.set_defaults(func=cmd_fs)
    ops = command(sub, "ops", "recorded execs").add_subparsers(
        dest="cmd", required=True, metavar="SUBCOMMAND"
    )
    op_get = command(ops, "get", "one exec's record, by sandbox and operation id")
    op_get.add_argument("sandbox")
    op_get.add_argument("op")
    op_get.set_defaults(func=cmd_ops_get)
    op_wait = command(ops, "wait", "wait for a (background) exec to end; exits with its code")
    op_wait.add_argument("sandbox")
    op_wait.add_argument("op")
    op_wait.add_argument("--timeout", type=float, help="seconds (default: no limit)")
    op_wait.set_defaults(func=cmd_ops_end)
    op_stdin = command(
        ops, "stdin", "send this process's stdin (or --text) to a command's open stdin"
    )
    op_stdin.add_argument("sandbox")
    op_stdin.add_argument("op")
    op_stdin.add_argument("--text", help="send this text instead of reading stdin")
    op_stdin.add_argument("--eof", action="store_true", help="then close the command's stdin")
    op_stdin.set_defaults(func=cmd_ops_stdin)
    op_kill = command(ops, "kill", "kill a running exec (SIGTERM, SIGKILL after 2 s)")
    op_kill.add_argument("sandbox")
    op_kill.add_argument("op")
    op_kill.set_defaults(func=cmd_ops_end)

    keys = command(sub, "keys", "the team's API keys").add_subparsers(
        dest="keys_cmd", required=True, metavar="SUBCOMMAND"
    )
    command(keys, "ls", "list keys").set_defaults(func=cmd_keys)
    key_create = command(keys, "create", "issue a key (its secret is shown once)")
    key_create.add_argument("name")
    key_create.add_argument("--scopes", nargs="*", help="e.g. read (default: all)")
    key_create.set_defaults(func=cmd_keys)
    key_revoke = command(keys, "revoke", "revoke a key")
    key_revoke.add_argument("id")
    key_revoke.set_defaults(func=cmd_keys)

    traj = command(sub, "trajectories", "export and import episodes (JSONL)").add_subparsers(
        dest="traj_cmd", required=True, metavar="SUBCOMMAND"
    )
    export = command(traj, "export", "write every episode as JSONL")
    export.add_argument("-o", "--output", help="file (default: stdout)")
    export.set_defaults(func=cmd_trajectories)
    imp = command(traj, "import", "import a JSONL file of episodes")
    imp.add_argument("file")
    imp.add_argument("--dry-run", action="store_true", help="validate only")
    imp.set_defaults(func=cmd_trajectories)
    scan = command(traj, "scan", "report secrets by kind: in a JSONL file, or stored ones")
    scan.add_argument("file", nargs="?", help="JSONL file to scan ('-' = stdin); exit 1 if any")
    scan.add_argument(
        "--filter",
        action="append",
        metavar="KEY=VALUE",
        help="without a file: episode filters, e.g. task=t-1 or provenance.policy=ckpt-a",
    )
    scan.set_defaults(func=cmd_trajectories)

    bench = command(sub, "bench", "latency benchmarks through the API").add_subparsers(
        dest="bench_cmd", required=True, metavar="SUBCOMMAND"
    )
    bench_exec = command(bench, "exec", "exec latency through the API")
    bench_exec.add_argument("--n", type=int, default=100, help="execs (default 100)")
    bench_exec.set_defaults(func=cmd_bench)
    bench_create = command(bench, "create", "create→ready→delete latency")
    bench_create.add_argument("--n", type=int, default=10, help="sandboxes (default 10)")
    bench_create.add_argument("--concurrency", type=int, default=4, help="in parallel (default 4)")
    bench_create.set_defaults(func=cmd_bench)
    return parser


def one_line(exc: BaseException) -> str:
    """Every failure the CLI reports is one line: the cause, and what to do about it."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, AuthError):
        text += " (check the key: --key, HEDGEROW_API_KEY or `hedgerow login`)"
    elif isinstance(exc, NotFound) and "does not exist" not in text:
        text += " (check the id: `hedgerow sandbox ls`)"
    elif isinstance(exc, FileNotFoundError):
        text = f"{exc.filename}: no such file or directory (check the path)"
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first ``--`` is the command of exec/shell, never options.
    after: List[str] = []
    if "--" in words:
        at = words.index("--")
        words, after = words[:at], words[at + 1 :]
    args = build_parser().parse_args(words)
    if after:
        if not hasattr(args, "command"):
            build_parser().error("`--` is only for `sandbox exec` and `sandbox shell`")
        args.command = list(args.command) + after
    try:
        return int(args.func(args))
    except HedgerowError as exc:
        if args.json:
            print(json.dumps({"error": {"code": exc.code, "message": exc.message}}))
        print(f"hedgerow: {one_line(exc)}", file=sys.stderr)
        return 1
    except (OSError, httpx.HTTPError) as exc:
        print(f"hedgerow: {one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
