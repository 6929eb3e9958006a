"""Hedgerow: sandboxes for agent training and evaluation."""

from hedgerow._common import VERSION as __version__
from hedgerow.aio import AsyncClient, AsyncSandbox
from hedgerow.client import Client, Sandbox
from hedgerow.errors import (
    AgentUnreachable,
    AuthError,
    BudgetExhausted,
    Conflict,
    DiskExhausted,
    HedgerowError,
    ImageInUse,
    ImageUnavailable,
    InvalidImageReference,
    NotFound,
    QuotaExceeded,
    SandboxLost,
    SandboxNotReady,
    SandboxTerminating,
    SnapshotFailed,
    ValidationError,
    WaitTimeout,
)
from hedgerow.images import Image
from hedgerow.results import ExecError, ExecResult, StreamInfo
from hedgerow.snapshots import AsyncSnapshot, Snapshot

__all__ = [
    "AgentUnreachable",
    "AsyncClient",
    "AsyncSandbox",
    "AsyncSnapshot",
    "AuthError",
    "BudgetExhausted",
    "Client",
    "Conflict",
    "DiskExhausted",
    "ExecError",
    "ExecResult",
    "HedgerowError",
    "Image",
    "ImageInUse",
    "ImageUnavailable",
    "InvalidImageReference",
    "NotFound",
    "QuotaExceeded",
    "Sandbox",
    "SandboxLost",
    "SandboxNotReady",
    "SandboxTerminating",
    "Snapshot",
    "SnapshotFailed",
    "StreamInfo",
    "ValidationError",
    "WaitTimeout",
    "__version__",
]
