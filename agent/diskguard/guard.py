"""The profiling disk guard: one node-level owner keeps the profiling tree under its size limit.

TaskD makes every worker process walk the whole tree every 60 s and delete files of its own rank
number (any name but `parallel_group.json`). Here one component walks the tree once, at start-up,
and then follows it with inotify: a write costs one `lstat` of the file written, not a walk, so
the cost does not grow with the files already on disk.

The tree is `<root>/<job>/<rank>/<file>`; record files are named by exactly 10 ASCII digits (the
Unix second the rank started the file) and a rank appends to its newest one. Usage counts every
regular file anywhere under the root; symlinks are never followed, counted or deleted.

The following is an agent.fstree.tree.TreeFollower the guard owns (it implements TreeEvents):
events are coalesced while they wait (agent.fstree.events), so a batch costs one `lstat` per file
touched, however many writes it saw.

Which files age is decided by `agent.diskguard.rules.choose_victims` (pure). A pass deletes them oldest first
in chunks, updating usage after each: it is back under the limit after the first chunk or so, and
finishes the round for fairness. A write that crosses the limit is seen after the batch window
(0.1 s), so usage is back under it about that long after.

`limit_bytes <= 0` disables aging; usage is still measured.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from inotify_simple import flags

from agent.diskguard.rules import FileEntry, UsageLedger, choose_victims
from agent.fstree.events import DIR_NEW, LAST_GONE, WATCH_MASK, Change
from agent.fstree.paths import is_record_name, join
from agent.fstree.tree import BATCH_WINDOW_S, ROOT_POLL_S, Executor, TreeFollower
from agent.fstree.walk import DIR_FLAGS, VANISHED, Problem, Walk, open_dir, open_under
from agent.lifecycle import Tasks

log = logging.getLogger(__name__)

STUCK_RETRY_S = 30.0  # over the limit with nothing deletable: look again this often (or on a new record file)
# Files deleted per trip to the worker thread; usage is updated after each. Our own deletions raise
# events too: a pass of more than agent.fstree.tree.BACKLOG_MAX files ends in a rescan.
AGING_CHUNK = 500


@dataclass
class _Walk(Walk):
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (size, mtime_ns)


@dataclass
class _Refresh:
    stats: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # None: not a regular file (any more)
    walks: list[tuple[str, _Walk]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


@dataclass
class _Deleted:
    """One chunk of an aging pass."""
    deleted: list[tuple[str, int]] = field(default_factory=list)  # (path, bytes)
    vanished: list[str] = field(default_factory=list)  # chosen, but no longer a regular file there
    problems: list[Problem] = field(default_factory=list)


class DiskGuard:
    """Measures the profiling tree with inotify and ages record files when it outgrows `limit_bytes`."""

    name = "disk-guard"

    def __init__(self, root: Path, limit_bytes: int, *, clock: Callable[[], float] = time.monotonic,
                 root_poll_s: float = ROOT_POLL_S, batch_window_s: float = BATCH_WINDOW_S,
                 executor: Executor | None = None):
        self.limit_bytes = limit_bytes
        self.tasks = Tasks(self.name)
        # ATTRIB too: `touch` reorders aging.
        self._tree = TreeFollower(root, self, tasks=self.tasks, log=log, title="profiling disk guard",
                                  label="profiling tree", refused="nothing is followed, measured or aged",
                                  mask=WATCH_MASK | flags.ATTRIB, root_poll_s=root_poll_s,
                                  batch_window_s=batch_window_s, stop_wait_s=1.0, executor=executor)
        self.root = self._tree.root
        self._root = str(self.root)
        self._clock = clock
        self._ledger = UsageLedger()
        self._stuck_at: float | None = None  # when a pass found nothing deletable while over the limit
        self._files_aged = 0
        self._bytes_aged = 0
        self._aging_passes = 0

    # ---- read-only figures for metrics and tests ------------------------------------------------

    @property
    def usage_bytes(self) -> int:
        return self._ledger.total

    @property
    def files(self) -> int:
        return len(self._ledger)

    @property
    def files_aged(self) -> int:
        return self._files_aged

    @property
    def bytes_aged(self) -> int:
        return self._bytes_aged

    @property
    def aging_passes(self) -> int:
        return self._aging_passes

    @property
    def scans(self) -> int:
        """Full walks of the tree: start-up, after an event overflow, when the root (re)appears."""
        return self._tree.scans

    @property
    def overflows(self) -> int:
        return self._tree.overflows

    @property
    def unwatched(self) -> int:
        return self._tree.unwatched

    @property
    def errors(self) -> int:
        return self._tree.errors

    @property
    def state(self) -> str:
        return self._tree.state

    def tracked(self) -> dict[str, int]:
        """Path (relative to the root) -> size of every file counted."""
        return self._ledger.sizes()

    async def start(self) -> None:
        await self._tree.start()
        if self.tasks.running and self.limit_bytes <= 0:
            log.info("profiling disk limit is 0: usage is measured, nothing is aged", extra={"root": self._root})

    async def stop(self) -> None:
        await self._tree.stop()

    def readiness(self) -> tuple[bool, str]:
        return self._tree.readiness()

    # ---- following the tree (agent.fstree.tree.TreeEvents) --------------------------------------

    def failed(self) -> None:
        self._tree.forget("")  # from a fresh scan

    async def catch_up(self) -> bool:
        return False  # a batch is done when it is applied

    async def rescan(self, initial: bool) -> bool:
        """Walk the whole tree and rebuild the ledger and the watches; False if the root was not there."""
        started = self._clock()
        walk = await self._tree.scan(_Walk())
        self._stuck_at = None
        if walk is None:
            return False
        self._ledger = UsageLedger()
        for path, (size, mtime) in walk.files.items():
            self._ledger.set(path, size, mtime)
        log.info("profiling tree scanned", extra={
            "root": self._root, "files": len(self._ledger), "usage_bytes": self._ledger.total,
            "limit_bytes": self.limit_bytes, "directories": self._tree.watched,
            "took_ms": round((self._clock() - started) * 1e3, 1)})
        await self._age_while_over()
        return True

    def gone(self, directory: str) -> None:
        self._ledger.remove_tree(directory)

    async def apply(self, changes: Iterator[Change]) -> None:
        """Apply one batch, then age what it brought over the limit."""
        touched: list[str] = []  # files to lstat, each once per batch
        new_dirs: list[str] = []
        for directory, name, what in changes:
            path = join(directory, name)
            if what & LAST_GONE:
                self._ledger.remove(path)  # gone: no need to look
            elif what & DIR_NEW:
                new_dirs.append(path)
            else:
                touched.append(path)
        if touched or new_dirs:
            refresh = await self._tree.run(self._refresh, touched, new_dirs)
            self._tree.note(refresh.problems)
            for path, found in refresh.stats.items():
                if found is None:
                    self._ledger.remove(path)
                elif self._ledger.set(path, *found):
                    self._unstick(path)
            # What was known there goes (a directory moved over another one, or over a file).
            self._ledger.remove_trees(directory for directory, _ in refresh.walks)
            for _, walk in refresh.walks:
                self._tree.note(walk.problems)
                self._tree.take(walk)
                for path, (size, mtime) in walk.files.items():
                    self._ledger.set(path, size, mtime)
                    self._unstick(path)
        await self._age_while_over()

    def _unstick(self, path: str) -> None:
        if self._stuck_at is not None and path.count("/") == 2 and is_record_name(path.rpartition("/")[2]):
            self._stuck_at = None  # a rank rotated: its previous file may be aged now

    # ---- aging ----------------------------------------------------------------------------------

    async def _age_while_over(self) -> None:
        while self.limit_bytes > 0 and self._ledger.total > self.limit_bytes:
            started = self._clock()
            # Nothing was deletable: choosing again costs a pass over every file, so only retry
            # when a new record file appears (_unstick) or, for a `touch` that reordered a rank, now and then.
            if self._stuck_at is not None and started - self._stuck_at < STUCK_RETRY_S:
                return
            usage_before = self._ledger.total
            # The ledger is only changed by this task, which waits here: the thread may read it.
            victims = await self._tree.run(self._choose)
            deleted = freed = vanished = failed = 0
            under_ms = None
            for at in range(0, len(victims), AGING_CHUNK):
                chunk = await self._tree.run(self._delete, victims[at:at + AGING_CHUNK], quiet=True)
                self._tree.note(chunk.problems)
                for path in chunk.vanished:
                    self._ledger.remove(path)
                for path, _ in chunk.deleted:
                    self._ledger.remove(path)
                chunk_bytes = sum(size for _, size in chunk.deleted)
                deleted, freed = deleted + len(chunk.deleted), freed + chunk_bytes
                vanished, failed = vanished + len(chunk.vanished), failed + len(chunk.problems)
                self._files_aged += len(chunk.deleted)
                self._bytes_aged += chunk_bytes
                if under_ms is None and self._ledger.total <= self.limit_bytes:
                    under_ms = round((self._clock() - started) * 1e3, 1)
            if deleted:
                self._aging_passes += 1
                self._stuck_at = None
                log.info("aged profiling record files", extra={
                    "root": self._root, "files": deleted, "bytes": freed, "usage_before": usage_before,
                    "usage_after": self._ledger.total, "limit_bytes": self.limit_bytes,
                    "under_limit_ms": under_ms, "took_ms": round((self._clock() - started) * 1e3, 1)})
            elif not vanished:  # no progress: wait for a new record file rather than spin
                if self._stuck_at is None:
                    left = ("each rank's newest record file, files that are not records and files that could "
                            "not be deleted" if failed else
                            "each rank's newest record file and files that are not records")
                    log.warning(f"profiling tree over its limit, and nothing more may be aged: only {left} are left",
                                extra={"root": self._root, "usage_bytes": self._ledger.total,
                                       "limit_bytes": self.limit_bytes, "files": len(self._ledger)})
                self._stuck_at = started

    def _choose(self) -> list[FileEntry]:
        """The pass's victims, oldest first across ranks: the oldest data goes first (worker thread)."""
        victims = choose_victims(self._ledger, self.limit_bytes)
        victims.sort(key=lambda e: (e.mtime, e.path))
        return victims

    def _delete(self, victims: list[FileEntry]) -> _Deleted:
        """Delete the chosen files (worker thread), each re-checked right before its unlink."""
        result = _Deleted()
        by_dir: dict[str, list[FileEntry]] = {}
        for victim in victims:
            by_dir.setdefault(victim.path.rpartition("/")[0], []).append(victim)
        for directory, entries in by_dir.items():
            try:
                dir_fd = open_under(self._root, directory)  # only if it really is a directory of the tree
            except FileNotFoundError:
                result.vanished.extend(e.path for e in entries)
                continue
            except OSError as exc:
                result.problems.append(("cannot open a rank directory to age it", directory, str(exc)))
                continue
            try:
                for entry in entries:
                    # By name relative to the directory opened: a path swapped since cannot redirect it.
                    name = entry.path.rpartition("/")[2]
                    try:
                        st = os.lstat(name, dir_fd=dir_fd)
                        if not stat.S_ISREG(st.st_mode):
                            result.vanished.append(entry.path)
                            continue
                        os.unlink(name, dir_fd=dir_fd)
                    except FileNotFoundError:
                        result.vanished.append(entry.path)
                        continue
                    except OSError as exc:
                        result.problems.append(("cannot delete a record file", entry.path, str(exc)))
                        continue
                    result.deleted.append((entry.path, st.st_size))
            finally:
                os.close(dir_fd)
        return result

    # ---- walking (worker thread) ----------------------------------------------------------------

    @staticmethod
    def list_dir(fd: int, directory: str, out: _Walk) -> list[str]:
        """Count the regular files of a directory; all of its subdirectories are walked."""
        subdirs = []
        with os.scandir(fd) as entries:
            for entry in entries:
                child = join(directory, entry.name)
                try:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.name)
                    elif entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode):
                            out.files[child] = (st.st_size, st.st_mtime_ns)
                    # symlinks, sockets, fifos: not counted, never followed
                except FileNotFoundError:
                    pass  # deleted since it was listed: normal (a rank or TaskD ages its files too)
                except OSError as exc:
                    out.problems.append(("cannot stat a file", child, str(exc)))
        return subdirs

    def _refresh(self, paths: list[str], new_dirs: list[str]) -> _Refresh:
        """lstat the files a batch touched; walk the directories it created."""
        out = _Refresh()
        if paths:
            try:
                root_fd = os.open(self._root, DIR_FLAGS)
            except OSError as exc:  # gone: its own event says so
                if exc.errno not in VANISHED:
                    out.problems.append(("cannot open a directory", ".", str(exc)))
            else:
                try:
                    self._stat_files(root_fd, paths, out)
                finally:
                    os.close(root_fd)
        for directory in new_dirs:
            out.walks.append((directory, self._tree.walk(directory, _Walk())))
        return out

    @staticmethod
    def _stat_files(root_fd: int, paths: list[str], out: _Refresh) -> None:
        """lstat each file by name under a descriptor of its directory: at any depth (the full path
        may be longer than PATH_MAX), and never through a symlink."""
        by_dir: dict[str, list[str]] = {}
        for path in paths:
            by_dir.setdefault(path.rpartition("/")[0], []).append(path)
        for directory, files in by_dir.items():
            try:
                dir_fd = open_dir(root_fd, directory.split("/") if directory else [])
            except OSError as exc:
                if exc.errno in VANISHED:
                    out.stats.update(dict.fromkeys(files))  # gone with its directory
                else:
                    out.problems.append(("cannot open a directory", directory or ".", str(exc)))
                continue
            try:
                for path in files:
                    try:
                        st = os.lstat(path.rpartition("/")[2], dir_fd=dir_fd)
                    except FileNotFoundError:
                        out.stats[path] = None
                        continue
                    except OSError as exc:
                        out.problems.append(("cannot stat a file", path, str(exc)))
                        continue
                    out.stats[path] = (st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None
            finally:
                os.close(dir_fd)
