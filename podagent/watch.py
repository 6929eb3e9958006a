"""Directory watchers: what changed under a directory since the last look.

Polling, not inotify: the agent is stdlib-only and runs on every image and file
system (overlay roots, btrfs volumes, Kubernetes volumes), and a watcher costs nothing
between reads. A watcher keeps a snapshot of its tree (each entry's inode, type, size,
mtime and mode); reading its events compares the tree now with the snapshot and, when
nothing changed, looks again until the read's ``wait`` runs out. The cost is bounded:
at most MAX_ENTRIES entries per watcher and MAX_WATCHERS watchers, and between two
looks the reader sleeps ten times as long as the last look took (at least POLL_MIN_S),
so a watcher uses at most ~10 % of a core however big its tree. Unread watchers expire
after IDLE_S.

What a look reports (E2B's event types): ``create``, ``remove``, ``write`` (a file's or
symlink's size or mtime changed, or another file took its name: an atomic write),
``chmod`` (its mode changed) and ``rename`` (an inode
left one name and appeared under another: ``rename`` for the old name, ``create`` for
the new, as envd reports it). Names are relative to the watched directory. Changes
between two looks are coalesced: a file created and removed in between is not seen.

A watcher created with ``include_entry`` adds to each event whose name exists after
the look its ``entry`` (``files.entry``: type, size, mode, mtime, symlink target) as it
is at that look; ``remove`` and ``rename`` (the name left) carry none, nor does a name
gone again before the entry was read.
"""

from __future__ import annotations

import os
import stat
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

from . import files
from .errors import ApiError

MAX_WATCHERS = 16
MAX_ENTRIES = 10000
MAX_WAIT_S = 60.0
POLL_MIN_S = 0.05
IDLE_S = 600.0

# relative name → (inode, type, size, mtime_ns, mode)
Entry = Tuple[int, str, int, int, int]
Snapshot = Dict[str, Entry]


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "file" if stat.S_ISREG(mode) else "other"


def scan(root: str, recursive: bool) -> Snapshot:
    """The tree under ``root`` (symlinks not followed); ApiError past MAX_ENTRIES."""
    found: Snapshot = {}
    pending = [("", root)]
    while pending:
        prefix, directory = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue  # removed (or closed to us) while we looked
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            name = prefix + entry.name
            kind = _kind(st.st_mode)
            found[name] = (st.st_ino, kind, st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode))
            if len(found) > MAX_ENTRIES:
                raise ApiError(
                    400,
                    "too_many_entries",
                    f"the watched tree has more than {MAX_ENTRIES} entries",
                    "path",
                )
            if recursive and kind == "directory":
                pending.append((name + "/", entry.path))
    return found


def diff(old: Snapshot, new: Snapshot) -> List[Dict[str, Any]]:
    events: List[Dict[str, Any]] = []
    gone = {name: old[name] for name in old.keys() - new.keys()}
    born = {name: new[name] for name in new.keys() - old.keys()}
    # Where an inode arrived: a new name, or a name another inode held before.
    arrived = [e for n, e in new.items() if n not in old or old[n][0] != e[0]]
    born_ids = {(e[0], e[1]) for e in arrived}
    for name in sorted(gone):
        moved = (gone[name][0], gone[name][1]) in born_ids
        events.append({"name": name, "type": "rename" if moved else "remove"})
    for name in sorted(born):
        events.append({"name": name, "type": "create"})
    for name in sorted(old.keys() & new.keys()):
        before, after = old[name], new[name]
        if before[1] != after[1] or (before[0] != after[0] and after[1] == "directory"):
            events.append({"name": name, "type": "remove"})  # replaced by another object
            events.append({"name": name, "type": "create"})
            continue
        if before[0] != after[0]:
            # A file replaced by another under the same name (an atomic write: a new
            # file renamed over it): its content changed.
            events.append({"name": name, "type": "write"})
            if before[4] != after[4]:
                events.append({"name": name, "type": "chmod"})
            continue
        if after[1] != "directory" and (before[2], before[3]) != (after[2], after[3]):
            events.append({"name": name, "type": "write"})
        if before[4] != after[4]:
            events.append({"name": name, "type": "chmod"})
    return events


