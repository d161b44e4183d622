"""The profiling record tailer: follows `<root>/<job>/<rank>/<10-digit file>` and hands a consumer
complete lines with their position, never a byte twice or not at all, across restarts.

Training processes append one JSON object per line to the largest-named record file of their rank
(TaskD: open, one write, close, every ~5 s; a write may end inside a line) and start a larger name
past 10 MiB. The disk guard deletes the oldest files of each rank at any time; jobs end and their
directories go. Like the disk guard, the tailer owns an agent.fstree.tree.TreeFollower: the tree is
walked once at start-up (and after an inotify overflow, or when the root appears; what a walk notes:
agent.steps.listing) and then followed with inotify: an event on a rank's file makes that rank
"dirty", and one trip to a worker thread reads every dirty rank from its cursor to EOF
(agent.steps.reader). Where each rank is, and where a restart resumes: agent.steps.cursors.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

from agent.fstree.events import CLOSED, DIR_NEW, LAST_GONE, Change
from agent.fstree.paths import PathMap, is_record_name, join
from agent.fstree.tree import BACKLOG_MAX, BATCH_WINDOW_S, ROOT_POLL_S, Executor, TreeFollower
from agent.lifecycle import Tasks
from agent.steps import listing
from agent.steps.cursors import Offsets, Position, Rank, RankSeen, first_sight
from agent.steps.listing import TailWalk, depth, is_dir_name
from agent.steps.reader import GROUP_FILE, Group, Outcome, ReadJob, read_ranks
from agent.steps.records import RankKey

log = logging.getLogger(__name__)


class TailConsumer(Protocol):
    def on_lines(self, key: RankKey, file: str, offset: int, data: bytes) -> None:
        """`data`: one or more complete lines (ends with b"\\n"), starting at byte `offset` of `file`."""

    def on_group(self, key: RankKey, group: dict) -> None:
        """parallel_group.json parsed, on appearance and change."""

    def on_rank_gone(self, key: RankKey) -> None:
        """The rank directory (or its job, or the root) was removed."""

    def on_bad_input(self, key: RankKey | None, reason: str, detail: str) -> None:
        """Counted and logged by the consumer; reasons are listed in agent.steps.reasons.BAD_INPUT."""

    def on_batch_end(self) -> Mapping[RankKey, Position] | None:
        """After each batch of on_lines calls: per rank, the position a restart must read again from."""


class ProfilingTailer:
    """Follows the profiling tree and delivers complete record lines to `consumer` (called on the loop).

    `errors` counts the tailer's own problems (unreadable directories, state file, consumer
    exceptions); bad input is the consumer's to count.
    """

    name = "profiling-tailer"

    def __init__(self, root: Path, state_file: Path, consumer: TailConsumer, *,
                 clock: Callable[[], float] = time.monotonic, root_poll_s: float = ROOT_POLL_S,
                 batch_window_s: float = BATCH_WINDOW_S, commit_interval_s: float = 5.0, max_read_bytes: int = 4 << 20,
                 replay_existing: bool = False, executor: Executor | None = None):
        if max_read_bytes <= 0:
            raise ValueError("max_read_bytes must be positive")
        self.tasks = Tasks(self.name)
        self._tree = TreeFollower(root, self, tasks=self.tasks, log=log, title="profiling tailer",
                                  label="profiling tailer", refused="no records are read", root_poll_s=root_poll_s,
                                  batch_window_s=batch_window_s, executor=executor)
        self.root = self._tree.root
        self._root = str(self.root)
        self.state_file = Path(state_file)
        self._offsets = Offsets(self.state_file)
        self._consumer = consumer
        self._clock = clock
        self._commit_interval_s = commit_interval_s
        self._max_read = max_read_bytes
        self._replay = replay_existing
        self._ranks: PathMap[Rank] = PathMap()  # "<job>/<rank>" -> rank
        self._dirty: dict[str, None] = {}  # ranks with something to read, in turn order
        self._bad_dirs: set[str] = set()
        self._bytes_read = 0
        self._lines = 0
        self._consumer_errors = 0
        self._consumer_failed: set[str] = set()  # its methods that raised (logged once each)
        self._stopped = False

    # ---- read-only figures for metrics and tests ------------------------------------------------

    @property
    def bytes_read(self) -> int:
        return self._bytes_read

    @property
    def lines_delivered(self) -> int:
        return self._lines

    @property
    def files_followed(self) -> int:
        """Record files being read or waiting to be read (each rank's current file and newer ones)."""
        return sum(len(rank.files) for rank in self._ranks.values())

    @property
    def ranks(self) -> int:
        return len(self._ranks)

    @property
    def rescans(self) -> int:
        """Full walks of the tree: start-up, the root appearing, an inotify overflow."""
        return self._tree.scans

    @property
    def lag_bytes(self) -> int:
        """Bytes known to be on disk and not delivered yet, over all ranks."""
        return sum(rank.lag for rank in self._ranks.values())

    @property
    def errors(self) -> int:
        return self._tree.errors + self._consumer_errors

    @property
    def overflows(self) -> int:
        return self._tree.overflows

    @property
    def unwatched(self) -> int:
        return self._tree.unwatched

    @property
    def state(self) -> str:
        return "stopped" if self._stopped else self._tree.state

    # ---- component ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._offsets.load()
        await self._tree.start()
        if self.tasks.running:  # the follower runs (it has an inotify instance)
            self.tasks.start("save-state", self._save_periodically)

    async def stop(self) -> None:
        await self._tree.stop()
        self._save_state()
        self._stopped = True

    def readiness(self) -> tuple[bool, str]:
        return self._tree.readiness()

    def commit(self, key: RankKey, position: Position) -> None:
        """Everything before `position` of this rank is used: a restart resumes there."""
        if f"{key.job_id}/{key.rank}" in self._ranks:  # else gone (or never seen): nothing to resume
            self._offsets.commit(key, position)

    # ---- following the tree (agent.fstree.tree.TreeEvents) --------------------------------------

    def failed(self) -> None:
        log.info("profiling tailer rescanning after a failure", extra={"root": self._root})  # cursors stay

    @staticmethod
    def list_dir(fd: int, directory: str, walk: TailWalk) -> list[str]:
        return listing.list_dir(fd, directory, walk)

    async def rescan(self, initial: bool) -> bool:
        """Walk the whole tree; known ranks keep their cursors. False if the root could not be opened."""
        started = self._clock()
        walk = await self._tree.scan(TailWalk(want_ends=initial and not self._replay))
        if walk is None:
            return False
        self._adopt(walk, "", fresh=not initial)
        self._offsets.drop_saved()  # saved ranks that are not there any more
        log.info("profiling tree scanned for records", extra={
            "root": self._root, "ranks": len(self._ranks), "files": self.files_followed,
            "lag_bytes": self.lag_bytes, "took_ms": round((self._clock() - started) * 1e3, 1)})
        return True

    async def apply(self, changes: Iterator[Change]) -> None:
        new_dirs: list[str] = []
        for directory, name, what in changes:
            level, path = depth(directory), join(directory, name)
            if level < 2:  # names of jobs (depth 0) or ranks (depth 1)
                if what & DIR_NEW:
                    if is_dir_name(level, name):
                        new_dirs.append(path)
                    else:
                        self._bad_dir(path)
            elif (rank := self._ranks.get(directory)) is not None:
                self._file_event(rank, name, what)
        if new_dirs:
            walks = await self._tree.run(self._walk_each, new_dirs)
            for path, walk in walks:
                self._tree.note(walk.problems)
                self._tree.take(walk)
                self._adopt(walk, path, fresh=True)

    def gone(self, directory: str) -> None:
        for _, rank in self._ranks.under(directory):
            self._rank_gone(rank)

    async def catch_up(self) -> bool:
        if not self._dirty:
            return False
        await self._read_round()
        return True

    def _walk_each(self, directories: list[str]) -> list[tuple[str, TailWalk]]:
        return [(directory, self._tree.walk(directory, TailWalk())) for directory in directories]

    # ---- ranks ----------------------------------------------------------------------------------

    def _adopt(self, walk: TailWalk, scope: str, fresh: bool) -> None:
        """Apply a walk of `scope` ("" is the whole tree): ranks not found there are gone."""
        seen = {found.path: found for found in walk.ranks}
        for path, rank in self._ranks.under(scope):
            found = seen.get(path)
            if found is None or found.inode != rank.inode:
                self._rank_gone(rank)
        for found in walk.ranks:
            rank = self._ranks.get(found.path)
            if rank is None:
                self._new_rank(found, fresh)
            else:
                self._merge(rank, found)
        for path in walk.bad_dirs:
            self._bad_dir(path)

    def _new_rank(self, found: RankSeen, fresh: bool) -> None:
        rank, start = first_sight(found, self._offsets.take_saved(found.key), from_origin=fresh or self._replay)
        self._ranks[found.path] = rank
        self._offsets.commit(rank.key, start)  # until the consumer commits: nothing before it is wanted
        self._dirty[found.path] = None

    def _merge(self, rank: Rank, found: RankSeen) -> None:
        for name in [name for name in rank.files if name not in found.files]:
            self._drop_file(rank, name)
        for name, size in found.files.items():
            if rank.ahead(name):
                rank.files[name] = size
        if found.group:
            rank.group_dirty = True  # the digest keeps an unchanged file from being handed over again
        else:
            rank.group_digest = None
        self._dirty[rank.path] = None

    def _rank_gone(self, rank: Rank) -> None:
        del self._ranks[rank.path]
        self._dirty.pop(rank.path, None)
        self._offsets.forget(rank.key)
        self._call("on_rank_gone", rank.key)

    def _drop_file(self, rank: Rank, name: str) -> None:
        if lost := rank.drop(name):
            self._bad(rank.key, "records_lost", lost)

    def _bad_dir(self, path: str) -> None:
        if path in self._bad_dirs or len(self._bad_dirs) >= BACKLOG_MAX:
            return
        self._bad_dirs.add(path)
        self._bad(None, "rank_dir" if "/" in path else "job_dir", os.fsencode(path).decode(errors="backslashreplace"))

    def _file_event(self, rank: Rank, name: str, what: int) -> None:
        if is_record_name(name):
            if what & LAST_GONE:
                self._drop_file(rank, name)
            elif rank.ahead(name):  # an older name is never written again: ignore it
                rank.files.setdefault(name, None)
                self._dirty[rank.path] = None
        elif name == GROUP_FILE:
            if what & LAST_GONE:
                rank.group_digest = None  # when it comes back, it is handed over again
            elif what & CLOSED:  # not on every write: a file being written is not JSON yet
                rank.group_dirty = True
                self._dirty[rank.path] = None

    # ---- reading --------------------------------------------------------------------------------

    async def _read_round(self) -> None:
        """One trip to the thread for the dirty ranks (up to max_read_bytes), then deliver."""
        jobs = []
        for path in self._dirty:
            rank = self._ranks[path]
            jobs.append(ReadJob(path, rank.cursor, tuple(sorted(rank.files)), rank.group_dirty))
        outcomes = await self._tree.run(read_ranks, self._root, jobs, self._max_read)
        delivered = False
        for job, out in zip(jobs, outcomes):
            rank = self._ranks.get(job.path)
            if out is None or rank is None:
                continue  # not reached this time: stays dirty, in its turn
            del self._dirty[job.path]
            delivered |= self._take(rank, out)
            if out.more:
                self._dirty[job.path] = None  # to the back of the line
        if delivered:
            for key, position in (self._call("on_batch_end") or {}).items():
                self.commit(key, position)

    def _take(self, rank: Rank, out: Outcome) -> bool:
        self._tree.note(out.problems)
        self._bytes_read += out.bytes_read
        for name, size in out.sizes.items():
            if name in rank.files or name == out.cursor.file:
                rank.files[name] = size
        for name in out.refused:
            rank.files.pop(name, None)
            self._tree.note([("a record name that is not a regular file is ignored", f"{rank.path}/{name}", "")])
        for name in sorted(out.missing):
            self._drop_file(rank, name)  # against the cursor the read started from
        delivered = False
        for event in out.events:
            if event[0] == "lines":
                _, name, offset, data = event
                self._lines += data.count(b"\n")
                delivered = True
                self._call("on_lines", rank.key, name, offset, data)
            else:
                self._bad(rank.key, event[1], event[2])
        rank.move_to(out.cursor)
        if out.group is not None:
            rank.group_dirty = False
            self._take_group(rank, out.group)
        return delivered

    def _take_group(self, rank: Rank, group: Group) -> None:
        if group.kind == "gone":
            rank.group_digest = None
        elif group.kind == "error":
            self._tree.note([("cannot read a parallel group file", f"{rank.path}/{GROUP_FILE}", str(group.value))])
        elif group.digest != rank.group_digest:  # MODIFY and CLOSE_WRITE may come in separate batches
            rank.group_digest = group.digest
            if group.kind == "ok":
                self._call("on_group", rank.key, group.value)
            else:
                self._bad(rank.key, "parallel_group", f"{rank.path}/{GROUP_FILE}: {group.value}")

    # ---- the state file -------------------------------------------------------------------------

    async def _save_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._commit_interval_s)
            self._save_state()

    def _save_state(self) -> None:
        def size_of(key: RankKey, file: str) -> int | None:
            rank = self._ranks.get(f"{key.job_id}/{key.rank}")
            return rank.size_of(file) if rank is not None else None

        try:
            self._offsets.save(size_of)
        except OSError as exc:
            self._tree.note([("cannot write the state file", str(self.state_file), str(exc))])

    # ---- reporting ------------------------------------------------------------------------------

    def _bad(self, key: RankKey | None, reason: str, detail: str) -> None:
        self._call("on_bad_input", key, reason, detail)

    def _call(self, method: str, *args):
        """Call the consumer; its exceptions are logged once per method and counted, never fatal."""
        try:
            return getattr(self._consumer, method)(*args)
        except Exception:
            self._consumer_errors += 1
            if method not in self._consumer_failed:
                self._consumer_failed.add(method)
                log.exception(f"profiling tailer: the consumer's {method} failed; the tailer goes on",
                              extra={"root": self._root})
