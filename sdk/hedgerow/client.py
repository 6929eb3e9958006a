"""The synchronous client. ``HEDGEROW_URL`` and ``HEDGEROW_API_KEY`` (or ``hedgerow
login``) configure it::

    from hedgerow import Client

    with Client() as hr, hr.create_sandbox() as sandbox:
        print(sandbox.exec("echo hello").stdout)

Every call is safe to retry and is retried on connection errors and on 429/503 with
``Retry-After`` (exponential backoff + jitter): creates carry an idempotency key
generated per logical call, execs an operation id, so a retry never creates or runs
anything twice. ``AsyncClient`` (``hedgerow.aio``) has the same surface.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Callable, Dict, List, Literal, Optional, Union, overload

import httpx

from hedgerow import _common as common
from hedgerow import _lean, streaming, trees
from hedgerow._common import Command
from hedgerow.cleanup import registry, sent_trace
from hedgerow.commands import CommandHandle
from hedgerow.episode import Episode, current_episode
from hedgerow.errors import HedgerowError, NotFound, error_from_response
from hedgerow.images import Images
from hedgerow.records import ApiKeyInfo, FileInfo, FilePage, WrittenFile
from hedgerow.results import ExecResult, ServerVersion
from hedgerow.sandboxes import LabelFilter, Sandboxes
from hedgerow.shapes import SandboxData
from hedgerow.snapshots import Snapshot, SnapshotRef, raise_if_failed, snapshot_body, snapshot_id
from hedgerow.watch import Watcher, watch_params

DEFAULT_URL = common.DEFAULT_URL
FileData = Union[bytes, str, Iterator[bytes], IO[bytes]]
Progress = Optional[Callable[[int], None]]


class Client:
    """A connection to one Hedgerow installation with one API key.

    ``cleanup=True`` (default): sandboxes created through this client are deleted
    when the client's ``with`` block ends, when the interpreter exits, and on
    SIGINT/SIGTERM (``handle_signals=False`` leaves signals alone)."""

    def __init__(
        self,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        timeout: float = 30.0,
        max_retries: int = 4,
        cleanup: bool = True,
        handle_signals: bool = True,
    ) -> None:
        self.url, key = common.resolve(url, api_key)
        if not key:
            raise HedgerowError(
                "no API key: pass api_key=, set HEDGEROW_API_KEY or run `hedgerow login`",
                code="no_api_key",
            )
        self.api_key: str = key
        self.max_retries = max_retries
        self._timeout = timeout
        self.cleanup = cleanup
        self.handle_signals = handle_signals
        self._created: Dict[str, Sandbox] = {}
        if cleanup and handle_signals:
            # Now, from the main thread: creates made from worker threads are covered too.
            registry.install_signal_handlers()
        self._http = httpx.Client(
            base_url=self.url + "/api/v1",
            headers={"Authorization": f"Bearer {key}", "User-Agent": common.USER_AGENT},
            timeout=timeout,
            trust_env=False,
        )
        # exec and the other plain JSON calls skip httpx's per-call cost (hedgerow/_lean.py)
        self._lean = _lean.LeanPool(
            self.url + "/api/v1",
            {"Authorization": f"Bearer {key}", "User-Agent": common.USER_AGENT},
            limit=100,
        )
        self._lean_for: Optional[httpx.Client] = self._http  # None: all through httpx
        self.images = Images(self)  # pull / list / get / remove / import_
        self.sandboxes = Sandboxes(self)  # list (every page, filtered) / list_page

    # -- plumbing ---------------------------------------------------------------
    def request(
        self, method: str, path: str, *, retry: bool = True, **kwargs: Any
    ) -> httpx.Response:
        """One API call. Retries connection errors and 429/503 with Retry-After with
        backoff + jitter (``retry=False`` for bodies that cannot be sent twice, such
        as streamed uploads); raises a typed ``HedgerowError`` for any other error."""
        attempt = 0
        while True:
            try:
                response = self._send(method, path, kwargs)
            except httpx.TransportError as exc:
                if not retry or attempt >= self.max_retries:
                    # One line with the cause and the fix, not httpx's frames.
                    raise streaming.connection_failed(self.url, exc) from None
                time.sleep(common.backoff(attempt, None))
                attempt += 1
                continue
            if (
                retry
                and attempt < self.max_retries
                and common.retryable_status(response.status_code, response.headers)
            ):
                time.sleep(common.backoff(attempt, response.headers.get("Retry-After")))
                attempt += 1
                continue
            if response.status_code >= 400:
                try:
                    body = response.json()
                except ValueError:
                    body = None
                raise error_from_response(response.status_code, body, response.text)
            return response

    def _send(self, method: str, path: str, kwargs: Dict[str, Any]) -> httpx.Response:
        """One attempt of ``request``. A call with a JSON body (or none) and nothing
        else, on a plain path, goes over the lean keep-alive connections
        (hedgerow/_lean.py: ~0.4 ms of client CPU per exec instead of ~2); anything
        else, or a client whose ``_http`` was replaced or given event hooks, through
        httpx."""
        http = self._http
        if (
            http is self._lean_for
            and kwargs.keys() <= {"json", "timeout"}
            and not (http.event_hooks["request"] or http.event_hooks["response"])
            and _lean.plain_path(path)
            and isinstance(kwargs.get("timeout", self._timeout), (int, float))
            and not self._lean.full()
        ):
            seconds = float(kwargs.get("timeout", self._timeout))
            return self._lean.request(method, path, kwargs.get("json"), seconds)
        return http.request(method, path, **kwargs)

    def server_version(self) -> ServerVersion:
        """The server's version and the SDK releases it supports;
        ``.compatible`` says whether this SDK (``hedgerow.__version__``) is one."""
        body = self.request("GET", "/version").json()
        return ServerVersion.from_api(body, common.VERSION)

    def close(self) -> None:
        """Closes connections (does not delete sandboxes; leaving ``with`` does)."""
        self._http.close()
        self._lean.close()

    def cleanup_sandboxes(self) -> None:
        """Deletes every sandbox this client created and has not deleted yet."""
        for sandbox in builtins.list(self._created.values()):
            if not registry.has(self.url, sandbox.id):
                continue  # deleted already (by a signal's cleanup)
            try:
                sandbox.delete()
            except HedgerowError:
                continue

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if self.cleanup:
            self.cleanup_sandboxes()
        self.close()

    def _forget(self, sandbox_id: str) -> None:
        self._created.pop(sandbox_id, None)
        registry.discard(self.url, sandbox_id)

    # -- sandboxes --------------------------------------------------------------
    def create_sandbox(
        self,
        image: str = "host",
        *,
        cpu: Optional[Union[str, float]] = None,
        memory: Optional[Union[str, int]] = None,
        network_access: bool = False,
        ttl_seconds: Optional[int] = None,
        heartbeat_timeout_s: Optional[int] = None,
        labels: Optional[Dict[str, str]] = None,
        sandbox_id: Optional[str] = None,
        wait: bool = True,
        wait_timeout: float = 120.0,
        idempotency_key: Optional[str] = None,
        heartbeat: bool = True,
        queue: Optional[bool] = None,
        on_progress: Optional[Callable[[Dict[str, Any]], None]] = None,
        from_snapshot: Optional[SnapshotRef] = None,
        egress: Optional[Any] = None,
    ) -> Sandbox:
        """Creates a sandbox and (``wait=True``) returns once it is ready; usable as a
        context manager that deletes it. ``from_snapshot``: start from that snapshot's
        state, on its image (``ready`` only once the state matched: docs/snapshots.md).

        Parameters, with units and defaults:

        - ``image``: ``"host"`` (default), a named image, or an OCI reference (below).
        - ``cpu``: cores, as ``1``, ``0.5`` or ``"500m"``; default 1 core.
        - ``memory``: MiB as an integer (``512``) or ``"512Mi"`` / ``"2Gi"``; default
          1024 MiB.
        - ``network_access``: outbound network; default False (no network).
        - ``ttl_seconds``: lifetime in seconds, after which the server deletes it;
          default 3600 s (server setting).
        - ``heartbeat_timeout_s``: seconds, see below; default 300 s.
        - ``labels``: ``{key: value}`` strings, searchable in lists; default none.
        - ``wait`` / ``wait_timeout``: wait for ``ready``, up to 120 s by default
          (``WaitTimeout`` after; the sandbox is then deleted).
        - ``sandbox_id``, ``idempotency_key``: chosen by the SDK unless given.

        Interrupt-safe: the SDK chooses the sandbox id (``sandbox_id`` overrides) and,
        with ``cleanup=True``, registers it for cleanup *before* the request is sent,
        so Ctrl-C at any moment leaves nothing running. One idempotency key covers all
        retries of this call, so a lost response never creates a second sandbox.

        ``heartbeat_timeout_s`` (seconds): the server deletes the sandbox when no
        heartbeat arrives for that long. Default: ``DEFAULT_HEARTBEAT_TIMEOUT_S``
        (300 s) while ``heartbeat=True`` (a background thread then heartbeats every
        third of it), so a killed program's sandboxes go within minutes; ``0`` or
        ``heartbeat=False`` means none (the TTL, default 3600 s, still applies).
        A create answered ``ready`` (a warm pool claim) makes no /wait request.
        ``queue=True``: over a team quota, wait in the admission queue (state ``queued``)
        instead of raising QuotaExceeded; give ``wait_timeout`` room for the wait.

        ``image``: ``host`` (default), a named image, or an OCI reference
        (``python:3.12-slim``, ``ghcr.io/org/img@sha256:…``) pulled with the team's
        registry credentials; an image that cannot be had raises ``ImageUnavailable``
        (its ``code`` says why) at once. ``on_progress(dict)`` is called with the pull's
        ``{"phase", "layers", "bytes", "total"}`` while the sandbox provisions.
        ``egress``: ``"none"``, ``"all"`` or ``{"allow": ["pkg.example.org",
        "*.git.example.com", "10.20.0.0/16:443"]}`` (docs/egress.md)."""
        chosen_id = sandbox_id or common.new_sandbox_id()
        hb_timeout = common.heartbeat_timeout(heartbeat_timeout_s, heartbeat)
        body = common.create_body(
            image,
            cpu=cpu,
            memory=memory,
            network_access=network_access,
            ttl_seconds=ttl_seconds,
            heartbeat_timeout_s=hb_timeout,
            labels=labels,
            sandbox_id=chosen_id,
            queue=queue,
            egress=egress,
        )
        if from_snapshot is not None:
            body["from_snapshot"] = snapshot_id(from_snapshot)
            if image == "host":  # the default: the snapshot's image
                del body["image"]
        key = idempotency_key or common.new_idempotency_key()
        registered = self.cleanup and registry.add(
            self.url, self.api_key, chosen_id,
            handle_signals=self.handle_signals, confirmed=False,
        )  # fmt: skip
        try:
            data = self.request(
                "POST",
                "/sandboxes",
                json=body,
                headers={"Idempotency-Key": key},
                extensions=sent_trace(self.url, chosen_id) if registered else None,
            ).json()
        except HedgerowError as exc:
            if exc.status and registered:  # the server answered: nothing was created
                registry.discard(self.url, chosen_id)
            raise
        sandbox = Sandbox(self, data)
        if self.cleanup:
            self._created[sandbox.id] = sandbox
            registry.confirm(self.url, sandbox.id)
        # A create that claimed a warm pool member answers ``ready`` already: the
        # /wait round trip would only read back what this response says.
        if wait and sandbox.state != "ready":
            try:
                sandbox.wait(timeout=wait_timeout, on_progress=on_progress)
            except BaseException:
                # Unless a signal's cleanup has deleted it already.
                if not self.cleanup or registry.has(self.url, sandbox.id):
                    with contextlib.suppress(HedgerowError):
                        sandbox.delete()
                raise
        if hb_timeout and heartbeat:
            sandbox.start_heartbeats(max(hb_timeout / 3.0, 1.0))
        return sandbox

    def _sandbox(self, data: SandboxData) -> Sandbox:
        # The one place other modules (episode, sandboxes) get a Sandbox from: they
        # take it from the client they were given instead of importing this module
        # back (no import circle).
        return Sandbox(self, data)

    def get(self, sandbox_id: str) -> Sandbox:
        """A sandbox by id (``NotFound`` for another team's or an unknown one)."""
        return Sandbox(self, self.request("GET", f"/sandboxes/{sandbox_id}").json())

    # -- snapshots (docs/snapshots.md) ---------------------------------------------
    def get_snapshot(self, snapshot: SnapshotRef) -> Snapshot:
        """A snapshot by id or object (``NotFound`` for another team's or an unknown
        one): its state (``capturing``, ``ready``, ``failed``), sizes, fingerprint."""
        return Snapshot(self, self.request("GET", f"/snapshots/{snapshot_id(snapshot)}").json())

    def snapshots(self, *, limit: int = 50) -> List[Snapshot]:
        """The team's snapshots, newest first, at most ``limit`` (default 50)."""
        body = self.request("GET", "/snapshots", params={"limit": limit}).json()
        return [Snapshot(self, item) for item in body["results"]]

    def fork(
        self,
        snapshot: SnapshotRef,
        n: int = 8,
        *,
        wait: bool = True,
        wait_timeout: float = 120.0,
        idempotency_key: Optional[str] = None,
    ) -> List[Sandbox]:
        """``n`` sandboxes restored from the snapshot (all or none: a quota that admits
        fewer raises ``QuotaExceeded`` and none is created). One idempotency key covers
        every retry, so a lost response never forks twice. ``wait=True``: returns once
        all are ready; a child whose state did not match the snapshot (its
        ``divergence`` says how) raises ``SandboxNotReady``, after the others were
        deleted. With ``cleanup=True`` they are deleted with the client."""
        key = idempotency_key or common.new_idempotency_key()
        data = self.request(
            "POST",
            f"/snapshots/{snapshot_id(snapshot)}/fork",
            json={"count": n},
            headers={"Idempotency-Key": key},
        ).json()
        children = [Sandbox(self, item) for item in data["sandboxes"]]
        if self.cleanup:
            for child in children:
                registry.add(
                    self.url, self.api_key, child.id,
                    handle_signals=self.handle_signals, confirmed=True,
                )  # fmt: skip
                self._created[child.id] = child
        if wait:
            try:
                for child in children:
                    if child.state != "ready":
                        child.wait(timeout=wait_timeout)
            except BaseException:
                for child in children:
                    with contextlib.suppress(HedgerowError):
                        child.delete()
                raise
        return children

    def list(
        self,
        *,
        state: Optional[str] = None,
        image: Optional[str] = None,
        labels: LabelFilter = None,
        limit: int = 50,
    ) -> List[Sandbox]:
        """Sandboxes of the team, newest first: at most ``limit`` (default 50; more than
        one page is fetched page by page), filtered by ``state`` (e.g. ``ready``, or a
        comma list), ``image`` and ``labels`` (``{key: value}``, or ``{key: None}`` for
        "has the label"). ``client.sandboxes.list()`` iterates without a limit."""
        return [
            sandbox
            for sandbox in self.sandboxes.list(
                state=state, image=image, labels=labels, limit=limit, page_size=min(limit, 1000)
            )
        ]

    def delete(self, sandbox_id: str) -> None:
        """Deletes a sandbox (idempotent: deleting a deleted sandbox succeeds)."""
        self.request("DELETE", f"/sandboxes/{sandbox_id}")
        self._forget(sandbox_id)

    def operation(self, sandbox_id: str, operation_id: str) -> ExecResult:
        """A recorded exec, by its operation id."""
        path = f"/sandboxes/{sandbox_id}/operations/{operation_id}"
        return ExecResult.from_api(self.request("GET", path).json())

    # -- keys -------------------------------------------------------------------
    def list_keys(self) -> List[ApiKeyInfo]:
        """The team's API keys (revoked ones too: ``.revoked``); never their secrets."""
        results = self.request("GET", "/keys").json()["results"]
        return [ApiKeyInfo.from_api(item) for item in results]

    def create_key(self, name: str, *, scopes: Optional[List[str]] = None) -> ApiKeyInfo:
        """Issues a key; its ``secret`` is on the returned record only (shown once).
        ``scopes``: default all of the caller's."""
        body: Dict[str, Any] = {"name": name}
        if scopes:
            body["scopes"] = scopes
        return ApiKeyInfo.from_api(self.request("POST", "/keys", json=body, retry=False).json())

    def revoke_key(self, key_id: str) -> ApiKeyInfo:
        """Revokes a key at once (its requests answer 401 from then on)."""
        return ApiKeyInfo.from_api(self.request("DELETE", f"/keys/{key_id}").json())


def _raise_for_stream(response: httpx.Response) -> None:
    if response.status_code >= 400:
        response.read()
        try:
            body = response.json()
        except ValueError:
            body = None
        raise error_from_response(response.status_code, body, response.text)


class Sandbox:
    """A sandbox. ``with`` deletes it at the end of the block."""

    def __init__(self, client: Client, data: SandboxData) -> None:
        self._client = client
        self.data: SandboxData = data  # the server's JSON as last read
        self._heartbeat_stop: Optional[threading.Event] = None

    @property
    def id(self) -> str:
        """The sandbox id (``sb-`` + 16 hex digits unless chosen otherwise)."""
        return str(self.data["id"])

    @property
    def state(self) -> str:
        """As of the last read: queued, requested, provisioning, ready, terminating,
        deleted or failed."""
        return str(self.data["state"])

    @property
    def generation(self) -> int:
        """Bumped each time the sandbox is re-provisioned (an exec pins one)."""
        return int(self.data.get("generation") or 0)

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.state}>"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def refresh(self) -> Sandbox:
        """Re-reads the sandbox's record (``state``, ``data``) from the server."""
        self.data = self._client.request("GET", f"/sandboxes/{self.id}").json()
        return self

    def wait(
        self,
        timeout: float = 120.0,
        *,
        on_progress: Optional[Callable[[Dict[str, Any]], None]] = None,
    ) -> Sandbox:
        """Server-side, event-driven wait (long-polls in ≤60 s slices; 1 s slices with
        ``on_progress``, which gets each new image pull progress). Raises
        ``SandboxNotReady`` if it fails and ``WaitTimeout`` at the deadline."""
        deadline = time.monotonic() + timeout
        seen = common.report_progress(self.data, None, on_progress)
        while True:
            slice_s = max(0.0, min(1.0 if on_progress else 60.0, deadline - time.monotonic()))
            try:
                self.data = self._client.request(
                    "GET",
                    f"/sandboxes/{self.id}/wait",
                    params={"timeout": slice_s},
                    timeout=slice_s + 30,
                ).json()
                return self
            except HedgerowError as exc:
                if exc.code != "wait_timeout" or time.monotonic() >= deadline:
                    raise
            if on_progress is not None:
                seen = common.report_progress(self.refresh().data, seen, on_progress)

    def delete(self) -> None:
        """Deletes the sandbox (and stops its heartbeats); idempotent."""
        self.stop_heartbeats()
        self._client.delete(self.id)

    def pause(self) -> Sandbox:
        """Captures the filesystem state and releases the compute (state ``paused``;
        docs/snapshots.md). Heartbeats stop: a paused sandbox needs none."""
        self.stop_heartbeats()
        self.data = self._client.request("POST", f"/sandboxes/{self.id}/pause").json()
        return self

    def resume(self, *, wait: bool = True, timeout: float = 120.0) -> Sandbox:
        """Restores a paused sandbox under the same id with ``generation`` + 1 and
        (``wait=True``) returns once it is ready. Retried while the pause is still
        being captured (``sandbox_pausing``)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.data = self._client.request("POST", f"/sandboxes/{self.id}/resume").json()
                break
            except HedgerowError as exc:
                if exc.code != "sandbox_pausing" or time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
        if wait:
            self.wait(timeout=max(1.0, deadline - time.monotonic()))
        return self

    def snapshot(
        self,
        *,
        name: Optional[str] = None,
        manifest: Optional[Dict[str, Any]] = None,
        probes: Optional[List[Dict[str, Any]]] = None,
        ttl_seconds: Optional[int] = None,
        volatile: Optional[List[str]] = None,
        wait: bool = True,
        timeout: float = 300.0,
    ) -> Snapshot:
        """Captures this sandbox's filesystem state (docs/snapshots.md). ``manifest``:
        your cognitive state (messages, model, sampling, seeds); ``probes``: read-only
        commands ``[{"name", "command", "volatile"}]`` every restored child must answer
        alike; ``volatile``: runtime fingerprint parts shown but not compared
        (``"ports"``, ``"port:N"``, ``"processes"``, ``"process:NAME"``, ``"env"``,
        ``"env:NAME"``). ``wait=True`` returns it ``ready`` or raises ``SnapshotFailed``."""
        body = snapshot_body(
            name=name, manifest=manifest, probes=probes, ttl_seconds=ttl_seconds, volatile=volatile
        )
        data = self._client.request("POST", f"/sandboxes/{self.id}/snapshots", json=body).json()
        snap = Snapshot(self._client, data)
        if wait:
            return snap.wait(timeout)
        raise_if_failed(snap.data)
        return snap

    @property
    def labels(self) -> Dict[str, str]:
        """As of the last read: the sandbox's labels (``update_labels`` changes them)."""
        return dict(self.data.get("labels") or {})

    def update_labels(self, changes: Dict[str, Optional[str]]) -> Dict[str, str]:
        """Changes the sandbox's labels and returns them all: ``{key: "value"}`` sets a
        label, ``{key: None}`` removes it, labels not named are kept (at most 32 labels,
        values ≤ 253 characters; ``ValidationError`` otherwise, changing nothing).
        Allowed in any state but the ended ones (``Conflict`` for a deleted sandbox)."""
        self.data = self._client.request(
            "PATCH", f"/sandboxes/{self.id}", json={"labels": changes}
        ).json()
        return self.labels

    def set_timeout(self, seconds: int) -> Sandbox:
        """Sets the remaining lifetime: the server deletes the sandbox ``seconds`` from
        now (longer or shorter than its TTL so far; at most the server's maximum TTL,
        24 h by default). ``SandboxNotReady`` (409) once it is terminating."""
        self.data = self._client.request(
            "POST", f"/sandboxes/{self.id}/timeout", json={"timeout": seconds}
        ).json()
        return self

    def heartbeat(self) -> None:
        """Tells the server the sandbox is still wanted (resets its heartbeat timeout)."""
        self._client.request("POST", f"/sandboxes/{self.id}/heartbeat")

    def start_heartbeats(self, interval: float) -> None:
        """Heartbeats from a daemon thread every ``interval`` s until deleted/stopped."""
        self.stop_heartbeats()
        stop = threading.Event()
        self._heartbeat_stop = stop

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    self.heartbeat()
                except HedgerowError as exc:
                    if exc.status in (404, 409):
                        return  # gone or terminating: nothing left to keep alive

        threading.Thread(target=beat, name=f"hedgerow-heartbeat-{self.id}", daemon=True).start()

    def stop_heartbeats(self) -> None:
        """Stops the background heartbeats (the heartbeat timeout then runs out)."""
        if self._heartbeat_stop is not None:
            self._heartbeat_stop.set()
            self._heartbeat_stop = None

    # -- exec -------------------------------------------------------------------
    @overload
    def exec(
        self,
        command: Command,
        *,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        stdin: Optional[bytes] = None,
        login_shell: bool = False,
        operation_id: Optional[str] = None,
        on_stdout: Optional[Callable[[str], None]] = None,
        on_stderr: Optional[Callable[[str], None]] = None,
        background: Literal[False] = False,
        stdin_open: bool = False,
    ) -> ExecResult: ...

    @overload
    def exec(
        self,
        command: Command,
        *,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        stdin: Optional[bytes] = None,
        login_shell: bool = False,
        operation_id: Optional[str] = None,
        on_stdout: Optional[Callable[[str], None]] = None,
        on_stderr: Optional[Callable[[str], None]] = None,
        background: Literal[True],
        stdin_open: bool = False,
    ) -> CommandHandle: ...

    def exec(
        self,
        command: Command,
        *,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        stdin: Optional[bytes] = None,
        login_shell: bool = False,
        operation_id: Optional[str] = None,
        on_stdout: Optional[Callable[[str], None]] = None,
        on_stderr: Optional[Callable[[str], None]] = None,
        background: bool = False,
        stdin_open: bool = False,
    ) -> Union[ExecResult, CommandHandle]:
        """Runs a command and returns its typed result (``exit_code`` / ``signal`` /
        ``timed_out``, output with truncation info, timings).

        ``timeout``: seconds before the command is killed (server default 600 s).
        ``stdin``: bytes given to it whole (then EOF, unless ``stdin_open``). ``cwd``
        defaults to the sandbox's workdir (``/workspace``). The operation id (one is
        generated) makes retries safe: the command never runs twice. ``on_stdout`` /
        ``on_stderr`` receive the output (live when streaming is available).

        ``background=True`` returns a ``CommandHandle`` as soon as the command has
        started: ``wait()``, ``kill()``, ``output()`` (iterate its frames live), and
        ``sandbox.command(handle.id)`` picks it up again later, from any process. With
        ``stdin_open=True`` (background only) its stdin stays open after ``stdin``:
        ``handle.send_stdin(data)`` writes to it while it runs, ``handle.close_stdin()``
        sends EOF."""
        if background:
            return self._start_background(
                command, cwd=cwd, env=env, timeout=timeout, stdin=stdin,
                login_shell=login_shell, operation_id=operation_id, stdin_open=stdin_open,
            )  # fmt: skip
        if stdin_open:
            raise ValueError(
                "stdin_open=True needs background=True (send input through its handle)"
            )
        body = common.exec_body(
            command,
            cwd=cwd,
            env=env,
            timeout=timeout,
            stdin_b64=base64.b64encode(stdin).decode() if stdin is not None else None,
            login_shell=login_shell,
            operation_id=operation_id,
        )
        episode = current_episode()  # trajectories hook: see hedgerow/episode.py
        live = (on_stdout is not None or on_stderr is not None) and streaming.available()
        try:
            if live:
                # Callbacks get output as it is produced (streaming.py); the result is
                # the same typed record.
                result = streaming.collect(self._stream_body(body), on_stdout, on_stderr)
                if episode is not None:
                    episode.record_exec(self, body["operation_id"], command)
                return result
            response = self._client.request(
                "POST",
                f"/sandboxes/{self.id}/exec",
                json=body,
                timeout=common.exec_http_timeout(timeout),
            )
        except HedgerowError as exc:
            if episode is not None:
                episode.record_exec(self, body["operation_id"], command, error=exc)
            raise
        if episode is not None:
            episode.record_exec(self, body["operation_id"], command)
        result = ExecResult.from_api(response.json())
        if on_stdout is not None and result.stdout:
            on_stdout(result.stdout)
        if on_stderr is not None and result.stderr:
            on_stderr(result.stderr)
        return result

    def operation(self, operation_id: str) -> ExecResult:
        """A recorded exec's result, by its operation id (running ones too)."""
        return self._client.operation(self.id, operation_id)

    def command(self, operation_id: str) -> CommandHandle:
        """A handle on a command started earlier (``exec(..., background=True)``), by
        its operation id: reconnect to it from another process, wait, kill, read."""
        path = f"/sandboxes/{self.id}/operations/{operation_id}"
        return CommandHandle(self, self._client.request("GET", path).json())

    def _start_background(
        self, command: Command, *, cwd: Optional[str], env: Optional[Dict[str, str]],
        timeout: Optional[float], stdin: Optional[bytes], login_shell: bool,
        operation_id: Optional[str], stdin_open: bool = False,
    ) -> CommandHandle:  # fmt: skip
        body = common.exec_body(
            command,
            cwd=cwd,
            env=env,
            timeout=timeout,
            stdin_b64=base64.b64encode(stdin).decode() if stdin is not None else None,
            login_shell=login_shell,
            operation_id=operation_id,
        )
        episode = current_episode()
        try:
            data = self._client.request(
                "POST",
                f"/sandboxes/{self.id}/exec",
                json={**body, "stream": True, **({"stdin_open": True} if stdin_open else {})},
            ).json()
        except HedgerowError as exc:
            if episode is not None:
                episode.record_exec(self, body["operation_id"], command, error=exc)
            raise
        if episode is not None:
            episode.record_exec(self, body["operation_id"], command)
        handle = CommandHandle(self, data)
        handle._stdin_offset = len(stdin or b"")  # input is counted from the up-front bytes
        return handle

    # -- trajectories hook ------------------------------------------------------------
    def episode(self, *, task_id: str, **fields: Any) -> Episode:
        """A recorded episode in this sandbox: ``with sandbox.episode(task_id=...) as ep:``.
        Execs made inside the block become steps (see hedgerow.episode). Provenance:
        ``task_hash`` (``hedgerow.content_hash(task)``), ``policy_checkpoint``,
        ``harness_commit``, ``verifier_commit``, ``sampling``, ``attempt_id``."""
        return Episode(self._client, [self], task_id=task_id, **fields)

    # -- files ------------------------------------------------------------------
    # -- live output and terminals (hedgerow/streaming.py) ------------------------
    def exec_stream(
        self,
        command: Command,
        *,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        stdin: Optional[bytes] = None,
        login_shell: bool = False,
        operation_id: Optional[str] = None,
    ) -> Iterator[streaming.Frame]:
        """``for frame in sandbox.exec_stream(cmd)``: start/stdout/stderr frames as the
        command runs, then one ``exit`` frame whose ``result`` is the typed ExecResult.
        The command starts when ``exec_stream`` is called, not when iteration begins.
        A dropped socket is resumed where it stopped (no frame lost or repeated).
        Inside an episode the command is recorded as a step, as ``exec`` does."""
        body = common.exec_body(
            command,
            cwd=cwd,
            env=env,
            timeout=timeout,
            stdin_b64=base64.b64encode(stdin).decode() if stdin is not None else None,
            login_shell=login_shell,
            operation_id=operation_id,
        )
        episode = current_episode()  # trajectories hook: see hedgerow/episode.py
        if episode is None:
            return self._stream_body(body)
        try:
            frames = self._stream_body(body)
        except HedgerowError as exc:  # refused: recorded with its error
            episode.record_exec(self, body["operation_id"], command, error=exc)
            raise
        return self._recorded_stream(frames, episode, body, command)

    def _recorded_stream(
        self,
        frames: Iterator[streaming.Frame],
        episode: Episode,
        body: Dict[str, Any],
        command: Command,
    ) -> Iterator[streaming.Frame]:
        error: Optional[HedgerowError] = None
        try:
            yield from frames
        except HedgerowError as exc:
            error = exc
            raise
        finally:
            # Recorded once the stream ends, fails, or is abandoned: the operation
            # exists either way (a refused one is recorded with its error).
            episode.record_exec(self, body["operation_id"], command, error=error)

    def _stream_body(self, body: Dict[str, Any]) -> Iterator[streaming.Frame]:
        # The command starts here, at the call; iterating only reads its frames.
        response = self._client.request(
            "POST", f"/sandboxes/{self.id}/exec", json={**body, "stream": True}
        )
        return self._frames_of(response.status_code, response.json())

    def _frames_of(self, status: int, data: Dict[str, Any]) -> Iterator[streaming.Frame]:
        if status == 200:  # a finished replay: the stored result
            yield streaming.Frame(type="exit", seq=None, result=ExecResult.from_api(data))
            return
        yield from streaming.stream_operation(
            self._client.url, self._client.api_key, self.id, str(data["id"])
        )

    def pty(
        self,
        cmd: Union[None, str, List[str]] = None,
        *,
        rows: int = 24,
        cols: int = 80,
        env: Optional[Dict[str, str]] = None,
        cwd: Optional[str] = None,
    ) -> streaming.Terminal:
        """An interactive terminal (``with sandbox.pty() as term: term.write(b"ls\\n")``);
        closing it kills the session's processes."""
        return streaming.Terminal(
            self._client.url, self._client.api_key, self.id, cmd=cmd, rows=rows, cols=cols,
            env=env, cwd=cwd,
        )  # fmt: skip

    def write_file(self, path: str, data: FileData, *, mode: Optional[str] = None) -> WrittenFile:
        """Writes a file atomically (temp file + rename; parents created). ``data`` may
        be bytes, text (UTF-8), an iterator of byte chunks or a binary file object;
        non-bytes are streamed (up to the server's upload limit, 1 GiB by default).
        ``mode``: octal text (``"0755"``); default: a replaced file keeps its mode, a
        new one gets 0666 minus the umask."""
        params: Dict[str, Any] = {"path": path}
        if mode:
            params["mode"] = mode
        if isinstance(data, str):
            data = data.encode()
        replayable = isinstance(data, bytes)
        if hasattr(data, "read"):
            stream: Any = data

            def chunks() -> Iterator[bytes]:
                while True:
                    chunk = stream.read(common.CHUNK)
                    if not chunk:
                        return
                    yield chunk

            data = chunks()
        written = self._client.request(
            "PUT",
            f"/sandboxes/{self.id}/files",
            params=params,
            content=data,
            headers={"Content-Type": "application/octet-stream"},
            retry=replayable,
            timeout=600,
        ).json()
        return WrittenFile.from_api(written)

    def read_file(self, path: str) -> bytes:
        """The whole file in memory; use ``iter_file`` or ``download`` for big files."""
        return b"".join([chunk for chunk in self.iter_file(path)])

    def iter_file(self, path: str) -> Iterator[bytes]:
        """Streams a file's bytes in chunks (constant memory, any size)."""
        http = self._client._http
        try:
            with http.stream(
                "GET", f"/sandboxes/{self.id}/files", params={"path": path}, timeout=600
            ) as response:
                _raise_for_stream(response)
                yield from response.iter_bytes(common.CHUNK)
        except httpx.TransportError as exc:
            raise streaming.connection_failed(self._client.url, exc) from None

    def stat(self, path: str) -> FileInfo:
        """The entry at ``path`` (a symlink described, not followed); ``NotFound``
        when there is none."""
        return FileInfo.from_api(
            self._client.request(
                "GET", f"/sandboxes/{self.id}/files/stat", params={"path": path}
            ).json()
        )

    def watch(self, path: str, *, recursive: bool = False, include_entry: bool = False) -> Watcher:
        """Starts watching a directory (``recursive``: its whole tree; default only
        its entries) and returns a ``Watcher``: ``watcher.events(wait=S)`` returns what
        changed since the last read (``FileEvent``: ``name`` relative to ``path``,
        ``type`` create/remove/write/chmod/rename), waiting up to S seconds (≤ 60);
        ``for event in watcher`` follows changes as they happen; ``stop()`` (or
        leaving ``with``) ends it. At most 16 watchers per sandbox and 10000 entries
        per tree (``ValidationError`` ``too_many_entries``); changes between two reads
        are coalesced. ``NotFound`` when ``path`` does not exist. ``include_entry``:
        each event of a name that exists after the change carries its ``entry``
        (``FileInfo``, as ``stat`` answers it)."""
        response = self._client.request(
            "POST",
            f"/sandboxes/{self.id}/files/watch",
            params=watch_params(path, recursive, include_entry),
        )
        return Watcher(self, response.json())

    def exists(self, path: str) -> bool:
        """Whether anything (file, directory, symlink — even a broken one) is at
        ``path``."""
        try:
            self.stat(path)
        except NotFound:
            return False
        return True

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Removes a file, symlink or empty directory; ``recursive=True`` removes a
        whole tree. ``NotFound`` when nothing is there."""
        self._client.request(
            "DELETE",
            f"/sandboxes/{self.id}/files",
            params={"path": path, "recursive": "true" if recursive else "false"},
        )

    def mkdir(self, path: str) -> FileInfo:
        """Creates a directory and its parents; an existing one is success."""
        return FileInfo.from_api(
            self._client.request(
                "POST", f"/sandboxes/{self.id}/files/mkdir", params={"path": path}
            ).json()
        )

    def rename(self, path: str, to: str) -> FileInfo:
        """Renames (moves) ``path`` to ``to`` inside the sandbox (parents created, a
        file there replaced); returns the entry at ``to``."""
        return FileInfo.from_api(
            self._client.request(
                "POST", f"/sandboxes/{self.id}/files/rename", params={"path": path, "to": to}
            ).json()
        )

    def list_files_page(
        self, path: str = "/workspace", *, limit: Optional[int] = None, cursor: Optional[str] = None
    ) -> FilePage:
        """One page of a listing, sorted by name: ``entries`` and ``next_cursor`` (None
        on the last page). ``limit``: entries per page (server default 1000, max
        10000)."""
        params = common.list_params(path, limit, cursor)
        return FilePage.from_api(
            self._client.request("GET", f"/sandboxes/{self.id}/files/list", params=params).json()
        )

    def list_files(self, path: str = "/workspace", *, page_size: int = 1000) -> List[FileInfo]:
        """Every entry of the directory (default ``/workspace``), sorted by name,
        fetched ``page_size`` entries at a time."""
        entries: List[FileInfo] = []
        cursor: Optional[str] = None
        while True:
            page = self.list_files_page(path, limit=page_size, cursor=cursor)
            entries.extend(page.entries)
            cursor = page.next_cursor
            if not cursor:
                return entries

    def upload(
        self,
        local: Union[str, Path],
        remote: str,
        *,
        progress: Progress = None,
        on_total: Progress = None,
    ) -> int:
        """Uploads a local file, or a directory tree as one streamed archive (modes,
        symlinks and empty directories kept; files already under ``remote`` replaced,
        others kept), to ``remote``. Returns the bytes of file content sent.
        ``on_total(n)`` is called once with the total before the first
        ``progress(n)``, which gets each chunk's size. A missing local path raises
        ``LocalPathError`` before anything is sent."""
        source = common.local_source(local)
        if source.is_dir():
            members, total = trees.local_members(source)
            if on_total is not None:
                on_total(total)
            self._client.request(
                "PUT",
                f"/sandboxes/{self.id}/files/archive",
                params={"path": remote},
                content=trees.tar_chunks(members, progress),
                headers={"Content-Type": "application/x-tar"},
                retry=False,
                timeout=600,
            )
            return total
        size = source.stat().st_size
        if on_total is not None:
            on_total(size)
        self.write_file(remote, common.file_chunks(source, progress))
        return size

    def download(
        self,
        remote: str,
        local: Union[str, Path],
        *,
        progress: Progress = None,
        on_total: Progress = None,
    ) -> int:
        """Downloads a file, or a directory tree as one streamed archive (modes,
        symlinks and empty directories kept), to ``local``; returns the bytes of file
        content received. ``on_total(n)`` is called once with the total (for a tree,
        the server's count of its files' bytes) before ``progress(n)`` gets chunks."""
        target = Path(local)
        info = self.stat(remote)
        if info.type == "directory":
            try:
                return self._download_tree(remote, target, progress, on_total)
            except httpx.TransportError as exc:
                raise streaming.connection_failed(self._client.url, exc) from None
        if on_total is not None:
            on_total(info.size)
        target.parent.mkdir(parents=True, exist_ok=True)
        size = 0
        with open(target, "wb") as handle:
            for chunk in self.iter_file(remote):
                handle.write(chunk)
                size += len(chunk)
                if progress is not None:
                    progress(len(chunk))
        return size

    def _download_tree(
        self, remote: str, target: Path, progress: Progress, on_total: Progress
    ) -> int:
        with self._client._http.stream(
            "GET",
            f"/sandboxes/{self.id}/files/archive",
            params={"path": remote},
            timeout=600,
        ) as response:
            _raise_for_stream(response)
            if on_total is not None:
                on_total(int(response.headers.get("X-Tree-Bytes") or 0))
            reader = trees.ChunkReader(response.iter_bytes(common.CHUNK))
            return trees.extract(target, reader, progress)["bytes"]

    def apply_patch(
        self, patch: str, *, cwd: str = "/workspace", timeout: float = 60.0
    ) -> ExecResult:
        """Applies a unified diff in ``cwd`` (git apply, or patch(1)); ``result.ok``
        says whether it applied, stdout/stderr say why not."""
        body = common.patch_body(patch, cwd=cwd, timeout=timeout)
        episode = current_episode()
        response = self._client.request(
            "POST",
            f"/sandboxes/{self.id}/apply_patch",
            json=body,
            timeout=common.exec_http_timeout(timeout),
        )
        if episode is not None:
            episode.record_exec(self, body["operation_id"], "apply_patch")
        return ExecResult.from_api(response.json())
