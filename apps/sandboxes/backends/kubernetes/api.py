"""The Kubernetes API as the backend uses it: bounded concurrency, retries with backoff.

Every call goes through ``KubeApi.call``: at most ``max_concurrency`` requests in
flight per process (a burst of creates must not stampede the API server), and 429,
5xx and connection errors are retried with exponential backoff and jitter (honouring
``Retry-After``). Other API errors surface at once as ``ApiException``; exhausted
retries become a transient ``BackendError`` so Celery retries the task.
"""

from __future__ import annotations

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


class KubeApi:
    def __init__(
        self, api_client: client.ApiClient, config: KubernetesConfig, backoff_s: float = 0.2
    ) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.net = client.NetworkingV1Api(api_client)
        self.config = config
        self.backoff_s = backoff_s
        self._slots = threading.BoundedSemaphore(config.max_concurrency)
        self.retries_done = 0  # observed by tests and logged by operators

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        kwargs.setdefault("_request_timeout", self.config.api_timeout_s)
        attempts = self.config.api_retries
        for attempt in range(attempts):
            delay: float | None = None
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


def _retry_after(exc: ApiException) -> float | None:
    headers = exc.headers or {}
    raw = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return min(float(raw), 30.0) if raw is not None else None
    except ValueError:
        return None


def is_status(exc: BaseException, status: int) -> bool:
    return isinstance(exc, ApiException) and exc.status == status
