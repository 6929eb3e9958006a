"""Hedgerow: sandboxes for agent training and evaluation."""

from hedgerow._common import VERSION as __version__
from hedgerow.aio import AsyncClient, AsyncSandbox
from hedgerow.client import Client, Sandbox
from hedgerow.commands import AsyncCommandHandle, CommandHandle
from hedgerow.episode import content_hash
from hedgerow.errors import (
    AgentUnreachable,
    AuthError,
    BudgetExhausted,
    Conflict,
    DiskExhausted,
    HedgerowConnectionError,
    HedgerowError,
    ImageInUse,
    ImageUnavailable,
    InvalidImageReference,
    LocalPathError,
    NotFound,
    QuotaExceeded,
    SandboxDeleted,
    SandboxLost,
    SandboxNotReady,
    SandboxTerminating,
    SnapshotFailed,
    ValidationError,
    WaitTimeout,
)
from hedgerow.images import Image
from hedgerow.records import ApiKeyInfo, FileInfo, FilePage, WrittenFile
from hedgerow.results import ExecError, ExecResult, ServerVersion, StreamInfo
from hedgerow.sandboxes import SandboxPage
from hedgerow.shapes import EpisodeData, ResourceExhausted, SandboxData, SnapshotData
from hedgerow.snapshots import AsyncSnapshot, Snapshot
from hedgerow.watch import AsyncWatcher, FileEvent, Watcher

__all__ = [
    "AgentUnreachable",
    "ApiKeyInfo",
    "AsyncClient",
    "AsyncCommandHandle",
    "AsyncSandbox",
    "AsyncSnapshot",
    "AsyncWatcher",
    "AuthError",
    "BudgetExhausted",
    "Client",
    "CommandHandle",
    "Conflict",
    "DiskExhausted",
    "EpisodeData",
    "ExecError",
    "ExecResult",
    "FileEvent",
    "FileInfo",
    "FilePage",
    "HedgerowConnectionError",
    "HedgerowError",
    "Image",
    "ImageInUse",
    "ImageUnavailable",
    "InvalidImageReference",
    "LocalPathError",
    "NotFound",
    "QuotaExceeded",
    "ResourceExhausted",
    "Sandbox",
    "SandboxData",
    "SandboxDeleted",
    "SandboxLost",
    "SandboxNotReady",
    "SandboxPage",
    "SandboxTerminating",
    "ServerVersion",
    "Snapshot",
    "SnapshotData",
    "SnapshotFailed",
    "StreamInfo",
    "ValidationError",
    "WaitTimeout",
    "Watcher",
    "WrittenFile",
    "__version__",
    "content_hash",
]
