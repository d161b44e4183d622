"""The profiling record tailer: follows `<root>/<job>/<rank>/<10-digit file>` and hands a consumer
complete lines with their position, never a byte twice or not at all, across restarts.

Training processes append one JSON object per line to the largest-named record file of their rank
(TaskD: open, one write, close, every ~5 s; a write may end inside a line) and start a larger name
past 10 MiB. The disk guard deletes the oldest files of each rank at any time; jobs end and their
directories go. Like the disk guard, the tree is walked once at start-up (and after an inotify
overflow, or when the root appears) and then followed with inotify: an event on a rank's file makes
that rank "dirty", and one trip to a worker thread reads every dirty rank from its cursor to EOF.

Positions
- Each rank has a cursor (file, offset of the first byte not delivered). A read delivers up to the
  last `\\n`; a partial last line is read again with the next event. A line is at most 1 MiB
  (LINE_MAX, without its newline): a longer one, whether a read holds all of it or not, is reported
  as `line_too_long` and skipped to its newline.
- Files are read in name order. Whether a newer file exists is settled *before* the current one is
  read to its end: the writer finishes a file before it starts the next, so that read sees all the
  older file will ever hold. A partial line left at its end is dropped (`partial_line_at_rotation`)
  once the newer file has data; while the newer one is empty the older may still be finished.
- A resume position comes from the consumer (`commit`): everything before it is used. It is saved
  to `state_file` every `commit_interval_s` when changed, and on stop, with the size the tailer
  last knew of that file (`"size"`, an addition to `file`/`offset`: after a restart it tells
  whether a committed file aged away while the agent was down still held unread bytes). Until the
  consumer commits, a rank's resume position is where the tailer started it, so a restart never
  skips what was never delivered.
- First sight of a rank: its saved position if there is one; else, for ranks already on disk when
  the agent starts, the end of the last complete line of the newest file (history is not replayed;
  `replay_existing=True` reads it from 0); else (a rank, job or root that appears while running)
  offset 0 of its first file.
- A job directory whose name is not UTF-8 (a job's UID is ASCII; such a name cannot be a label) and a
  rank directory whose name is not a canonical number are reported once (`job_dir`, `rank_dir`)
  and not followed.
- `records_lost` is reported when a file is deleted with bytes the tailer knew of but had not read
  (its size from the last walk or read, so a file deleted before the tailer ever saw its size, or
  one created and deleted while the agent was down, is not noticed). The current file truncated
  below the cursor (`file_truncated`) or replaced by another inode (`file_replaced`) is read again
  from 0.

Safety: every file is opened by name under a descriptor chain root -> job -> rank opened with
`O_NOFOLLOW | O_DIRECTORY`, with `O_NOFOLLOW | O_NONBLOCK` (a symlink is never followed, a FIFO
never blocks), and inotify watches are added through `/proc/self/fd/<fd>` of those descriptors, so
a directory swapped for a symlink between the walk and the watch cannot redirect it.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from agent.common.fsutil import atomic_write, read_state
from agent.fstree.paths import is_record_name
from agent.steps.records import RankKey
from agent.fstree.tree import (BACKLOG_MAX, BATCH_WINDOW_S, CLOSED, DIR_FLAGS, DIR_GONE, DIR_NEW, LAST_GONE,
                                  LOGGED_MAX, ROOT_POLL_S, VANISHED, WATCH_MASK, Problem, TreeFollower, Walk, join,
                                  open_dir, within)

log = logging.getLogger(__name__)

LINE_MAX = 1 << 20  # a longer line without "\n" is skipped
GROUP_FILE = "parallel_group.json"
GROUP_MAX = 1 << 20
STATE_VERSION = 1
ORIGIN = "0000000000"  # resume position of a rank with no file yet: the first file, from 0
FINISHED_KEPT = 16  # final sizes of files the cursor left, for the saved "size" of a lagging commit
_RANK_NAME = re.compile(r"0|[1-9][0-9]{0,8}")  # canonical decimal: "01" would collide with "1"
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class Position:
    file: str  # the 10-digit file name
    offset: int  # byte offset in that file


class TailConsumer(Protocol):
    def on_lines(self, key: RankKey, file: str, offset: int, data: bytes) -> None:
        """`data`: one or more complete lines (ends with b"\\n"), starting at byte `offset` of `file`."""

    def on_group(self, key: RankKey, group: dict) -> None:
        """parallel_group.json parsed, on appearance and change."""

    def on_rank_gone(self, key: RankKey) -> None:
        """The rank directory (or its job, or the root) was removed."""

    def on_bad_input(self, key: RankKey | None, reason: str, detail: str) -> None:
        """Counted and logged by the consumer; reasons are listed in BAD_INPUT_REASONS."""

    def on_batch_end(self) -> Mapping[RankKey, Position] | None:
        """After each batch of on_lines calls: per rank, the position a restart must read again from."""


BAD_INPUT_REASONS = ("records_lost", "partial_line_at_rotation", "file_truncated", "file_replaced", "line_too_long",
           "job_dir", "rank_dir", "parallel_group")


def _is_rank_name(name: str) -> bool:
    return _RANK_NAME.fullmatch(name) is not None


def _is_dir_name(depth: int, name: str) -> bool:
    """A job directory's name (depth 0 lists jobs) must be UTF-8, as a job's UID is, to be a label;
    a rank directory's (depth 1) a canonical number."""
    if depth == 1:
        return _is_rank_name(name)
    try:
        name.encode()  # a name that is not UTF-8 comes from os.listdir as lone surrogates
    except UnicodeEncodeError:
        return False
    return True