def with_entries(root: str, events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``events`` with each present name's ``entry`` (its state now)."""
    for event in events:
        if event["type"] in ("remove", "rename"):
            continue
        try:
            event["entry"] = files.entry(os.path.join(root, event["name"]))
        except OSError:
            continue  # gone again since the look
    return events


class Watcher:
    def __init__(self, path: str, recursive: bool, include_entry: bool = False) -> None:
        self.id = f"w-{uuid.uuid4().hex}"
        self.path = path
        self.recursive = recursive
        self.include_entry = include_entry
        self.lock = threading.Lock()  # one reader at a time
        self.snapshot = scan(path, recursive)
        self.last_cost = 0.0
        self.used = time.monotonic()

    def events(self, wait: float) -> List[Dict[str, Any]]:
        """What changed since the last read, waiting up to ``wait`` s for a change."""
        deadline = time.monotonic() + min(max(wait, 0.0), MAX_WAIT_S)
        with self.lock:
            while True:
                started = time.monotonic()
                if not os.path.isdir(self.path):
                    self.used = time.monotonic()
                    raise ApiError(404, "not_found", f"{self.path} is gone")
                now = scan(self.path, self.recursive)
                self.last_cost = time.monotonic() - started
                found = diff(self.snapshot, now)
                self.snapshot = now
                self.used = time.monotonic()
                left = deadline - time.monotonic()
                if found or left <= 0:
                    return with_entries(self.path, found) if self.include_entry else found
                time.sleep(min(left, max(POLL_MIN_S, self.last_cost * 10)))


class Watchers:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watchers: Dict[str, Watcher] = {}

    def create(self, path: str, recursive: bool, include_entry: bool = False) -> Watcher:
        if not os.path.isdir(path):
            code = "not_a_directory" if os.path.exists(path) else "not_found"
            raise ApiError(400 if code == "not_a_directory" else 404, code, f"{path}: {code}")
        with self._lock:
            self._expire()
            if len(self._watchers) >= MAX_WATCHERS:
                raise ApiError(
                    429, "too_many_watchers", f"at most {MAX_WATCHERS} watchers per sandbox"
                )
        watcher = Watcher(path, recursive, include_entry)  # the first scan, outside the lock
        with self._lock:
            if len(self._watchers) >= MAX_WATCHERS:
                raise ApiError(
                    429, "too_many_watchers", f"at most {MAX_WATCHERS} watchers per sandbox"
                )
            self._watchers[watcher.id] = watcher
        return watcher

    def get(self, watcher_id: str) -> Watcher:
        with self._lock:
            self._expire()
            watcher = self._watchers.get(watcher_id)
        if watcher is None:
            raise ApiError(404, "not_found", "unknown watcher")
        return watcher

    def remove(self, watcher_id: str) -> None:
        with self._lock:
            if self._watchers.pop(watcher_id, None) is None:
                raise ApiError(404, "not_found", "unknown watcher")

    def _expire(self) -> None:
        now = time.monotonic()
        for watcher_id, watcher in list(self._watchers.items()):
            if now - watcher.used > IDLE_S and not watcher.lock.locked():
                del self._watchers[watcher_id]


def describe(watcher: Watcher) -> Dict[str, Any]:
    return {
        "watcher_id": watcher.id,
        "path": watcher.path,
        "recursive": watcher.recursive,
        "include_entry": watcher.include_entry,
        "entries": len(watcher.snapshot),
    }


def parse_wait(raw: Optional[str]) -> float:
    try:
        return min(max(float(raw or 0), 0.0), MAX_WAIT_S)
    except ValueError:
        raise ApiError(400, "bad_request", "wait must be a number", "wait") from None
