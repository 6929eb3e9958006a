"""``AsyncClient``: the same surface as ``Client``, for asyncio::

    async with AsyncClient() as hr:
        async with await hr.create_sandbox() as sandbox:
            result = await sandbox.exec("echo hi")

Retries, idempotency keys, operation ids and cleanup behave exactly as in the sync
client (interpreter exit and signals are handled by the same registry).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Dict, List, Literal, Optional, Union, overload

import httpx

from hedgerow import _common as common
from hedgerow import _lean, streaming, trees
from hedgerow._common import Command
from hedgerow.aterminal import AsyncTerminal
from hedgerow.cleanup import asent_trace, registry
from hedgerow.commands import AsyncCommandHandle
from hedgerow.episode import AsyncEpisode, current_async_episode
from hedgerow.errors import HedgerowError, NotFound, error_from_response
from hedgerow.images import AsyncImages
from hedgerow.records import ApiKeyInfo, FileInfo, FilePage, WrittenFile
from hedgerow.results import ExecResult, ServerVersion
from hedgerow.sandboxes import AsyncSandboxes, LabelFilter
from hedgerow.shapes import SandboxData
from hedgerow.snapshots import (
    AsyncSnapshot,
    SnapshotRef,
    raise_if_failed,
    snapshot_body,
    snapshot_id,
)
from hedgerow.watch import AsyncWatcher, watch_params

AsyncFileData = Union[bytes, str, Iterator[bytes], AsyncIterator[bytes]]
Progress = Optional[Callable[[int], None]]


class AsyncClient:
    """See ``hedgerow.Client``; every method is a coroutine."""

    def __init__(
        self,
        url: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        timeout: float = 30.0,
        max_retries: int = 4,
        cleanup: bool = True,
        handle_signals: bool = True,
        max_connections: int = 200,
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
        self._created: Dict[str, AsyncSandbox] = {}
        self._http = httpx.AsyncClient(
            base_url=self.url + "/api/v1",
            headers={"Authorization": f"Bearer {key}", "User-Agent": common.USER_AGENT},
            timeout=timeout,
            trust_env=False,
            limits=httpx.Limits(max_connections=max_connections),
        )
        # exec and the other plain JSON calls skip httpx's per-call cost (hedgerow/_lean.py)
        self._lean = _lean.AsyncLeanPool(
            self.url + "/api/v1",
            {"Authorization": f"Bearer {key}", "User-Agent": common.USER_AGENT},
            limit=max_connections,
        )
        self._lean_for: Optional[httpx.AsyncClient] = self._http  # None: all through httpx
        self.images = AsyncImages(self)  # pull / list / get / remove / import_
        self.sandboxes = AsyncSandboxes(self)  # list (every page, filtered) / list_page

    async def request(
        self, method: str, path: str, *, retry: bool = True, **kwargs: Any
    ) -> httpx.Response:
        """See ``Client.request``."""
        attempt = 0
        while True:
            try:
                response = await self._send(method, path, kwargs)
            except httpx.TransportError as exc:
                if not retry or attempt >= self.max_retries:
                    # One line with the cause and the fix, not httpx's frames.
                    raise streaming.connection_failed(self.url, exc) from None
                await asyncio.sleep(common.backoff(attempt, None))
                attempt += 1
                continue
            if (
                retry
                and attempt < self.max_retries
                and common.retryable_status(response.status_code, response.headers)
            ):
                await asyncio.sleep(common.backoff(attempt, response.headers.get("Retry-After")))
                attempt += 1
                continue
            if response.status_code >= 400:
                try:
                    body = response.json()
                except ValueError:
                    body = None
                raise error_from_response(response.status_code, body, response.text)
            return response

    async def _send(self, method: str, path: str, kwargs: Dict[str, Any]) -> httpx.Response:
        """See ``Client._send``."""
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
            return await self._lean.request(method, path, kwargs.get("json"), seconds)
        return await http.request(method, path, **kwargs)

    async def server_version(self) -> ServerVersion:
        """See ``Client.server_version``."""
        body = (await self.request("GET", "/version")).json()
        return ServerVersion.from_api(body, common.VERSION)

    # -- keys -------------------------------------------------------------------
    async def list_keys(self) -> List[ApiKeyInfo]:
        """See ``Client.list_keys``."""
        results = (await self.request("GET", "/keys")).json()["results"]
        return [ApiKeyInfo.from_api(item) for item in results]

    async def create_key(self, name: str, *, scopes: Optional[List[str]] = None) -> ApiKeyInfo:
        """See ``Client.create_key`` (the ``secret`` is shown once)."""
        body: Dict[str, Any] = {"name": name}
        if scopes:
            body["scopes"] = scopes
        return ApiKeyInfo.from_api(
            (await self.request("POST", "/keys", json=body, retry=False)).json()
        )

    async def revoke_key(self, key_id: str) -> ApiKeyInfo:
        """See ``Client.revoke_key``."""
        return ApiKeyInfo.from_api((await self.request("DELETE", f"/keys/{key_id}")).json())

    async def aclose(self) -> None:
        """Closes connections (does not delete sandboxes; leaving ``async with`` does)."""
        await self._http.aclose()
        self._lean.close()

    async def cleanup_sandboxes(self) -> None:
        """Deletes every sandbox this client created and has not deleted yet."""
        # Those a signal's cleanup has not deleted already.
        pending = [s for s in self._created.values() if registry.has(self.url, s.id)]
        results = await asyncio.gather(*(s.delete() for s in pending), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, HedgerowError):
                raise result

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if self.cleanup:
            await self.cleanup_sandboxes()
        await self.aclose()

    def _forget(self, sandbox_id: str) -> None:
        self._created.pop(sandbox_id, None)
        registry.discard(self.url, sandbox_id)

    async def create_sandbox(
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
    ) -> AsyncSandbox:
        """See ``Client.create_sandbox`` (interrupt-safe the same way: the id is
        registered for cleanup before the request is sent; heartbeats run as a task)."""
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
            data = (
                await self.request(
                    "POST",
                    "/sandboxes",
                    json=body,
                    headers={"Idempotency-Key": key},
                    extensions=asent_trace(self.url, chosen_id) if registered else None,
                )
            ).json()
        except HedgerowError as exc:
            if exc.status and registered:  # the server answered: nothing was created
                registry.discard(self.url, chosen_id)
            raise
        sandbox = AsyncSandbox(self, data)
        if self.cleanup:
            self._created[sandbox.id] = sandbox
            registry.confirm(self.url, sandbox.id)
        # A warm pool claim answers ``ready`` already: no /wait round trip.
        if wait and sandbox.state != "ready":
            try:
                await sandbox.wait(timeout=wait_timeout, on_progress=on_progress)
            except BaseException:
                # Unless a signal's cleanup has deleted it already.
                if not self.cleanup or registry.has(self.url, sandbox.id):
                    with contextlib.suppress(HedgerowError):
                        await sandbox.delete()
                raise
        if hb_timeout and heartbeat:
            sandbox.start_heartbeats(max(hb_timeout / 3.0, 1.0))
        return sandbox

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """A sandbox by id (``NotFound`` for another team's or an unknown one)."""
        return AsyncSandbox(self, (await self.request("GET", f"/sandboxes/{sandbox_id}")).json())

    def _sandbox(self, data: SandboxData) -> AsyncSandbox:
        # See ``Client._sandbox``: episode and sandboxes build handles through it.
        return AsyncSandbox(self, data)

    # -- snapshots (docs/snapshots.md) ---------------------------------------------
    async def get_snapshot(self, snapshot: SnapshotRef) -> AsyncSnapshot:
        """See ``Client.get_snapshot``."""
        return AsyncSnapshot(
            self, (await self.request("GET", f"/snapshots/{snapshot_id(snapshot)}")).json()
        )

    async def snapshots(self, *, limit: int = 50) -> List[AsyncSnapshot]:
        """See ``Client.snapshots``."""
        body = (await self.request("GET", "/snapshots", params={"limit": limit})).json()
        return [AsyncSnapshot(self, item) for item in body["results"]]

    async def fork(
        self,
        snapshot: SnapshotRef,
        n: int = 8,
        *,
        wait: bool = True,
        wait_timeout: float = 120.0,
        idempotency_key: Optional[str] = None,
    ) -> List[AsyncSandbox]:
        """See ``Client.fork`` (the children are waited for concurrently)."""
        key = idempotency_key or common.new_idempotency_key()
        data = (
            await self.request(
                "POST",
                f"/snapshots/{snapshot_id(snapshot)}/fork",
                json={"count": n},
                headers={"Idempotency-Key": key},
            )
        ).json()
        children = [AsyncSandbox(self, item) for item in data["sandboxes"]]
        if self.cleanup:
            for child in children:
                registry.add(
                    self.url, self.api_key, child.id,
                    handle_signals=self.handle_signals, confirmed=True,
                )  # fmt: skip
                self._created[child.id] = child
        if wait:
            try:
                await asyncio.gather(
                    *(c.wait(timeout=wait_timeout) for c in children if c.state != "ready")
                )
            except BaseException:
                for child in children:
                    with contextlib.suppress(HedgerowError):
                        await child.delete()
                raise
        return children

    async def list(
        self,
        *,
        state: Optional[str] = None,
        image: Optional[str] = None,
        labels: LabelFilter = None,
        limit: int = 50,
    ) -> List[AsyncSandbox]:
        """See ``Client.list``."""
        return [
            sandbox
            async for sandbox in self.sandboxes.list(
                state=state, image=image, labels=labels, limit=limit, page_size=min(limit, 1000)
            )
        ]

    async def delete(self, sandbox_id: str) -> None:
        """Deletes a sandbox (idempotent: deleting a deleted sandbox succeeds)."""
        await self.request("DELETE", f"/sandboxes/{sandbox_id}")
        self._forget(sandbox_id)

    async def operation(self, sandbox_id: str, operation_id: str) -> ExecResult:
        """A recorded exec, by its operation id."""
        path = f"/sandboxes/{sandbox_id}/operations/{operation_id}"
        return ExecResult.from_api((await self.request("GET", path)).json())


async def _raise_for_stream_async(response: httpx.Response) -> None:
    if response.status_code >= 400:
        await response.aread()
        try:
            body = response.json()
        except ValueError:
            body = None
        raise error_from_response(response.status_code, body, response.text)


class AsyncSandbox:
    """See ``hedgerow.Sandbox``; ``async with`` deletes it at the end of the block."""

    def __init__(self, client: AsyncClient, data: SandboxData) -> None:
        self._client = client
        self.data: SandboxData = data  # the server's JSON as last read
        self._heartbeat_task: Optional[asyncio.Task[None]] = None

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
        return f"<AsyncSandbox {self.id} {self.state}>"

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.delete()

    async def refresh(self) -> AsyncSandbox:
        """Re-reads the sandbox's record (``state``, ``data``) from the server."""
        self.data = (await self._client.request("GET", f"/sandboxes/{self.id}")).json()
        return self

    async def wait(
        self,
        timeout: float = 120.0,
        *,
        on_progress: Optional[Callable[[Dict[str, Any]], None]] = None,
    ) -> AsyncSandbox:
        """See ``Sandbox.wait``."""
        deadline = time.monotonic() + timeout
        seen = common.report_progress(self.data, None, on_progress)
        while True:
            slice_s = max(0.0, min(1.0 if on_progress else 60.0, deadline - time.monotonic()))
            try:
                self.data = (
                    await self._client.request(
                        "GET",
                        f"/sandboxes/{self.id}/wait",
                        params={"timeout": slice_s},
                        timeout=slice_s + 30,
                    )
                ).json()
                return self
            except HedgerowError as exc:
                if exc.code != "wait_timeout" or time.monotonic() >= deadline:
                    raise
            if on_progress is not None:
                seen = common.report_progress((await self.refresh()).data, seen, on_progress)

    async def delete(self) -> None:
        """Deletes the sandbox (and stops its heartbeats); idempotent."""
        self.stop_heartbeats()
        await self._client.delete(self.id)

    async def pause(self) -> AsyncSandbox:
        """See ``Sandbox.pause``."""
        self.stop_heartbeats()
        self.data = (await self._client.request("POST", f"/sandboxes/{self.id}/pause")).json()
        return self

    async def resume(self, *, wait: bool = True, timeout: float = 120.0) -> AsyncSandbox:
        """See ``Sandbox.resume``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.data = (
                    await self._client.request("POST", f"/sandboxes/{self.id}/resume")
                ).json()
                break
            except HedgerowError as exc:
                if exc.code != "sandbox_pausing" or time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)
        if wait:
            await self.wait(timeout=max(1.0, deadline - time.monotonic()))
        return self

    async def snapshot(
        self,
        *,
        name: Optional[str] = None,
        manifest: Optional[Dict[str, Any]] = None,
        probes: Optional[List[Dict[str, Any]]] = None,
        ttl_seconds: Optional[int] = None,
        volatile: Optional[List[str]] = None,
        wait: bool = True,
        timeout: float = 300.0,
    ) -> AsyncSnapshot:
        """See ``Sandbox.snapshot``."""
        body = snapshot_body(
            name=name, manifest=manifest, probes=probes, ttl_seconds=ttl_seconds, volatile=volatile
        )
        data = (
            await self._client.request("POST", f"/sandboxes/{self.id}/snapshots", json=body)
        ).json()
        snap = AsyncSnapshot(self._client, data)
        if wait:
            return await snap.wait(timeout)
        raise_if_failed(snap.data)
        return snap

    @property
    def labels(self) -> Dict[str, str]:
        """As of the last read: the sandbox's labels (``update_labels`` changes them)."""
        return dict(self.data.get("labels") or {})

    async def update_labels(self, changes: Dict[str, Optional[str]]) -> Dict[str, str]:
        """See ``Sandbox.update_labels``."""
        self.data = (
            await self._client.request("PATCH", f"/sandboxes/{self.id}", json={"labels": changes})
        ).json()
        return self.labels

    async def set_timeout(self, seconds: int) -> AsyncSandbox:
        """See ``Sandbox.set_timeout``."""
        self.data = (
            await self._client.request(
                "POST", f"/sandboxes/{self.id}/timeout", json={"timeout": seconds}
            )
        ).json()
        return self

    async def heartbeat(self) -> None:
        """Tells the server the sandbox is still wanted (resets its heartbeat timeout)."""
        await self._client.request("POST", f"/sandboxes/{self.id}/heartbeat")

    def start_heartbeats(self, interval: float) -> None:
        """Heartbeats from a task on the running loop until deleted/stopped."""
        self.stop_heartbeats()

        async def beat() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.heartbeat()
                except HedgerowError as exc:
                    if exc.status in (404, 409):
                        return

        self._heartbeat_task = asyncio.get_running_loop().create_task(beat())

    def stop_heartbeats(self) -> None:
        """Stops the background heartbeats (the heartbeat timeout then runs out)."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            self._heartbeat_task = None

    @overload
    async def exec(
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
    async def exec(
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
    ) -> AsyncCommandHandle: ...

    async def exec(
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
    ) -> Union[ExecResult, AsyncCommandHandle]:
        """See ``Sandbox.exec`` (``background=True`` returns an ``AsyncCommandHandle``)."""
        if background:
            return await self._start_background(
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
        episode = current_async_episode()  # trajectories hook: see hedgerow/episode.py
        try:
            if (on_stdout is not None or on_stderr is not None) and streaming.available():
                started = asyncio.ensure_future(
                    self._client.request(
                        "POST", f"/sandboxes/{self.id}/exec", json={**body, "stream": True}
                    )
                )
                live = await streaming.acollect(self._stream_body(started), on_stdout, on_stderr)
                if episode is not None:
                    episode.record_exec(self, body["operation_id"], command)
                    await episode.flush_if_due()
                return live
            response = await self._client.request(
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
            await episode.flush_if_due()
        result = ExecResult.from_api(response.json())
        if on_stdout is not None and result.stdout:
            on_stdout(result.stdout)
        if on_stderr is not None and result.stderr:
            on_stderr(result.stderr)
        return result

    async def operation(self, operation_id: str) -> ExecResult:
        """See ``Sandbox.operation``."""
        return await self._client.operation(self.id, operation_id)

    async def command(self, operation_id: str) -> AsyncCommandHandle:
        """See ``Sandbox.command``."""
        path = f"/sandboxes/{self.id}/operations/{operation_id}"
        return AsyncCommandHandle(self, (await self._client.request("GET", path)).json())

    async def _start_background(
        self, command: Command, *, cwd: Optional[str], env: Optional[Dict[str, str]],
        timeout: Optional[float], stdin: Optional[bytes], login_shell: bool,
        operation_id: Optional[str], stdin_open: bool = False,
    ) -> AsyncCommandHandle:  # fmt: skip
        body = common.exec_body(
            command,
            cwd=cwd,
            env=env,
            timeout=timeout,
            stdin_b64=base64.b64encode(stdin).decode() if stdin is not None else None,
            login_shell=login_shell,
            operation_id=operation_id,
        )
        episode = current_async_episode()
        try:
            data = (
                await self._client.request(
                    "POST",
                    f"/sandboxes/{self.id}/exec",
                    json={**body, "stream": True, **({"stdin_open": True} if stdin_open else {})},
                )
            ).json()
        except HedgerowError as exc:
            if episode is not None:
                episode.record_exec(self, body["operation_id"], command, error=exc)
            raise
        if episode is not None:
            episode.record_exec(self, body["operation_id"], command)
        handle = AsyncCommandHandle(self, data)
        handle._stdin_offset = len(stdin or b"")  # input is counted from the up-front bytes
        return handle

    def episode(self, *, task_id: str, **fields: Any) -> AsyncEpisode:
        """A recorded episode in this sandbox: ``async with sandbox.episode(task_id=...)
        as ep:``. Execs awaited inside the block become steps (see hedgerow.episode).
        Provenance: ``task_hash`` (``hedgerow.content_hash(task)``), ``policy_checkpoint``,
        ``harness_commit``, ``verifier_commit``, ``sampling``, ``attempt_id``."""
        return AsyncEpisode(self._client, [self], task_id=task_id, **fields)

    # -- live output (hedgerow/streaming.py) ---------------------------------------
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
    ) -> AsyncIterator[streaming.Frame]:
        """``async for frame in sandbox.exec_stream(cmd)``; see ``Sandbox.exec_stream``.
        Call it inside a running loop: the command starts then, before iteration."""
        body = common.exec_body(
            command,
            cwd=cwd,
            env=env,
            timeout=timeout,
            stdin_b64=base64.b64encode(stdin).decode() if stdin is not None else None,
            login_shell=login_shell,
            operation_id=operation_id,
        )
        # The command starts now (a task sends the request as soon as the loop runs),
        # not when iteration begins.
        started = asyncio.ensure_future(
            self._client.request(
                "POST", f"/sandboxes/{self.id}/exec", json={**body, "stream": True}
            )
        )
        episode = current_async_episode()  # trajectories hook: see hedgerow/episode.py
        if episode is None:
            return self._stream_body(started)
        # A refused command surfaces while iterating here: recorded with its error.
        return self._recorded_stream(self._stream_body(started), episode, body, command)

    async def _recorded_stream(
        self,
        frames: AsyncIterator[streaming.Frame],
        episode: AsyncEpisode,
        body: Dict[str, Any],
        command: Command,
    ) -> AsyncIterator[streaming.Frame]:
        error: Optional[HedgerowError] = None
        try:
            async for frame in frames:
                yield frame
        except HedgerowError as exc:
            error = exc
            raise
        finally:
            # Recorded once the stream ends, fails, or is abandoned: the operation
            # exists either way (a refused one is recorded with its error).
            episode.record_exec(self, body["operation_id"], command, error=error)

    async def _stream_body(
        self, started: "asyncio.Future[httpx.Response]"
    ) -> AsyncIterator[streaming.Frame]:
        response = await started
        data = response.json()
        if response.status_code == 200:  # a finished replay: the stored result
            yield streaming.Frame(type="exit", seq=None, result=ExecResult.from_api(data))
            return
        async for frame in streaming.astream_operation(
            self._client.url, self._client.api_key, self.id, str(data["id"])
        ):
            yield frame

    async def _download_tree(
        self, remote: str, target: Path, progress: Progress, on_total: Progress
    ) -> int:
        # One streamed archive, extracted in a worker thread as it arrives.
        async with self._client._http.stream(
            "GET",
            f"/sandboxes/{self.id}/files/archive",
            params={"path": remote},
            timeout=600,
        ) as response:
            await _raise_for_stream_async(response)
            if on_total is not None:
                on_total(int(response.headers.get("X-Tree-Bytes") or 0))
            handoff = trees.QueueChunks()
            extracting = asyncio.ensure_future(asyncio.to_thread(handoff.extract, target, progress))
            try:
                async for chunk in response.aiter_bytes(common.CHUNK):
                    if extracting.done():
                        break  # it failed: its error is raised below
                    await asyncio.to_thread(handoff.put, chunk)
                await asyncio.to_thread(handoff.put, None)
            except BaseException:
                handoff.closed = True
                with contextlib.suppress(Exception):
                    handoff.queue.put_nowait(
                        HedgerowError("download interrupted", code="interrupted")
                    )
                raise
            return int((await extracting)["bytes"])

    async def pty(
        self,
        cmd: Union[None, str, List[str]] = None,
        *,
        rows: int = 24,
        cols: int = 80,
        env: Optional[Dict[str, str]] = None,
        cwd: Optional[str] = None,
    ) -> AsyncTerminal:
        """See ``Sandbox.pty``: ``async with await sandbox.pty() as term``."""
        return await AsyncTerminal.open(
            self._client.url, self._client.api_key, self.id, cmd=cmd, rows=rows, cols=cols,
            env=env, cwd=cwd,
        )  # fmt: skip

    async def write_file(
        self, path: str, data: AsyncFileData, *, mode: Optional[str] = None
    ) -> WrittenFile:
        """See ``Sandbox.write_file`` (``data`` may also be an async iterator)."""
        params: Dict[str, Any] = {"path": path}
        if mode:
            params["mode"] = mode
        if isinstance(data, str):
            data = data.encode()
        return WrittenFile.from_api(
            (
                await self._client.request(
                    "PUT",
                    f"/sandboxes/{self.id}/files",
                    params=params,
                    content=data,
                    headers={"Content-Type": "application/octet-stream"},
                    retry=isinstance(data, bytes),
                    timeout=600,
                )
            ).json()
        )

    async def iter_file(self, path: str) -> AsyncIterator[bytes]:
        """See ``Sandbox.iter_file``: chunks of 256 KiB, constant memory."""
        http = self._client._http
        try:
            async with http.stream(
                "GET", f"/sandboxes/{self.id}/files", params={"path": path}, timeout=600
            ) as response:
                await _raise_for_stream_async(response)
                async for chunk in response.aiter_bytes(common.CHUNK):
                    yield chunk
        except httpx.TransportError as exc:
            raise streaming.connection_failed(self._client.url, exc) from None

    async def read_file(self, path: str) -> bytes:
        """See ``Sandbox.read_file``: the whole file in memory."""
        return b"".join([chunk async for chunk in self.iter_file(path)])

    async def stat(self, path: str) -> FileInfo:
        """See ``Sandbox.stat``."""
        return FileInfo.from_api(
            (
                await self._client.request(
                    "GET", f"/sandboxes/{self.id}/files/stat", params={"path": path}
                )
            ).json()
        )

    async def watch(
        self, path: str, *, recursive: bool = False, include_entry: bool = False
    ) -> AsyncWatcher:
        """See ``Sandbox.watch``."""
        response = await self._client.request(
            "POST",
            f"/sandboxes/{self.id}/files/watch",
            params=watch_params(path, recursive, include_entry),
        )
        return AsyncWatcher(self, response.json())

    async def exists(self, path: str) -> bool:
        """See ``Sandbox.exists``."""
        try:
            await self.stat(path)
        except NotFound:
            return False
        return True

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """See ``Sandbox.remove``."""
        await self._client.request(
            "DELETE",
            f"/sandboxes/{self.id}/files",
            params={"path": path, "recursive": "true" if recursive else "false"},
        )

    async def mkdir(self, path: str) -> FileInfo:
        """See ``Sandbox.mkdir``."""
        return FileInfo.from_api(
            (
                await self._client.request(
                    "POST", f"/sandboxes/{self.id}/files/mkdir", params={"path": path}
                )
            ).json()
        )

    async def rename(self, path: str, to: str) -> FileInfo:
        """See ``Sandbox.rename``."""
        return FileInfo.from_api(
            (
                await self._client.request(
                    "POST", f"/sandboxes/{self.id}/files/rename", params={"path": path, "to": to}
                )
            ).json()
        )

    async def list_files_page(
        self, path: str = "/workspace", *, limit: Optional[int] = None, cursor: Optional[str] = None
    ) -> FilePage:
        """One page of a listing (see ``Sandbox.list_files_page``)."""
        params = common.list_params(path, limit, cursor)
        return FilePage.from_api(
            (
                await self._client.request("GET", f"/sandboxes/{self.id}/files/list", params=params)
            ).json()
        )

    async def list_files(
        self, path: str = "/workspace", *, page_size: int = 1000
    ) -> List[FileInfo]:
        """See ``Sandbox.list_files``."""
        entries: List[FileInfo] = []
        cursor: Optional[str] = None
        while True:
            page = await self.list_files_page(path, limit=page_size, cursor=cursor)
            entries.extend(page.entries)
            cursor = page.next_cursor
            if not cursor:
                return entries

    async def upload(
        self,
        local: Union[str, Path],
        remote: str,
        *,
        progress: Progress = None,
        on_total: Progress = None,
    ) -> int:
        """See ``Sandbox.upload``: a tree goes as one streamed archive."""
        source = common.local_source(local)
        if source.is_dir():
            members, total = trees.local_members(source)
            if on_total is not None:
                on_total(total)

            async def archive() -> AsyncIterator[bytes]:
                for chunk in trees.tar_chunks(members, progress):
                    yield chunk

            await self._client.request(
                "PUT",
                f"/sandboxes/{self.id}/files/archive",
                params={"path": remote},
                content=archive(),
                headers={"Content-Type": "application/x-tar"},
                retry=False,
                timeout=600,
            )
            return total
        size = source.stat().st_size
        if on_total is not None:
            on_total(size)
        await self.write_file(remote, common.file_chunks(source, progress))
        return size

    async def download(
        self,
        remote: str,
        local: Union[str, Path],
        *,
        progress: Progress = None,
        on_total: Progress = None,
    ) -> int:
        """See ``Sandbox.download``: a tree comes as one streamed archive, extracted
        in a worker thread as it arrives."""
        target = Path(local)
        info = await self.stat(remote)
        if info.type == "directory":
            try:
                return await self._download_tree(remote, target, progress, on_total)
            except httpx.TransportError as exc:
                raise streaming.connection_failed(self._client.url, exc) from None
        if on_total is not None:
            on_total(info.size)
        target.parent.mkdir(parents=True, exist_ok=True)
        size = 0
        with open(target, "wb") as handle:
            async for chunk in self.iter_file(remote):
                handle.write(chunk)
                size += len(chunk)
                if progress is not None:
                    progress(len(chunk))
        return size

    async def apply_patch(
        self, patch: str, *, cwd: str = "/workspace", timeout: float = 60.0
    ) -> ExecResult:
        """Applies a unified diff in ``cwd`` (git apply, or patch(1)) as one recorded
        operation; ``result.ok`` says whether it applied."""
        body = common.patch_body(patch, cwd=cwd, timeout=timeout)
        episode = current_async_episode()
        response = await self._client.request(
            "POST",
            f"/sandboxes/{self.id}/apply_patch",
            json=body,
            timeout=common.exec_http_timeout(timeout),
        )
        if episode is not None:
            episode.record_exec(self, body["operation_id"], "apply_patch")
        return ExecResult.from_api(response.json())
