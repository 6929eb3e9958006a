"""The Kubernetes API as the backend uses it: a request rate, bounded concurrency,
retries with backoff.

Every call goes through ``KubeApi.call``: at most ``api_qps`` requests per second on
average (``api_burst`` at once; a token bucket, as client-go's), at most
``max_concurrency`` in flight per process (a burst of creates must not stampede the API
server), and 429, 5xx and connection errors are retried with exponential backoff and
jitter. A 429's ``Retry-After`` holds *every* call of the process until it has passed,
not only the one that got it: the server said it is overloaded, and N threads each
retrying on their own would be the storm it asked to stop. Other API errors surface at
once as ``ApiException``; exhausted retries become a transient ``BackendError`` so
Celery retries the task. Watches are long-lived and not counted.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

from apps.sandboxes.backends.base import BackendError

from .config import KubernetesConfig

T = TypeVar("T")
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class RateLimiter:
    """A token bucket: ``qps`` requests per second on average, ``burst`` at once
    (``qps`` 0: no rate limit). ``hold`` stops every caller until a moment (a 429's
    ``Retry-After``). A caller reserves its token and sleeps outside the lock, so
    waiting callers queue in order instead of polling."""

    def __init__(
        self,
        qps: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.qps = qps
        self.burst = max(1, burst)
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(self.burst)
        self._updated = clock()
        self._not_before = 0.0
        self._lock = threading.Lock()
        self.waited_s = 0.0  # observed by tests and the benchmark

    def acquire(self) -> float:
        """Takes a token, sleeping as long as needed; returns the seconds slept."""
        with self._lock:
            now = self._clock()
            wait = max(0.0, self._not_before - now)
            if self.qps > 0:
                self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.qps)
                self._updated = now
                self._tokens -= 1
                if self._tokens < 0:
                    wait = max(wait, -self._tokens / self.qps)
            self.waited_s += wait
        if wait > 0:
            self._sleep(wait)
        return wait

    def hold(self, seconds: float) -> None:
        with self._lock:
            self._not_before = max(self._not_before, self._clock() + seconds)


class KubeApi:
    def __init__(
        self, api_client: client.ApiClient, config: KubernetesConfig, backoff_s: float = 0.2
    ) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.net = client.NetworkingV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)  # CiliumNetworkPolicies, VolumeSnapshots
        self.config = config
        self.backoff_s = backoff_s
        self._slots = threading.BoundedSemaphore(config.max_concurrency)
        self.limiter = RateLimiter(config.api_qps, config.api_burst)
        self.retries_done = 0  # observed by tests and logged by operators

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        # (connect, read): the client ignores a bare float, so a request to a stalled
        # API server would otherwise wait forever
        kwargs.setdefault("_request_timeout", request_timeout(self.config.api_timeout_s))
        attempts = self.config.api_retries
        for attempt in range(attempts):
            delay: float | None = None
            self.limiter.acquire()  # before taking a slot: a waiting call holds none
            try:
                with self._slots:
                    return fn(*args, **kwargs)
            except ApiException as exc:
                if exc.status not in RETRYABLE_STATUS or attempt == attempts - 1:
                    if exc.status in RETRYABLE_STATUS:
                        raise BackendError(
                            f"Kubernetes API {exc.status} after {attempts} attempts: {exc.reason}",
                            transient=True,
                        ) from exc
                    raise
                delay = _retry_after(exc)
                if delay is not None and exc.status == 429:
                    self.limiter.hold(delay)  # every call of this process waits it out
                    delay = 0.0  # the next acquire() does the waiting
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                if attempt == attempts - 1:
                    raise BackendError(
                        f"Kubernetes API unreachable after {attempts} attempts: {exc}",
                        transient=True,
                    ) from exc
            self.retries_done += 1
            if delay is None:
                delay = min(self.backoff_s * (2**attempt), 10.0)
                delay *= 0.5 + random.random()  # jitter: callers retrying together spread out
            time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    # ---- calls the generated client has no method for ---------------------------

    def apply(self, path: str, body: dict[str, Any], response_type: str) -> Any:
        """Server-side apply (``PATCH`` as ``application/apply-patch+yaml``, JSON being
        YAML) as field manager ``hedgerow``, forcing ownership of the fields we set:
        the API server converges the object to ``body`` whoever changed it last."""
        return self.call(
            self.api_client.call_api,
            path,
            "PATCH",
            query_params=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            header_params={
                "Content-Type": "application/apply-patch+yaml",
                "Accept": "application/json",
            },
            body=body,
            response_type=response_type,
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
        )

    def list_metadata(self, path: str, label_selector: str) -> list[dict[str, Any]]:
        """Every object under ``path`` matching the selector, metadata only
        (``PartialObjectMetadataList``): never the data of a Secret. Paginated."""
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            query: list[tuple[str, Any]] = [
                ("labelSelector", label_selector),
                ("limit", self.config.list_page_size),
            ]
            if token:
                query.append(("continue", token))
            page = self.call(
                self.api_client.call_api,
                path,
                "GET",
                query_params=query,
                header_params={"Accept": METADATA_LIST_ACCEPT},
                response_type="object",
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
            )
            items += list(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token:
                return items

    def list_json(self, path: str, **query: str) -> tuple[list[dict[str, Any]], str]:
        """A paginated LIST of ``path`` read as raw JSON (``_preload_content=False``):
        (every item as the API server's dict, camelCase; the list's resourceVersion).
        The generated client's models are skipped on purpose: deserialising 10,000
        pods into them cost 16 s of CPU per list, the JSON parse a small part of it.
        A continue token the API server expired (410) starts over."""
        for _attempt in range(3):
            items: list[dict[str, Any]] = []
            token = ""
            try:
                while True:
                    params: list[tuple[str, Any]] = [
                        *query.items(),
                        ("limit", self.config.list_page_size),
                    ]
                    if token:
                        params.append(("continue", token))
                    response = self.call(
                        self.api_client.call_api,
                        path,
                        "GET",
                        query_params=params,
                        header_params={"Accept": "application/json"},
                        auth_settings=["BearerToken"],
                        _return_http_data_only=True,
                        _preload_content=False,
                    )
                    page = json.loads(response.data)
                    items += page.get("items") or []
                    meta = page.get("metadata") or {}
                    token = meta.get("continue") or ""
                    if not token:
                        return items, meta.get("resourceVersion") or ""
            except ApiException as exc:
                if exc.status != 410 or not token:
                    raise
                continue  # the snapshot expired between pages: list again from the start
        raise BackendError("list kept expiring between pages", transient=True)


FIELD_MANAGER = "hedgerow"
METADATA_LIST_ACCEPT = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


def request_timeout(seconds: float) -> tuple[float, float]:
    """The client's per-request timeout, (connect, read)."""
    return (min(seconds, 10.0), seconds)


def _retry_after(exc: ApiException) -> float | None:
    headers = exc.headers or {}
    raw = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return min(float(raw), 30.0) if raw is not None else None
    except ValueError:
        return None


def is_status(exc: BaseException, status: int) -> bool:
    return isinstance(exc, ApiException) and exc.status == status
