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
    ValidationError,
    WaitTimeout,
)
from hedgerow.images import Image
from hedgerow.results import ExecError, ExecResult, ServerVersion, StreamInfo

__all__ = [
    "AgentUnreachable",
    "AsyncClient",
    "AsyncSandbox",
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
    "ServerVersion",
    "StreamInfo",
    "ValidationError",
    "WaitTimeout",
    "__version__",
]