def _depth(directory: str) -> int:
    """0 for the root, 1 for a job directory, 2 for a rank directory."""
    return directory.count("/") + 1 if directory else 0


# ---- data between the loop and the worker thread --------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Cursor:
    file: str | None  # None: start at the first file there is
    offset: int  # first byte not delivered (the start of a partial line, if any)
    inode: int | None = None  # of `file` when last read; None: not read yet in this run
    skipping: bool = False  # inside a line too long: drop bytes up to the next "\n"


@dataclass
class _RankSeen:
    """One rank directory as a walk found it."""
    path: str  # "<job>/<rank>"
    inode: int
    files: dict[str, int] = field(default_factory=dict)  # record name -> size
    group: bool = False  # parallel_group.json is a regular file there
    end: tuple[int, bool] = (0, False)  # newest file: end of its last complete line, skipping (if asked)


@dataclass
class _Walk(Walk):
    ranks: list[_RankSeen] = field(default_factory=list)
    bad_dirs: list[str] = field(default_factory=list)  # job or rank directories not followed


@dataclass(frozen=True, slots=True)
class _ReadJob:
    path: str
    cursor: _Cursor
    names: tuple[str, ...]  # known record names at or after the cursor's file, sorted
    group: bool  # read parallel_group.json too


@dataclass
class _Group:
    kind: str  # "ok", "bad", "gone", "error"
    digest: bytes = b""
    value: object = None  # the dict, or the reason it is bad, or the error


@dataclass
class _Outcome:
    cursor: _Cursor
    events: list[tuple] = field(default_factory=list)  # ("lines", file, offset, data) | ("bad", reason, detail)
    sizes: dict[str, int] = field(default_factory=dict)  # sizes seen
    missing: list[str] = field(default_factory=list)  # known names found absent
    refused: list[str] = field(default_factory=list)  # record names that are not regular files
    problems: list[Problem] = field(default_factory=list)
    group: _Group | None = None
    more: bool = False  # the budget ran out before EOF
    bytes_read: int = 0


@dataclass
class _Budget:
    left: int


@dataclass(eq=False)
class _Rank:
    key: RankKey
    path: str
    inode: int  # of the rank directory: one replaced under the same name is a new rank
    cursor: _Cursor
    files: dict[str, int | None]  # record names at or after the cursor's file -> last known size
    finished: dict[str, int] = field(default_factory=dict)  # final sizes of files the cursor left
    group_dirty: bool = False
    group_digest: bytes | None = None  # of the parallel_group.json last handed over (or reported)


