"""What the sync and async clients share: configuration, retry policy, request bodies."""

from __future__ import annotations

import json
import os
import random
import uuid
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

DEFAULT_URL = "http://127.0.0.1:8000"
VERSION = "0.3.0"  # keep in step with sdk/pyproject.toml and controlplane/version.py
USER_AGENT = f"hedgerow-python/{VERSION}"
Command = Union[str, List[str]]

# Statuses retried only when the server says when (Retry-After): "overloaded, try
# again". A 429 without it (e.g. a quota that will not free itself) raises at once.
RETRY_STATUSES = (429, 503)
CHUNK = 256 * 1024

# Sandboxes the SDK creates (and keeps alive with heartbeats) get this heartbeat timeout
# unless told otherwise: if the program is killed (SIGKILL, OOM, a lost machine) and its
# heartbeats stop, the server deletes them within this many seconds, not at their TTL.
DEFAULT_HEARTBEAT_TIMEOUT_S = 300


def new_sandbox_id() -> str:
    """A client-chosen sandbox id, so a create can be registered for cleanup before it
    is sent (the server accepts ``sandbox_id``)."""
    return f"sb-{uuid.uuid4().hex[:16]}"


def heartbeat_timeout(requested: Optional[int], heartbeat: bool) -> Optional[int]:
    """The heartbeat timeout a create asks for: ``requested`` if given (0 = none), else
    the SDK default while the client heartbeats, else none."""
    if requested is not None:
        return requested or None
    return DEFAULT_HEARTBEAT_TIMEOUT_S if heartbeat else None


def config_path() -> Path:
    """Where ``hedgerow login`` stores the URL and key (``HEDGEROW_CONFIG`` overrides)."""
    explicit = os.environ.get("HEDGEROW_CONFIG")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "hedgerow" / "config.json"


def load_config() -> Dict[str, Any]:
    try:
        data = json.loads(config_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def resolve(url: Optional[str], api_key: Optional[str]) -> Tuple[str, Optional[str]]:
    """Arguments win, then ``HEDGEROW_URL`` / ``HEDGEROW_API_KEY``, then the login file."""
    stored = load_config()
    chosen_url = url or os.environ.get("HEDGEROW_URL") or stored.get("url") or DEFAULT_URL
    key = api_key or os.environ.get("HEDGEROW_API_KEY") or stored.get("api_key")
    return str(chosen_url).rstrip("/"), key


def backoff(attempt: int, retry_after: Optional[str], *, base: float = 0.25) -> float:
    """Exponential backoff with jitter, never shorter than the server's Retry-After."""
    delay = min(base * (2**attempt), 8.0)
    if retry_after:
        try:
            delay = max(delay, float(retry_after))
        except ValueError:
            pass
    return float(delay + random.uniform(0, delay / 2))


def retryable_status(status: int, headers: Any) -> bool:
    return status in RETRY_STATUSES and bool(headers.get("Retry-After"))


def new_idempotency_key() -> str:
    return f"sdk-{uuid.uuid4().hex}"


def new_operation_id() -> str:
    return f"op-{uuid.uuid4().hex}"


def create_body(
    image: str,
    *,
    cpu: Optional[Union[str, float]],
    memory: Optional[Union[str, int]],
    network_access: bool,
    ttl_seconds: Optional[int],
    heartbeat_timeout_s: Optional[int],
    labels: Optional[Dict[str, str]],
    sandbox_id: Optional[str],
    queue: Optional[bool] = None,
    egress: Optional[Any] = None,
) -> Dict[str, Any]:
    body: Dict[str, Any] = {"image": image, "network_access": network_access}
    if egress is not None:
        # the policy alone (network_access only when the caller set it: a mismatch is
        # the server's 400 egress_conflict, not a guess here)
        body["egress"] = egress
        if not network_access:
            del body["network_access"]
    optional = {
        "cpu": cpu,
        "memory": memory,
        "ttl_seconds": ttl_seconds,
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "sandbox_id": sandbox_id,
        "queue": queue,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if labels:
        body["labels"] = labels
    return body


def exec_body(
    command: Command,
    *,
    cwd: Optional[str],
    env: Optional[Dict[str, str]],
    timeout: Optional[float],
    stdin_b64: Optional[str],
    login_shell: bool,
    operation_id: Optional[str],
) -> Dict[str, Any]:
    """The exec request. It always carries an operation id, which is what makes a
    retried exec safe: the server replays the stored (or running) result."""
    body: Dict[str, Any] = {
        "command": command,
        "login_shell": login_shell,
        "operation_id": operation_id or new_operation_id(),
    }
    if cwd is not None:
        body["cwd"] = cwd
    if env:
        body["env"] = env
    if timeout is not None:
        body["timeout"] = timeout
    if stdin_b64 is not None:
        body["stdin"] = stdin_b64
    return body


def exec_http_timeout(timeout: Optional[float]) -> float:
    return (timeout if timeout is not None else 600.0) + 30.0


def patch_body(patch: str, *, cwd: str, timeout: float) -> Dict[str, Any]:
    """The apply_patch request; its operation id makes a retry return the stored result."""
    return {
        "patch": patch,
        "cwd": cwd,
        "timeout": timeout,
        "operation_id": f"patch-{uuid.uuid4().hex}",
    }


def local_files(root: Path) -> List[Tuple[Path, str]]:
    """(local file, path relative to root with '/') for every file under a directory."""
    found: List[Tuple[Path, str]] = []
    for path in sorted(root.rglob("*")):
        if path.is_file():
            found.append((path, path.relative_to(root).as_posix()))
    return found


def local_source(local: Union[str, Path]) -> Path:
    """The local path an upload reads, checked before anything is sent."""
    from hedgerow.errors import LocalPathError

    source = Path(local)
    if not source.exists():
        raise LocalPathError(
            f"{source} does not exist (upload reads it from this machine): check the path, "
            f"relative to {Path.cwd()}",
            code="local_path_missing",
        )
    return source


def file_chunks(path: Path, progress: Any = None) -> Any:
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(CHUNK)
            if not chunk:
                return
            if progress is not None:
                progress(len(chunk))
            yield chunk


def list_params(path: str, limit: Optional[int], cursor: Optional[str]) -> Dict[str, Any]:
    """Query parameters of one page of a file listing."""
    params: Dict[str, Any] = {"path": path}
    if limit is not None:
        params["limit"] = limit
    if cursor:
        params["cursor"] = cursor
    return params


def report_progress(
    data: Mapping[str, Any], seen: Optional[Dict[str, Any]], callback: Any
) -> Optional[Dict[str, Any]]:
    """Calls ``callback`` with a sandbox's image pull ``progress`` when it changed;
    returns the progress now seen."""
    progress = data.get("progress")
    if callback is not None and isinstance(progress, dict) and progress != seen:
        callback(dict(progress))
        return progress
    return seen
