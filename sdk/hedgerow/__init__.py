"""Hedgerow: sandboxes for agent training and evaluation."""

from hedgerow.aio import AsyncClient, AsyncSandbox
from hedgerow.client import Client, Sandbox
from hedgerow.errors import (
    AgentUnreachable,
    AuthError,
    BudgetExhausted,
    Conflict,
    HedgerowError,
    NotFound,
    QuotaExceeded,
    SandboxLost,
    SandboxNotReady,
    SandboxTerminating,
    ValidationError,
    WaitTimeout,
)
from hedgerow.results import ExecResult, StreamInfo

__all__ = [
    "AgentUnreachable",
    "AsyncClient",
    "AsyncSandbox",
    "AuthError",
    "BudgetExhausted",
    "Client",
    "Conflict",
    "ExecResult",
    "HedgerowError",
    "NotFound",
    "QuotaExceeded",
    "Sandbox",
    "SandboxLost",
    "SandboxNotReady",
    "SandboxTerminating",
    "StreamInfo",
    "ValidationError",
    "WaitTimeout",
]