class ProfilingTailer(TreeFollower):
    """Follows the profiling tree and delivers complete record lines to `consumer` (called on the loop).

    `errors` counts the tailer's own problems (unreadable directories, state file, consumer
    exceptions); bad input is the consumer's to count.
    """

    name = "profiling-tailer"
    title = "profiling tailer"
    label = "profiling tailer"
    refused = "no records are read"

    def __init__(self, root: Path, state_file: Path, consumer: TailConsumer, *,
                 clock: Callable[[], float] = time.monotonic, root_poll_s: float = ROOT_POLL_S,
                 batch_window_s: float = BATCH_WINDOW_S, commit_interval_s: float = 5.0, max_read_bytes: int = 4 << 20,
                 replay_existing: bool = False):
        if max_read_bytes <= 0:
            raise ValueError("max_read_bytes must be positive")
        super().__init__(root, log=log, mask=WATCH_MASK, clock=clock, root_poll_s=root_poll_s,
                         batch_window_s=batch_window_s)
        self.state_file = Path(state_file)
        self._consumer = consumer
        self._commit_interval_s = commit_interval_s
        self._max_read = max_read_bytes
        self._replay = replay_existing
        self._ranks: dict[str, _Rank] = {}  # "<job>/<rank>" -> rank
        self._dirty: dict[str, None] = {}  # ranks with something to read, in turn order
        self._committed: dict[RankKey, Position] = {}
        self._resume: dict[RankKey, tuple[Position, int | None]] = {}  # saved, until the rank is seen
        self._state_dirty = False
        self._at_start = True  # the next scan is the one of the tree as the agent found it
        self._bad_dirs: set[str] = set()
        self._bytes_read = 0
        self._lines = 0

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
        return self._scans

    @property
    def lag_bytes(self) -> int:
        """Bytes known to be on disk and not delivered yet, over all ranks."""
        total = 0
        for rank in self._ranks.values():
            for name, size in rank.files.items():
                if size is not None:
                    total += max(size - rank.cursor.offset, 0) if name == rank.cursor.file else size
        return total

    # ---- component ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._load_state()
        await super().start()
        if self.tasks.running:  # the follower runs (it has an inotify instance)
            self.tasks.start("save-state", self._save_periodically)

    async def stop(self) -> None:
        await super().stop()
        self._save_state()
        self._state = "stopped"

    def commit(self, key: RankKey, position: Position) -> None:
        """Everything before `position` of this rank is used: a restart resumes there."""
        if f"{key.job_id}/{key.rank}" not in self._ranks:
            return  # gone (or never seen): nothing to resume
        if self._committed.get(key) != position:
            self._committed[key] = position
            self._state_dirty = True

    # ---- the task -------------------------------------------------------------------------------

    def _recover(self) -> None:
        log.info("profiling tailer rescanning after a failure", extra={"root": self._root})
        self._pending.clear()  # cursors stay, a rescan mends the rest

    async def _next_batch(self) -> None:
        if not self._dirty:
            await super()._next_batch()
            return
        await self._read_round()
        self._on_readable()  # take what is queued, without waiting for more
        self._wakeup.clear()

    async def _save_periodically(self) -> None:
        while True:
            await asyncio.sleep(self._commit_interval_s)
            self._save_state()

    async def _wait_for_root(self) -> bool:
        if waited := await super()._wait_for_root():
            self._at_start = False  # whatever appears later appeared while running
        return waited

    async def _rescan(self) -> bool:
        """Walk the whole tree; known ranks keep their cursors. False if the root could not be opened."""
        started = self._clock()
        at_start, self._at_start = self._at_start, False
        walk = await self._scan(at_start and not self._replay)
        if walk is None:
            return False
        self._adopt(walk, "", fresh=not at_start)
        if self._resume:  # saved ranks that are not there any more
            self._resume.clear()
            self._state_dirty = True
        self._state = "watching"
        log.info("profiling tree scanned for records", extra={
            "root": self._root, "ranks": len(self._ranks), "files": self.files_followed,
            "lag_bytes": self.lag_bytes, "took_ms": round((self._clock() - started) * 1e3, 1)})
        return True

    # ---- ranks ----------------------------------------------------------------------------------

    def _adopt(self, walk: _Walk, scope: str, fresh: bool) -> None:
        """Apply a walk of `scope` ("" is the whole tree): ranks not found there are gone."""
        seen = {found.path: found for found in walk.ranks}
        for path, rank in list(self._ranks.items()):
            if within(path, scope):
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

    def _new_rank(self, found: _RankSeen, fresh: bool) -> None:
        job, _, rank_name = found.path.rpartition("/")
        key = RankKey(job, int(rank_name))
        files: dict[str, int | None] = dict(found.files)
        saved = self._resume.pop(key, None)
        if saved is not None:
            start, size = saved
            cursor = _Cursor(start.file, start.offset)
            files.setdefault(start.file, size)  # aged away meanwhile: the first read says what was lost
        elif fresh or self._replay or not files:
            cursor, start = _Cursor(None, 0), Position(ORIGIN, 0)
        else:  # on disk before the agent started: from the end of the newest file's last line
            newest = max(files)
            offset, skipping = found.end
            cursor, start = _Cursor(newest, offset, skipping=skipping), Position(newest, offset)
        rank = _Rank(key, found.path, found.inode, cursor,
                     {name: size for name, size in files.items() if cursor.file is None or name >= cursor.file},
                     group_dirty=found.group)
        self._ranks[found.path] = rank
        self._committed[key] = start  # until the consumer commits: nothing before it is wanted
        self._state_dirty = True
        self._dirty[found.path] = None

    def _merge(self, rank: _Rank, found: _RankSeen) -> None:
        for name in [name for name in rank.files if name not in found.files]:
            self._drop_file(rank, name)
        for name, size in found.files.items():
            if self._ahead(rank, name):
                rank.files[name] = size
        if found.group:
            rank.group_dirty = True  # the digest keeps an unchanged file from being handed over again
        else:
            rank.group_digest = None
        self._dirty[rank.path] = None

    def _rank_gone(self, rank: _Rank) -> None:
        del self._ranks[rank.path]
        self._dirty.pop(rank.path, None)
        if self._committed.pop(rank.key, None) is not None:
            self._state_dirty = True
        self._call("on_rank_gone", rank.key)

    def _forget_all(self) -> None:
        for rank in list(self._ranks.values()):
            self._rank_gone(rank)
        super()._forget_all()

    def _forget_dir(self, directory: str) -> None:
        for path, rank in list(self._ranks.items()):
            if within(path, directory):
                self._rank_gone(rank)
        super()._forget_dir(directory)

    @staticmethod
    def _ahead(rank: _Rank, name: str) -> bool:
        return rank.cursor.file is None or name >= rank.cursor.file

    def _drop_file(self, rank: _Rank, name: str) -> None:
        """A known file went away: lost if it held bytes not read yet (as far as we know its size)."""
        if name not in rank.files:
            return
        size = rank.files.pop(name)
        read = rank.cursor.offset if name == rank.cursor.file else 0
        if size is not None and size > read:
            self._bad(rank.key, "records_lost",
                      f"{rank.path}/{name} deleted with {size - read} byte(s) not read (read to {read} of {size})")

    def _bad_dir(self, path: str) -> None:
        if path in self._bad_dirs or len(self._bad_dirs) >= BACKLOG_MAX:
            return
        self._bad_dirs.add(path)
        self._bad(None, "rank_dir" if "/" in path else "job_dir", os.fsencode(path).decode(errors="backslashreplace"))

    # ---- events ---------------------------------------------------------------------------------

    async def _apply(self, pending: dict[tuple[int, str], int]) -> bool:
        """Apply one batch of events; False: the root itself went away."""
        new_dirs: list[str] = []

        def on_name(directory: str, name: str, what: int) -> None:
            depth, path = _depth(directory), join(directory, name)
            if depth < 2:  # names of jobs (depth 0) or ranks (depth 1)
                if what & DIR_GONE:
                    self._forget_dir(path)
                if what & DIR_NEW:
                    if _is_dir_name(depth, name):
                        new_dirs.append(path)
                    else:
                        self._bad_dir(path)
            elif (rank := self._ranks.get(directory)) is not None:
                self._file_event(rank, name, what)

        if not self._dispatch(pending, on_name):
            return False
        if new_dirs:
            walks = await self._in_thread(self._walk_each, new_dirs)
            for path, walk in walks:
                self._note(walk.problems)
                self._watches.update(walk.watches)
                self._adopt(walk, path, fresh=True)
        return True

    def _file_event(self, rank: _Rank, name: str, what: int) -> None:
        if is_record_name(name):
            if what & LAST_GONE:
                self._drop_file(rank, name)
            elif self._ahead(rank, name):  # an older name is never written again: ignore it
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
            jobs.append(_ReadJob(path, rank.cursor, tuple(sorted(rank.files)), rank.group_dirty))
        outcomes = await self._in_thread(self._read_ranks, jobs)
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

    def _take(self, rank: _Rank, out: _Outcome) -> bool:
        self._note(out.problems)
        self._bytes_read += out.bytes_read
        for name, size in out.sizes.items():
            if name in rank.files or name == out.cursor.file:
                rank.files[name] = size
        for name in out.refused:
            rank.files.pop(name, None)
            self._note([("a record name that is not a regular file is ignored", f"{rank.path}/{name}", "")])
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
        rank.cursor = out.cursor
        if out.cursor.file is not None:
            for name in [name for name in rank.files if name < out.cursor.file]:
                size = rank.files.pop(name)
                if size is not None:
                    rank.finished[name] = size
            while len(rank.finished) > FINISHED_KEPT:
                del rank.finished[min(rank.finished)]
        if out.group is not None:
            rank.group_dirty = False
            self._take_group(rank, out.group)
        return delivered

    def _take_group(self, rank: _Rank, group: _Group) -> None:
        if group.kind == "gone":
            rank.group_digest = None
        elif group.kind == "error":
            self._note([("cannot read a parallel group file", f"{rank.path}/{GROUP_FILE}", str(group.value))])
        elif group.digest != rank.group_digest:  # MODIFY and CLOSE_WRITE may come in separate batches
            rank.group_digest = group.digest
            if group.kind == "ok":
                self._call("on_group", rank.key, group.value)
            else:
                self._bad(rank.key, "parallel_group", f"{rank.path}/{GROUP_FILE}: {group.value}")

    # ---- worker thread --------------------------------------------------------------------------

    def _read_ranks(self, jobs: list[_ReadJob]) -> list[_Outcome | None]:
        budget = _Budget(self._max_read)
        try:
            root_fd = os.open(self._root, DIR_FLAGS)
        except OSError as exc:  # gone or swapped: its events say so; no rank can be read now
            problems = [] if exc.errno in VANISHED else [("cannot open the root", ".", str(exc))]
            return [_Outcome(job.cursor, problems=problems) for job in jobs]
        try:
            return [self._read_rank(root_fd, job, budget) if budget.left > 0 else None for job in jobs]
        finally:
            os.close(root_fd)

    def _read_rank(self, root_fd: int, job: _ReadJob, budget: _Budget) -> _Outcome:
        out = _Outcome(job.cursor)
        try:
            dir_fd = open_dir(root_fd, job.path.split("/"))
        except OSError as exc:
            if exc.errno not in VANISHED:  # removed: its events say so
                out.problems.append(("cannot open a rank directory", job.path, str(exc)))
            return out
        try:
            if job.group:
                out.group = self._read_group(dir_fd)
            self._read_files(dir_fd, job, budget, out)
        finally:
            os.close(dir_fd)
        return out

    def _read_files(self, dir_fd: int, job: _ReadJob, budget: _Budget, out: _Outcome) -> None:
        cursor = job.cursor
        names = list(job.names)
        while True:
            if cursor.file is None:
                if not names:
                    break
                cursor = _Cursor(names[0], 0)
            # Before reading this file to its end: is there a newer one (the writer has left this one)?
            newer, newer_size = self._next_file(dir_fd, [name for name in names if name > cursor.file], out)
            names = [name for name in names if name not in out.missing and name not in out.refused]
            cursor, status, tail = self._read_file(dir_fd, cursor, budget, out)
            if status == "more":
                out.more = True
                break
            if status in ("missing", "refused"):
                (out.missing if status == "missing" else out.refused).append(cursor.file)
                if newer is None:
                    break  # the cursor waits on the name; a newer file moves it on
                cursor = _Cursor(newer, 0)
                continue
            if status != "eof" or newer is None:
                break
            if tail:
                if newer_size == 0:
                    break  # the newer file is still empty: this line may yet be finished
                out.events.append(("bad", "partial_line_at_rotation",
                                   f"{job.path}/{cursor.file}: {tail} byte(s) at offset {cursor.offset} without a "
                                   f"newline dropped; {newer} has data"))
            cursor = _Cursor(newer, 0)
        out.cursor = cursor

    @staticmethod
    def _next_file(dir_fd: int, candidates: list[str], out: _Outcome) -> tuple[str | None, int]:
        for name in candidates:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                out.missing.append(name)
                continue
            except OSError as exc:
                out.problems.append(("cannot stat a record file", name, str(exc)))
                return None, 0  # not known to be there: stay on the current file
            if not stat.S_ISREG(st.st_mode):
                out.refused.append(name)
                continue
            out.sizes[name] = st.st_size
            return name, st.st_size
        return None, 0

    def _read_file(self, dir_fd: int, cursor: _Cursor, budget: _Budget,
                   out: _Outcome) -> tuple[_Cursor, str, int]:
        """Read `cursor.file` from the cursor towards EOF: (new cursor, "eof" | "more" | "missing" |
        "refused" | "error", bytes of a partial last line left at EOF)."""
        name = cursor.file
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return cursor, "missing", 0
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return cursor, "refused", 0
            out.problems.append(("cannot open a record file", name, str(exc)))
            return cursor, "error", 0
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return cursor, "refused", 0
            if cursor.inode is not None and st.st_ino != cursor.inode:
                out.events.append(("bad", "file_replaced", f"{name}: another file (inode {st.st_ino}, was "
                                   f"{cursor.inode}) at offset {cursor.offset}; read again from 0"))
                cursor = _Cursor(name, 0)
            elif st.st_size < cursor.offset:
                out.events.append(("bad", "file_truncated", f"{name}: {st.st_size} bytes, below offset "
                                   f"{cursor.offset}; read again from 0"))
                cursor = _Cursor(name, 0)
            size = st.st_size
            out.sizes[name] = size
            offset, skipping, pos, buf = cursor.offset, cursor.skipping, cursor.offset, b""
            while pos < size and (budget.left > 0 or buf):  # a started line is always finished
                chunk = os.pread(fd, min(self._max_read, size - pos), pos)
                if not chunk:
                    size = pos  # shorter than fstat said: the next event tells more
                    break
                pos += len(chunk)
                budget.left -= len(chunk)
                out.bytes_read += len(chunk)
                if skipping:
                    newline = chunk.find(b"\n")
                    if newline < 0:
                        offset = pos
                        continue
                    chunk = chunk[newline + 1:]
                    offset, skipping = pos - len(chunk), False
                buf = buf + chunk if buf else chunk
                last = buf.rfind(b"\n")
                if last >= 0:
                    self._lines_of(name, offset, buf[:last + 1], out)
                    offset += last + 1
                    buf = buf[last + 1:]
                if len(buf) > LINE_MAX:
                    out.events.append(_too_long(name, offset))
                    offset, buf, skipping = offset + len(buf), b"", True
            cursor = _Cursor(name, offset, st.st_ino, skipping)
            return cursor, ("eof" if pos >= size else "more"), pos - offset
        except OSError as exc:
            out.problems.append(("cannot read a record file", name, str(exc)))
            return cursor, "error", 0
        finally:
            os.close(fd)

    @staticmethod
    def _lines_of(name: str, offset: int, block: bytes, out: _Outcome) -> None:
        """Hand over `block`, whole lines read at `offset`, less those longer than LINE_MAX. A window of
        LINE_MAX + 1 bytes holding no newline is the start of one, so a few searches cover a 4 MiB read."""
        start = line = 0  # what is not handed over yet; the first line not checked
        while len(block) - line > LINE_MAX + 1:  # a line starting here may be too long
            end = block.rfind(b"\n", line, line + LINE_MAX + 1)
            if end >= 0:  # every line starting up to `end` ends by it
                line = end + 1
                continue
            if line > start:
                out.events.append(("lines", name, offset + start, block[start:line]))
            out.events.append(_too_long(name, offset + line))
            start = line = block.index(b"\n", line + LINE_MAX) + 1
        if start < len(block):
            out.events.append(("lines", name, offset + start, block[start:]))

    @staticmethod
    def _read_group(dir_fd: int) -> _Group:
        try:
            fd = os.open(GROUP_FILE, _FILE_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return _Group("gone")
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return _Group("bad", b"symlink", "a symlink, not followed")
            return _Group("error", value=str(exc))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return _Group("bad", b"not regular", "not a regular file")
            data = b""
            while len(data) <= GROUP_MAX:
                chunk = os.pread(fd, GROUP_MAX + 1 - len(data), len(data))
                if not chunk:
                    break
                data += chunk
        except OSError as exc:
            return _Group("error", value=str(exc))
        finally:
            os.close(fd)
        digest = hashlib.sha256(data).digest()
        if len(data) > GROUP_MAX:
            return _Group("bad", digest, f"larger than {GROUP_MAX} bytes")
        try:
            value = json.loads(data)
        except (ValueError, RecursionError) as exc:
            return _Group("bad", digest, f"not JSON: {exc}")
        if not isinstance(value, dict):
            return _Group("bad", digest, f"not a JSON object but {type(value).__name__}")
        return _Group("ok", digest, value)

    def _walk_each(self, directories: list[str]) -> list[tuple[str, _Walk]]:
        return [(directory, self._walk(directory, False)) for directory in directories]

    def _walk(self, start: str, want_ends: bool) -> _Walk:
        """Watch and list `start` ("" is the root) and the job and rank directories below it."""
        return self._walk_tree(start, _Walk(), lambda fd, directory, out: self._list(fd, directory, out, want_ends))

    def _list(self, fd: int, directory: str, out: _Walk, want_ends: bool) -> list[str]:
        """A rank directory's files; above the ranks, the subdirectories to walk."""
        depth = _depth(directory)
        if depth == 2:
            out.ranks.append(self._list_rank(fd, directory, want_ends, out))
            return []
        with os.scandir(fd) as entries:
            children = [entry.name for entry in entries if entry.is_dir(follow_symlinks=False)]
        out.bad_dirs.extend(join(directory, name) for name in children if not _is_dir_name(depth, name))
        return [name for name in children if _is_dir_name(depth, name)]

    def _list_rank(self, fd: int, directory: str, want_ends: bool, out: _Walk) -> _RankSeen:
        found = _RankSeen(directory, os.fstat(fd).st_ino)
        with os.scandir(fd) as entries:
            for entry in entries:
                name = entry.name
                if not (name == GROUP_FILE or is_record_name(name)):
                    continue
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue  # symlinks, directories, FIFOs: never followed
                    size = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue  # deleted since it was listed
                except OSError as exc:
                    out.problems.append(("cannot stat a file", f"{directory}/{name}", str(exc)))
                    continue
                if name == GROUP_FILE:
                    found.group = True
                else:
                    found.files[name] = size
        if want_ends and found.files:
            found.end = self._line_end(fd, max(found.files))
        return found

    @staticmethod
    def _line_end(dir_fd: int, name: str) -> tuple[int, bool]:
        """Where the last complete line of `name` ends, and whether the rest is a line too long to keep."""
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
        except OSError:
            return 0, False  # gone: the cursor moves on from the missing name
        try:
            size = os.fstat(fd).st_size
            end = size
            while end > 0 and size - end <= LINE_MAX:
                begin = max(0, end - (64 << 10))
                newline = os.pread(fd, end - begin, begin).rfind(b"\n")
                if newline >= 0:
                    return begin + newline + 1, False
                end = begin
            return (0, False) if end == 0 else (size, True)
        except OSError:
            return 0, False
        finally:
            os.close(fd)

    # ---- the state file -------------------------------------------------------------------------

    def _load_state(self) -> None:
        # One of the wrong shape is moved aside: ranks start as if new (from the end of their newest file).
        self._resume = read_state(self.state_file, "profiling tailer state", _parse_state) or {}

    def _save_state(self) -> None:
        if not self._state_dirty:
            return
        ranks = {f"{key.job_id}/{key.rank}": {"file": position.file, "offset": position.offset}
                 | ({} if size is None else {"size": size}) for key, (position, size) in self._resume.items()}
        for key, position in self._committed.items():
            path = f"{key.job_id}/{key.rank}"
            rank = self._ranks.get(path)
            size = None
            if rank is not None:
                size = rank.files.get(position.file, rank.finished.get(position.file))
            ranks[path] = {"file": position.file, "offset": position.offset} | ({} if size is None else {"size": size})
        data = json.dumps({"version": STATE_VERSION, "ranks": ranks}, sort_keys=True).encode()
        try:
            atomic_write(self.state_file, data)  # small and local: written on the loop, like the fault history
        except OSError as exc:
            self._note([("cannot write the state file", str(self.state_file), str(exc))])
            return
        self._state_dirty = False

    # ---- reporting ------------------------------------------------------------------------------

    def _bad(self, key: RankKey | None, reason: str, detail: str) -> None:
        self._call("on_bad_input", key, reason, detail)

    def _call(self, method: str, *args):
        """Call the consumer; its exceptions are logged once per method and counted, never fatal."""
        try:
            return getattr(self._consumer, method)(*args)
        except Exception:
            self._errors += 1
            if ("consumer", method) not in self._logged and len(self._logged) <= LOGGED_MAX:
                self._logged.add(("consumer", method))
                log.exception(f"profiling tailer: the consumer's {method} failed; the tailer goes on",
                              extra={"root": self._root})


def _too_long(name: str, offset: int) -> tuple:
    return ("bad", "line_too_long", f"{name}: a line at offset {offset} is longer than {LINE_MAX} bytes; skipped")


def _parse_state(doc: dict) -> dict[RankKey, tuple[Position, int | None]]:
    """The state file as `_save_state` writes it, checked: anything else raises."""
    if doc.get("version") != STATE_VERSION or not isinstance(doc.get("ranks"), dict):
        raise ValueError(f"not a version {STATE_VERSION} state with a ranks object")
    resume = {}
    for name, entry in doc["ranks"].items():
        job, _, rank = name.rpartition("/")
        file, offset, size = entry.get("file"), entry.get("offset"), entry.get("size")
        if not (job and _is_rank_name(rank) and isinstance(file, str) and is_record_name(file)
                and type(offset) is int and offset >= 0 and (size is None or type(size) is int)):
            raise ValueError(f"bad entry {name!r:.80}: {entry!r:.200}")
        resume[RankKey(job, int(rank))] = (Position(file, offset), size)
    return resume
