"""Following the profiling tree with inotify: the component the disk guard and the record tailer each own.

Both keep a view of `<root>` built by one walk (at start-up, when the root appears, after an event
overflow) and then kept by inotify, so the cost follows what is written, not what is on disk. All
state lives in one task on the loop; walks, `lstat`s, reads and deletions run on an executor's
thread (a hung file system must not hold the loop or SIGTERM). The inotify descriptor is read with
`loop.add_reader`; events are coalesced per (directory, name) (agent.fstree.events) until the task
takes them as one batch.

Directories are watched through `/proc/self/fd/<fd>` of a descriptor opened without following a
symlink (agent.fstree.walk), so one swapped for a symlink is never watched.

A directory whose watch cannot be added raises no events, so it is walked again until its watch
holds (agent.fstree.unwatched); meanwhile readiness says how many directories are unwatched.

`TreeFollower` runs the task (supervised by agent.lifecycle in its owner's `Tasks`: waiting for the
root, rescans, batches; after a bug, a rescan) and keeps the watches; its owner implements
`TreeEvents` (what a walk notes, and how its view follows the tree) and calls the follower's public
methods (`scan`, `walk`, `take`, `run`, `forget`, `note`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Generic, Protocol

from inotify_simple import INotify, flags

from agent.common import executor as blocking
from agent.fstree.events import DIR_GONE, DIR_NEW, LAST_GONE, SELF_GONE, SELF_IGNORED, WATCH_MASK, Change, coalesce
from agent.fstree.paths import PathMap, join
from agent.fstree.unwatched import RETRY_MAX_S, Unwatched
from agent.fstree.walk import Problem, W, root_problem, walk_tree
from agent.lifecycle import Tasks

ROOT_POLL_S = 2.0
# After the first event of a batch, let the kernel queue more for this long (not reading it, so
# not woken by each): a write's MODIFY and CLOSE_WRITE and the other ranks' writes then cost one
# wake-up and one trip to the worker thread instead of one each.
BATCH_WINDOW_S = 0.1
# Distinct (directory, name) with events waiting (~10 MB at most) while the task is busy; past this, a rescan.
BACKLOG_MAX = 65_536
LOGGED_MAX = 1_000  # distinct problems logged; later ones are only counted


class Executor(Protocol):
    """What runs the blocking work: a concurrent.futures executor, e.g. a lane of agent.common.executor."""

    def submit(self, fn: Callable, /, *args) -> Future: ...


class RootGone(Exception):
    """Raised while a batch's changes are iterated: the root itself went away (everything is forgotten)."""


class TreeEvents(Protocol[W]):
    """What the owner of a `TreeFollower` implements. All but `list_dir` are called on the loop, from
    the follower's task; none of them is called after `stop()`."""

    def list_dir(self, fd: int, directory: str, walk: W) -> list[str]:
        """(Worker thread, during a walk.) Note in `walk` what `directory` (open as `fd`) holds; the
        names of its subdirectories to walk as well."""

    async def rescan(self, initial: bool) -> bool:
        """Rebuild the view from `await follower.scan(walk)`: at start-up, when the root (re)appears,
        after events were lost. `initial`: the tree as the agent found it when it started. False:
        the root could not be opened (the follower waits for it again)."""

    async def apply(self, changes: Iterator[Change]) -> None:
        """One batch: iterate `changes` to its end, in order. A directory that went away (DIR_GONE,
        or a watched one's own event) is forgotten (`gone`) as its change is met; when the root
        itself went, iterating raises RootGone: let it through."""

    def gone(self, directory: str) -> None:
        """`directory` ("": the root, everything) and all below it went away: forget what is kept there."""

    async def catch_up(self) -> bool:
        """Before waiting for the next batch: one round of work left over from earlier ones, if any
        (True). The follower then takes the events queued meanwhile without waiting for more."""

    def failed(self) -> None:
        """The task failed (agent.lifecycle logged it); it starts again with a rescan."""


