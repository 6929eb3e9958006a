"""The synchronous client. ``HEDGEROW_URL`` and ``HEDGEROW_API_KEY`` configure it."""

from __future__ import annotations

import base64
import builtins
import os
import random
import time
import uuid
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Union

import httpx

from hedgerow.episode import Episode, current_episode
from hedgerow.errors import HedgerowError, error_from_response
from hedgerow.results import ExecResult

DEFAULT_URL = "http://127.0.0.1:8000"
Command = Union[str, list[str]]


class Client:
    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 30.0,
        max_retries: int = 4,
    ) -> None:
        self.url = (url or os.environ.get("HEDGEROW_URL") or DEFAULT_URL).rstrip("/")
        key = api_key or os.environ.get("HEDGEROW_API_KEY")
        if not key:
            raise HedgerowError(
                "no API key: pass api_key= or set HEDGEROW_API_KEY", code="no_api_key"
            )
        self.max_retries = max_retries
        self._http = httpx.Client(
            base_url=self.url + "/api/v1",
            headers={"Authorization": f"Bearer {key}", "User-Agent": "hedgerow-python/0.1"},
            timeout=timeout,
            trust_env=False,
        )

    # -- plumbing ---------------------------------------------------------------
    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Retries connection errors and 429/503 with Retry-After, with backoff + jitter.
        Only idempotent calls reach here with retries on: creates carry an idempotency
        key and execs an operation id, so a retry can never act twice."""
        attempt = 0
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError:
                if attempt >= self.max_retries:
                    raise
                self._sleep(attempt, None)
                attempt += 1
                continue
            if response.status_code in (429, 503) and attempt < self.max_retries:
                self._sleep(attempt, response.headers.get("Retry-After"))
                attempt += 1
                continue
            if response.status_code >= 400:
                try:
                    body = response.json()
                except ValueError:
                    body = None
                raise error_from_response(response.status_code, body, response.text)
            return response

    @staticmethod
    def _sleep(attempt: int, retry_after: str | None) -> None:
        base = min(0.25 * (2**attempt), 8.0)
        if retry_after:
            try:
                base = max(base, float(retry_after))
            except ValueError:
                pass
        time.sleep(base + random.uniform(0, base / 2))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- sandboxes --------------------------------------------------------------
    def create_sandbox(
        self,
        image: str = "host",
        *,
        cpu: str | float | None = None,
        memory: str | int | None = None,
        network_access: bool = False,
        ttl_seconds: int | None = None,
        labels: dict[str, str] | None = None,
        sandbox_id: str | None = None,
        wait: bool = True,
        wait_timeout: float = 120.0,
        idempotency_key: str | None = None,
    ) -> Sandbox:
        body: dict[str, Any] = {"image": image, "network_access": network_access}
        if cpu is not None:
            body["cpu"] = cpu
        if memory is not None:
            body["memory"] = memory
        if ttl_seconds is not None:
            body["ttl_seconds"] = ttl_seconds
        if labels:
            body["labels"] = labels
        if sandbox_id:
            body["sandbox_id"] = sandbox_id
        key = idempotency_key or f"sdk-{uuid.uuid4().hex}"
        data = self.request(
            "POST", "/sandboxes", json=body, headers={"Idempotency-Key": key}
        ).json()
        sandbox = Sandbox(self, data)
        if wait:
            try:
                sandbox.wait(timeout=wait_timeout)
            except BaseException:
                sandbox.delete()
                raise
        return sandbox

    def get(self, sandbox_id: str) -> Sandbox:
        return Sandbox(self, self.request("GET", f"/sandboxes/{sandbox_id}").json())

    def list(self, *, state: str | None = None, limit: int = 50) -> builtins.list[Sandbox]:
        params: dict[str, Any] = {"limit": limit}
        if state:
            params["state"] = state
        body = self.request("GET", "/sandboxes", params=params).json()
        return [Sandbox(self, item) for item in body["results"]]

    def delete(self, sandbox_id: str) -> None:
        self.request("DELETE", f"/sandboxes/{sandbox_id}")


class Sandbox:
    def __init__(self, client: Client, data: dict[str, Any]) -> None:
        self._client = client
        self.data = data

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def state(self) -> str:
        return str(self.data["state"])

    @property
    def generation(self) -> int:
        return int(self.data.get("generation") or 0)

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.state}>"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    def refresh(self) -> Sandbox:
        self.data = self._client.request("GET", f"/sandboxes/{self.id}").json()
        return self

    def wait(self, timeout: float = 120.0) -> Sandbox:
        """Server-side, event-driven wait (long-polls in ≤60 s slices)."""
        deadline = time.monotonic() + timeout
        while True:
            slice_s = max(0.0, min(60.0, deadline - time.monotonic()))
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

    def delete(self) -> None:
        self._client.delete(self.id)

    def heartbeat(self) -> None:
        self._client.request("POST", f"/sandboxes/{self.id}/heartbeat")

    def exec(
        self,
        command: Command,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        login_shell: bool = False,
        operation_id: str | None = None,
    ) -> ExecResult:
        """Runs a command. The operation id makes retries safe: never runs twice."""
        body: dict[str, Any] = {
            "command": command,
            "login_shell": login_shell,
            "operation_id": operation_id or f"op-{uuid.uuid4().hex}",
        }
        if cwd is not None:
            body["cwd"] = cwd
        if env:
            body["env"] = env
        if timeout is not None:
            body["timeout"] = timeout
        if stdin is not None:
            body["stdin"] = base64.b64encode(stdin).decode()
        http_timeout = (timeout or 600.0) + 30.0
        episode = current_episode()  # trajectories hook: see hedgerow/episode.py
        try:
            response = self._client.request(
                "POST", f"/sandboxes/{self.id}/exec", json=body, timeout=http_timeout
            )
        except HedgerowError as exc:
            if episode is not None:
                episode.record_exec(self, body["operation_id"], command, error=exc)
            raise
        if episode is not None:
            episode.record_exec(self, body["operation_id"], command)
        return ExecResult.from_api(response.json())

    # -- trajectories hook ------------------------------------------------------------
    def episode(self, *, task_id: str, **fields: Any) -> Episode:
        """A recorded episode in this sandbox: ``with sandbox.episode(task_id=...) as ep:``.
        Execs made inside the block become steps (see hedgerow.episode)."""
        return Episode(self._client, [self], task_id=task_id, **fields)

    def write_file(
        self, path: str, data: bytes | Iterator[bytes], *, mode: str | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"path": path}
        if mode:
            params["mode"] = mode
        result: dict[str, Any] = self._client.request(
            "PUT",
            f"/sandboxes/{self.id}/files",
            params=params,
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        ).json()
        return result

    def read_file(self, path: str) -> bytes:
        return self._client.request(
            "GET", f"/sandboxes/{self.id}/files", params={"path": path}
        ).content

    def list_files(self, path: str = "/workspace") -> list[dict[str, Any]]:
        body = self._client.request(
            "GET", f"/sandboxes/{self.id}/files/list", params={"path": path}
        ).json()
        return list(body.get("entries", []))
