"""The sync client is the async client with ``async``/``await`` taken out (issue 18 and
issue 26 defect 5: the two flavours must not be hand-kept mirrors that drift).

For every class pair (``AsyncClient``/``Client``, ``AsyncSandbox``/``Sandbox``, …) each
async method is turned into its sync twin mechanically, as ``unasync`` does:
``async def`` → ``def``, ``await x`` → ``x``, ``async with``/``async for`` → ``with``/
``for``, ``Async*`` names → their sync names, ``asyncio.sleep`` → ``time.sleep``,
``aclose`` → ``close``. The result must be the sync method, statement for statement
(docstrings aside: the sync ones carry the full text, the async ones point to them).

A method may differ only where the two runtimes genuinely do different things; each
such method is listed in ``BY_DESIGN`` with the reason, and a method listed there that
has become equal fails too (the list cannot go stale). Change one flavour and this
test fails until the other is changed the same way."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import pytest
from hedgerow import aio as aio_module
from hedgerow import client as client_module
from hedgerow import commands, episode, images, sandboxes, snapshots, watch

RENAMES = {
    "AsyncClient": "Client",
    "AsyncSandbox": "Sandbox",
    "AsyncCommandHandle": "CommandHandle",
    "AsyncEpisode": "Episode",
    "AsyncImages": "Images",
    "AsyncSandboxes": "Sandboxes",
    "AsyncWatcher": "Watcher",
    "AsyncSnapshot": "Snapshot",
    "AsyncTerminal": "Terminal",
    "AsyncIterator": "Iterator",
    "AsyncIterable": "Iterable",
    "current_async_episode": "current_episode",
    "_current_async": "_current",
    "aclose": "close",
    "asent_trace": "sent_trace",  # the create's "request was sent" hook (sdk/hedgerow/cleanup.py)
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "__aiter__": "__iter__",
    "__anext__": "__next__",
    "StopAsyncIteration": "StopIteration",
    "AsyncFileData": "FileData",
    "astream_operation": "stream_operation",
    "acollect": "collect",
    "aiter_bytes": "iter_bytes",
    "aread": "read",
    "_raise_for_stream_async": "_raise_for_stream",
}

PAIRS = [
    (client_module.Client, aio_module.AsyncClient),
    (client_module.Sandbox, aio_module.AsyncSandbox),
    (commands.CommandHandle, commands.AsyncCommandHandle),
    (images.Images, images.AsyncImages),
    (sandboxes.Sandboxes, sandboxes.AsyncSandboxes),
    (watch.Watcher, watch.AsyncWatcher),
    (episode.Episode, episode.AsyncEpisode),
    (snapshots.Snapshot, snapshots.AsyncSnapshot),
]

# Methods whose two flavours differ because the runtimes do: (sync class, method) →
# why. Everything else must be the mechanical twin.
BY_DESIGN: dict[tuple[str, str], str] = {
    ("Client", "__init__"): "the sync client installs the signal handlers now, from the "
    "main thread (creates from worker threads are covered); the async one has a "
    "connection pool bound (max_connections) for hundreds of concurrent calls",
    ("Client", "cleanup_sandboxes"): "async deletes them concurrently (gather)",
    ("Client", "fork"): "async waits for the children concurrently (gather)",
    ("Sandbox", "__init__"): "heartbeats: a thread's stop event vs an asyncio task",
    ("Sandbox", "start_heartbeats"): "a daemon thread vs a task on the running loop",
    ("Sandbox", "stop_heartbeats"): "an Event set vs a task cancelled",
    ("Sandbox", "exec"): "async starts the streamed request as a task and flushes the "
    "episode from the event loop (flush_if_due)",
    ("Sandbox", "exec_stream"): "async starts the command as a task at the call (a "
    "coroutine would run nothing until iterated); sync sends it at the call",
    ("Sandbox", "_stream_body"): "sync: the response of a request already sent; async: "
    "the task's response, read when iteration starts",
    ("Sandbox", "_download_tree"): "the archive is extracted by a worker thread fed through "
    "asyncio.to_thread in the async flavour",
    ("Sandbox", "pty"): "a blocking Terminal vs an AsyncTerminal opened on the loop",
    ("Sandbox", "upload"): "httpx's async client needs the archive as an async iterable",
    ("Sandbox", "write_file"): "sync reads file objects in chunks; async takes bytes, str "
    "or an async iterable (AsyncFileData): httpx's async client cannot read a file object",
    ("Images", "import_"): "httpx's async client cannot stream a sync file object in a "
    "multipart body: the tarball is read into memory",
}

# Sync helpers with no async twin, and why.
SYNC_ONLY: dict[tuple[str, str], str] = {
    ("Sandbox", "_frames_of"): "sync's frames of an answered request; async reads them in "
    "_stream_body once the task's response arrives",
    ("Episode", "_add"): "sync flushes every FLUSH_EVERY steps as they are added; async "
    "flushes from the event loop (AsyncEpisode.flush_if_due)",
}


class _Unasync(ast.NodeTransformer):
    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> Any:
        self.generic_visit(node)
        fields = {name: getattr(node, name) for name in node._fields if hasattr(node, name)}
        fields["name"] = RENAMES.get(node.name, node.name)
        return ast.copy_location(ast.FunctionDef(**fields), node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> Any:
        self.generic_visit(node)
        node.name = RENAMES.get(node.name, node.name)
        return node

    def visit_Await(self, node: ast.Await) -> Any:
        return self.visit(node.value)

    def visit_AsyncWith(self, node: ast.AsyncWith) -> Any:
        self.generic_visit(node)
        return ast.copy_location(ast.With(items=node.items, body=node.body), node)

    def visit_AsyncFor(self, node: ast.AsyncFor) -> Any:
        self.generic_visit(node)
        return ast.copy_location(
            _yield_from(node)
            or ast.For(target=node.target, iter=node.iter, body=node.body, orelse=node.orelse),
            node,
        )

    def visit_For(self, node: ast.For) -> Any:
        self.generic_visit(node)
        return ast.copy_location(_yield_from(node) or node, node)

    def visit_comprehension(self, node: ast.comprehension) -> Any:
        self.generic_visit(node)
        node.is_async = 0
        return node

    def visit_Name(self, node: ast.Name) -> Any:
        node.id = RENAMES.get(node.id, node.id)
        return node

    def visit_Attribute(self, node: ast.Attribute) -> Any:
        self.generic_visit(node)
        node.attr = RENAMES.get(node.attr, node.attr)
        if isinstance(node.value, ast.Name) and (node.value.id, node.attr) == ("asyncio", "sleep"):
            node.value.id = "time"
        return node

    def visit_Constant(self, node: ast.Constant) -> Any:
        if isinstance(node.value, str):  # names in messages and string annotations
            for old, new in RENAMES.items():
                if old.startswith("Async"):
                    node.value = node.value.replace(old, new)
        return node


def _yield_from(loop: ast.For | ast.AsyncFor) -> ast.Expr | None:
    """``for x in it: yield x`` is ``yield from it`` (async generators cannot ``yield
    from``, so the async flavour spells it as a loop)."""
    if loop.orelse or len(loop.body) != 1 or not isinstance(loop.target, ast.Name):
        return None
    statement = loop.body[0]
    if not isinstance(statement, ast.Expr) or not isinstance(statement.value, ast.Yield):
        return None
    value = statement.value.value
    if not isinstance(value, ast.Name) or value.id != loop.target.id:
        return None
    return ast.Expr(value=ast.YieldFrom(value=loop.iter))


def _function(cls: type, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    attr = inspect.getattr_static(cls, name)
    target = attr.fget if isinstance(attr, property) else attr
    target = getattr(target, "__func__", target)
    source = textwrap.dedent(inspect.getsource(target))
    node = ast.parse(source).body[0]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), name
    body = node.body
    first = body[0] if body else None
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    if docstring and isinstance(first.value.value, str):  # type: ignore[union-attr]
        node.body = body[1:] or [ast.Pass()]
    return node


def _own_methods(cls: type) -> list[str]:
    return sorted(
        name
        for name, value in vars(cls).items()
        if inspect.isfunction(value) or isinstance(value, (property, staticmethod, classmethod))
    )


def unasync(cls: type, name: str) -> str:
    return ast.dump(_Unasync().visit(_function(cls, name)))


def as_is(cls: type, name: str) -> str:
    # Through the same visitor, so both sides are spelled alike (yield from); the sync
    # source has no async names for it to change.
    return ast.dump(_Unasync().visit(_function(cls, name)))


def _cases() -> list[tuple[type, type, str]]:
    cases = []
    for sync, aio in PAIRS:
        for name in _own_methods(sync):
            cases.append((sync, aio, name))
    return cases


def _twin(aio: type, name: str) -> str:
    if name in vars(aio):
        return name
    back = {new: old for old, new in RENAMES.items()}
    return back.get(name, name)


@pytest.mark.parametrize(("sync", "aio", "name"), _cases(), ids=lambda v: getattr(v, "__name__", v))
def test_the_sync_method_is_the_unasync_of_the_async_one(sync, aio, name):
    if (sync.__name__, name) in SYNC_ONLY:
        assert _twin(aio, name) not in vars(aio), f"{name} has a twin now: drop it from SYNC_ONLY"
        return
    twin = _twin(aio, name)
    assert twin in vars(aio), f"{aio.__name__} has no {twin} for {sync.__name__}.{name}"
    same = as_is(sync, name) == unasync(aio, twin)
    reason = BY_DESIGN.get((sync.__name__, name))
    if reason is None:
        assert same, (
            f"{sync.__name__}.{name} is not the unasync of {aio.__name__}.{twin}:\n"
            + ast.unparse(_function(sync, name))
            + "\n---\n"
            + ast.unparse(_Unasync().visit(_function(aio, twin)))
        )
    else:
        assert not same, f"{sync.__name__}.{name} is now the twin: drop it from BY_DESIGN"


def test_every_by_design_entry_names_a_real_method():
    names = {(sync.__name__, name) for sync, _, name in _cases()}
    assert set(BY_DESIGN) <= names and set(SYNC_ONLY) <= names


def test_the_check_notices_a_drift():
    # The comparison itself can fail: two methods that differ in one argument differ.
    a = ast.parse("async def f(self):\n    return await self.g(1)\n").body[0]
    b = ast.parse("def f(self):\n    return self.g(2)\n").body[0]
    c = ast.parse("def f(self):\n    return self.g(1)\n").body[0]
    assert ast.dump(_Unasync().visit(a)) != ast.dump(b)
    a = ast.parse("async def f(self):\n    return await self.g(1)\n").body[0]
    assert ast.dump(_Unasync().visit(a)) == ast.dump(c)