class TreeFollower(Generic[W]):
    """The task, the inotify watches and the worker thread of a component that follows the tree.

    `tasks`: the owner's, where the follower runs its task "follow" (and which `stop` ends);
    `title`, `label` and `refused` word its logs ("<title> cannot start", "<label>: <problem>",
    "profiling root refused: ...; <refused>"); `executor` runs the blocking work (default: a daemon
    thread of its own); `stop_wait_s`: how long `stop` waits for the task, then for a walk that may
    still add watches.
    """

    def __init__(self, root: Path, events: TreeEvents[W], *, tasks: Tasks, log: logging.Logger, title: str,
                 label: str, refused: str, mask: int = WATCH_MASK, root_poll_s: float = ROOT_POLL_S,
                 batch_window_s: float = BATCH_WINDOW_S, stop_wait_s: float = 0.3, executor: Executor | None = None):
        self.root = Path(os.path.abspath(root))
        self.tasks = tasks
        self._root = str(self.root)
        self._events = events
        self._log = log
        self._title, self._label, self._refused = title, label, refused
        self._root_poll_s = root_poll_s
        self._batch_window_s = batch_window_s
        self._stop_wait_s = stop_wait_s
        self._executor = executor
        self._own: blocking.Executor | None = None  # threads of its own, when built without an executor
        self._proc_fd = os.path.isdir("/proc/self/fd")
        self._mask = mask if self._proc_fd else mask | flags.DONT_FOLLOW  # see WATCH_MASK
        self._watches: dict[int, str] = {}  # wd -> directory relative to the root ("" is the root)
        self._dirs: PathMap[dict[int, None]] = PathMap()  # directory -> its wds, in order of arrival
        self._pending: dict[tuple[int, str], int] = {}  # (wd, name) -> LAST_GONE | DIR_GONE | ...
        self._overflowed = False  # IN_Q_OVERFLOW, or our own backlog full: rescan
        self._wakeup = asyncio.Event()
        self._inotify: INotify | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: Future | None = None
        self._unwatched = Unwatched(log, label, self._root)  # walked again instead
        self._retry: asyncio.TimerHandle | None = None  # the next walk of them
        self._stopped = False
        self._initial = True  # the next rescan is of the tree as the agent found it
        self._logged: set[tuple[str, str]] = set()
        self._settled = False  # the first scan is done, or there was no root to scan
        self._failure = ""
        self._state = "not started"
        self._scans = 0
        self._overflows = 0
        self._errors = 0

    @property
    def overflows(self) -> int:
        """Events lost (the kernel's IN_Q_OVERFLOW, or our own backlog cap), each mended by a rescan."""
        return self._overflows

    @property
    def errors(self) -> int:
        """Its own problems: unreadable directories and files, and the like (what `note` counted)."""
        return self._errors

    @property
    def state(self) -> str:
        return self._state

    @property
    def scans(self) -> int:
        """Full walks of the tree: start-up, the root appearing, an inotify overflow."""
        return self._scans

    @property
    def watched(self) -> int:
        """Directories watched."""
        return len(self._watches)

    @property
    def unwatched(self) -> int:
        """Directories whose inotify watch could not be added: followed by walking them again."""
        return len(self._unwatched)

    # ---- component ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            self._inotify = INotify(nonblocking=True)
        except OSError as exc:  # e.g. fs.inotify.max_user_instances reached
            self._failure = f"cannot watch {self._root}: inotify: {exc}"
            self._state = "failed"
            self._errors += 1
            self._log.error(f"{self._title} cannot start: no inotify instance",
                            extra={"root": self._root, "error": str(exc)})
            return
        if self._executor is None:
            self._own = blocking.Executor(name=self.tasks.component)
            self._executor = self._own.lane("walks")
        self._loop.add_reader(self._inotify.fileno(), self._on_readable)
        self.tasks.start("follow", self._follow, reset=self._reset)

    async def stop(self) -> None:
        """End the owner's tasks, then the watches."""
        self._stopped = True
        # A task waiting on a stuck thread ends at once: the thread is left behind.
        await self.tasks.stop(self._stop_wait_s)
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._inotify is None or self._inotify.closed:
            return
        self._loop.remove_reader(self._inotify.fileno())
        # The thread may still be adding watches: closing the descriptor under it could let the
        # number be reused for another file. Give it a moment; otherwise leave it to the exit.
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait([asyncio.wrap_future(self._inflight)], timeout=self._stop_wait_s)
        if self._inflight is None or self._inflight.done():
            self._inotify.close()
        if self._own is not None:
            self._own.close()
        self._state = "stopped"

    def readiness(self) -> tuple[bool, str]:
        if self._failure:
            return False, self._failure
        if not self._settled:
            return False, f"first scan of {self._root} not finished"
        if self._unwatched:
            return False, (f"{len(self._unwatched)} directories under {self._root} cannot be watched "
                           f"({self._unwatched.error()}); they are walked again every {RETRY_MAX_S:g} s at most "
                           "(raise fs.inotify.max_user_watches)")
        return True, ""  # a missing root is normal (no job has profiled yet): not a reason to be unready

    # ---- for the owner --------------------------------------------------------------------------

    async def scan(self, walk: W) -> W | None:
        """Walk the whole tree into `walk` and take its watches; None if the root could not be
        opened (then everything is forgotten)."""
        self._state = "scanning"
        walk = await self.run(self.walk, "", walk)
        self._scans += 1
        self.note(walk.problems)
        for wd in set(self._watches) - set(walk.watches):
            self._rm_watch(wd)
        self._watches, self._dirs = {}, PathMap()
        self.take(walk)
        self._settled = True
        if not walk.start_ok:
            self.forget("")
            return None
        self._state = "watching"
        return walk

    def walk(self, start: str, walk: W) -> W:
        """(Worker thread.) Watch and list `start` ("" is the root) and every subdirectory the
        owner's `list_dir` names, all the way down, into `walk`; hand it to `take` on the loop."""
        walk_tree(self._root, start, walk, self._add_watch, self._events.list_dir)
        self._unwatched.walked(start, walk.unwatched)
        return walk

    def take(self, walk: W) -> None:
        """Take the watches a walk added."""
        for wd, directory in walk.watches.items():
            old = self._watches.get(wd)
            if old == directory:
                continue
            if old is not None:
                self._unindex(wd, old)
            self._watches[wd] = directory
            wds = self._dirs.get(directory)
            if wds is None:
                self._dirs[directory] = wds = {}
            wds[wd] = None

    async def run(self, fn: Callable, *args, quiet: bool = False):
        """`fn(*args)` on the executor. `quiet`: for a short job, without reading events meanwhile:
        the events it raises itself (deletions) wait in the kernel instead of waking the loop, which
        would take the GIL from the thread, hundreds of times a chunk."""
        if quiet:
            with self._reader_paused():
                return await self.run(fn, *args)
        self._inflight = self._executor.submit(fn, *args)
        try:
            return await asyncio.wrap_future(self._inflight)
        finally:
            self._settle_unwatched()

    def forget(self, directory: str) -> None:
        """`directory` ("": everything) went away: the owner forgets it (`gone`), and its watches
        go, at a cost that follows the directories below it."""
        self._events.gone(directory)
        for _, wds in self._dirs.pop_tree(directory):
            for wd in wds:
                del self._watches[wd]
                self._rm_watch(wd)  # a directory moved out of the root is still watched otherwise
        if not directory:
            self._pending.clear()
        self._unwatched.walked(directory, {})

    def note(self, problems: list[Problem]) -> None:
        """Count every problem; log each (what, path) once, and only the first LOGGED_MAX of them."""
        self._errors += len(problems)
        for what, path, error in problems:
            key = (what, path)
            if key in self._logged or len(self._logged) > LOGGED_MAX:
                continue
            self._logged.add(key)
            if len(self._logged) > LOGGED_MAX:
                self._log.warning(f"{self._label}: more problems than are worth logging; they are only counted",
                                  extra={"root": self._root})
                continue
            self._log.warning(f"{self._label}: {what}", extra={"root": self._root, "path": path, "error": error})

    # ---- the task -------------------------------------------------------------------------------

    def _reset(self) -> None:
        """After the task failed (agent.lifecycle logged it): start again from a rescan."""
        self._errors += 1
        self._settled = True
        self._pending.clear()
        self._events.failed()

    async def _follow(self) -> None:
        while True:
            if await self._wait_for_root():
                self._initial = False  # whatever is there now appeared while the agent was running
            if not await self._rescan():
                await asyncio.sleep(self._root_poll_s)  # vanished or unreadable: look again later, not in a spin
                continue
            while True:
                self._settle_unwatched()
                await self._next_batch()
                pending, self._pending = self._pending, {}
                overflowed, self._overflowed = self._overflowed, False
                if overflowed:
                    if not await self._rescan():
                        break
                    continue
                try:
                    await self._events.apply(self._changes(pending))
                except RootGone:
                    self._log.warning("profiling root removed; waiting for it to come back", extra={"root": self._root})
                    break

    async def _rescan(self) -> bool:
        initial, self._initial = self._initial, False
        return await self._events.rescan(initial)

    async def _next_batch(self) -> None:
        if await self._events.catch_up():
            self._on_readable()  # take what is queued, without waiting for more
            self._wakeup.clear()
            return
        await self._wakeup.wait()
        if self._batch_window_s > 0:
            with self._reader_paused():  # let the kernel queue (and merge) for a while
                await asyncio.sleep(self._batch_window_s)
        self._wakeup.clear()

    @contextmanager
    def _reader_paused(self) -> Iterator[None]:
        """Leave events in the kernel meanwhile, then take them all at once."""
        fd = self._inotify.fileno()
        self._loop.remove_reader(fd)
        try:
            yield
        finally:
            self._loop.add_reader(fd, self._on_readable)
            self._on_readable()

    async def _wait_for_root(self) -> bool:
        """Poll until the root is a directory, logging each new condition once; True if it was not at first."""
        said = ""
        while True:
            problem = await self.run(root_problem, self._root)
            if not problem:
                return bool(said)
            self._state = problem
            self._settled = True
            if problem != said:  # each new condition once, not every poll
                said = problem
                if problem == "waiting for root":
                    self._log.info("profiling root does not exist yet; polling for it", extra={
                        "root": self._root, "interval_s": self._root_poll_s})
                else:
                    self._log.error(f"profiling root refused: {problem}; {self._refused}", extra={"root": self._root})
            await asyncio.sleep(self._root_poll_s)

    # ---- watches --------------------------------------------------------------------------------

    def _add_watch(self, fd: int, directory: str) -> int:
        """(Worker thread.) Through the descriptor, never through a symlink put in its place since."""
        target = f"/proc/self/fd/{fd}" if self._proc_fd else os.path.join(self._root, directory)
        return self._inotify.add_watch(target, self._mask)

    def _unindex(self, wd: int, directory: str) -> None:
        wds = self._dirs.get(directory)
        if wds is not None:
            wds.pop(wd, None)
            if not wds:
                del self._dirs[directory]

    def _settle_unwatched(self) -> None:
        self._unwatched.settle()
        if not self._unwatched and self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._schedule_retry()

    def _retry_unwatched(self) -> None:
        """Walk the unwatched directories again, as if they had just appeared: that measures them and
        tries their watches again. A directory is walked from its highest unwatched ancestor."""
        self._retry = None
        for directory in self._unwatched.tops():
            parent, _, name = directory.rpartition("/")
            wds = self._dirs.get(parent) if directory else None
            if not wds:  # the root, or a directory whose parent is not watched either: all of it
                self._overflowed = True
                break
            key = (next(reversed(wds)), name)
            what = self._pending.get(key, 0)
            if not what & LAST_GONE:
                self._pending[key] = what | DIR_NEW
        self._wakeup.set()
        self._schedule_retry()

    def _schedule_retry(self) -> None:
        if self._unwatched and self._retry is None and not self._stopped:
            self._retry = self._loop.call_later(self._unwatched.delay_s, self._retry_unwatched)

    def _rm_watch(self, wd: int) -> None:
        try:
            self._inotify.rm_watch(wd)
        except (OSError, ValueError):
            pass  # already gone with its directory

    # ---- events ---------------------------------------------------------------------------------

    def _on_readable(self) -> None:
        """Move the queued events into memory, coalesced (also while the task is busy, so the
        kernel's queue does not overflow during a long scan), and wake the task."""
        pending = self._pending
        read = False
        while True:
            try:
                data = os.read(self._inotify.fileno(), 1 << 16)  # the kernel hands out whole events only
            except BlockingIOError:
                break
            except OSError as exc:
                self.note([("cannot read inotify events", ".", str(exc))])
                break
            if not data:
                break
            read = True
            if self._overflowed:
                continue  # a rescan is coming: the details no longer matter
            if coalesce(pending, data):
                self._overflow("inotify queue overflowed")
            elif len(pending) > BACKLOG_MAX:
                self._overflow("event backlog full")
        if read:
            self._wakeup.set()

    def _overflow(self, why: str) -> None:
        self._pending.clear()
        self._overflowed = True
        self._overflows += 1
        self._log.warning(f"{self._label}: {why}; rescanning", extra={"root": self._root})

    def _changes(self, pending: dict[tuple[int, str], int]) -> Iterator[Change]:
        """A batch's changes on names, in order, for the owner's `apply`; the events of watched
        directories themselves are applied on the way (see TreeEvents.apply)."""
        dropped: list[int] = []
        for (wd, name), what in pending.items():
            directory = self._watches.get(wd)
            if directory is None:
                continue  # a watch already forgotten
            if name:
                if what & DIR_GONE:
                    self.forget(join(directory, name))
                yield directory, name, what
                continue
            if what & SELF_GONE:
                if directory == "":
                    self.forget("")
                    raise RootGone
                self.forget(directory)  # its parent's event says the same; either is enough
            if what & SELF_IGNORED:
                dropped.append(wd)
        for wd in dropped:
            if (directory := self._watches.pop(wd, None)) is not None:
                self._unindex(wd, directory)
