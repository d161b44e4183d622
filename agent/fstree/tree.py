"""Following the profiling tree with inotify: the machinery the disk guard and the record tailer share.

Both keep a view of `<root>` built by one walk (at start-up, when the root appears, after an event
overflow) and then kept by inotify, so the cost follows what is written, not what is on disk. All
state lives in one task on the loop; walks, `lstat`s, reads and deletions run on one daemon thread
(a hung file system must not hold the loop or SIGTERM). The inotify descriptor is read with
`loop.add_reader`; events are coalesced per (directory, name) until the task takes them as one batch.

A directory is opened by name under its parent's descriptor with O_NOFOLLOW and watched through
`/proc/self/fd/<fd>` of that descriptor, so one swapped for a symlink is never entered or watched;
nothing is reached by a full path, so depth (past PATH_MAX) is no limit.

A directory whose watch cannot be added (ENOSPC: fs.inotify.max_user_watches reached) raises no
events, so it is walked again, as if it had just appeared, every RETRY_FIRST_S doubling to
RETRY_MAX_S: that measures it and tries its watch again, until the watch holds. Meanwhile
readiness says how many directories are unwatched.

`TreeFollower` is the base of both: it runs the task (supervised by agent.lifecycle: waiting for the
root, rescans, batches; after a bug, a rescan) and keeps the watches; a subclass says what a walk
lists and how a batch is applied.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from inotify_simple import INotify, flags, parse_events

from agent.common.pool import DaemonPool
from agent.fstree.paths import Scopes
from agent.lifecycle import Tasks

ROOT_POLL_S = 2.0
# A directory that cannot be watched is walked again after this long, doubling up to the maximum:
# the most its usage can lag behind while fs.inotify.max_user_watches is too low.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0
# After the first event of a batch, let the kernel queue more for this long (not reading it, so
# not woken by each): a write's MODIFY and CLOSE_WRITE and the other ranks' writes then cost one
# wake-up and one trip to the worker thread instead of one each.
BATCH_WINDOW_S = 0.1
# Distinct (directory, name) with events waiting (~10 MB at most) while the task is busy; past this, a rescan.
BACKLOG_MAX = 65_536
LOGGED_MAX = 1_000  # distinct problems logged; later ones are only counted
OPEN_LEVELS = 64  # a walk holds descriptors of this many levels at most (and of its start)

# Directories only. Added through /proc/self/fd/<fd>, which must be followed (IN_DONT_FOLLOW would
# watch the proc link itself); without /proc the path is used with IN_DONT_FOLLOW.
WATCH_MASK = (flags.CREATE | flags.MODIFY | flags.CLOSE_WRITE | flags.MOVED_TO | flags.DELETE
              | flags.MOVED_FROM | flags.DELETE_SELF | flags.MOVE_SELF | flags.ONLYDIR)
_GONE_SELF = flags.DELETE_SELF | flags.MOVE_SELF | flags.UNMOUNT
_GONE = flags.DELETE | flags.MOVED_FROM
_ARRIVED = flags.CREATE | flags.MOVED_TO
_DONE = flags.CLOSE_WRITE | flags.MOVED_TO
# What the waiting events of one (directory, name) add up to; no bit set: the file changed (lstat or read it).
LAST_GONE = 1  # the last event said the name went away
DIR_GONE = 2  # a directory of that name went away at some point (forget it, whatever came after)
DIR_NEW = 4  # the last event said a directory arrived (walk it)
SELF_GONE = 8  # name "": the watched directory itself was deleted, moved or unmounted
SELF_IGNORED = 16  # name "": the kernel dropped the watch
CLOSED = 32  # the file was closed after writing or moved in

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
VANISHED = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)  # removed, or became a file or a symlink

Problem = tuple[str, str, str]  # (what, path, error): counted, and logged once per (what, path)


def join(directory: str, name: str) -> str:
    return f"{directory}/{name}" if directory else name


def within(path: str, scope: str) -> bool:
    return not scope or path == scope or path.startswith(scope + "/")


def open_dir(base_fd: int, parts: list[str]) -> int:
    """A new descriptor of `parts` under `base_fd`, no component followed if it is a symlink."""
    fd = base_fd
    for part in parts:
        try:
            child = os.open(part, DIR_FLAGS, dir_fd=fd)
        finally:
            if fd != base_fd:
                os.close(fd)
        fd = child
    return fd if fd != base_fd else os.dup(base_fd)


def open_under(root: str, directory: str) -> int:
    """A descriptor of `directory` ("" is the root itself) under `root`, never through a symlink."""
    root_fd = os.open(root, DIR_FLAGS)
    try:
        return open_dir(root_fd, directory.split("/") if directory else [])
    finally:
        os.close(root_fd)


def root_problem(root: str) -> str:
    """Why `root` cannot be followed now ("" if it can)."""
    try:
        mode = os.lstat(root).st_mode
    except FileNotFoundError:
        return "waiting for root"
    except OSError as exc:
        return f"cannot stat the root: {exc}"
    if stat.S_ISLNK(mode):
        return "the root is a symlink"
    if not stat.S_ISDIR(mode):
        return "the root is not a directory"
    return ""


@dataclass
class Walk:
    """What a walk found (built in the worker thread, applied on the loop); subclasses add their findings."""
    start_ok: bool = True  # the start directory could be opened
    watches: dict[int, str] = field(default_factory=dict)  # wd -> directory
    unwatched: dict[str, str] = field(default_factory=dict)  # directory -> why its watch could not be added
    problems: list[Problem] = field(default_factory=list)


W = TypeVar("W", bound=Walk)


class TreeFollower:
    """The task, the inotify watches and the worker thread of a component that follows the tree.

    A subclass implements `_walk(start, ...)` (with `_walk_tree`, in the thread), `_rescan` (with
    `_scan`: rebuild its view), `_apply` (one batch, through `_dispatch`) and `_recover` (tidy up
    after the task failed; agent.lifecycle logged it), and extends `_forget_all` / `_forget_dir` with what
    it keeps per directory.
    """

    name = ""  # of the task and the thread
    title = ""  # how its logs name it: "<title> cannot start"
    label = ""  # prefix of its problem logs
    refused = ""  # what a refused root means, in the log that says so
    stop_wait_s = 0.3  # stop() waits this long for the task, then for a walk that may still add watches

    def __init__(self, root: Path, *, log: logging.Logger, mask: int, clock: Callable[[], float],
                 root_poll_s: float, batch_window_s: float):
        self.root = Path(os.path.abspath(root))
        self._root = str(self.root)
        self._log = log
        self._clock = clock
        self._root_poll_s = root_poll_s
        self._batch_window_s = batch_window_s
        self._proc_fd = os.path.isdir("/proc/self/fd")
        self._mask = mask if self._proc_fd else mask | flags.DONT_FOLLOW  # see WATCH_MASK
        self._watches: dict[int, str] = {}  # wd -> directory relative to the root ("" is the root)
        self._pending: dict[tuple[int, str], int] = {}  # (wd, name) -> LAST_GONE | DIR_GONE | ...
        self._overflowed = False  # IN_Q_OVERFLOW, or our own backlog full: rescan
        self._wakeup = asyncio.Event()
        self._inotify: INotify | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: DaemonPool | None = None
        self.tasks = Tasks(self.name)
        self._inflight: Future | None = None
        self._unwatched: dict[str, str] = {}  # directory -> why it cannot be watched (walked again instead)
        self._walks_done: deque[tuple[str, dict[str, str]]] = deque()  # (scope, unwatched) to settle, in order
        self._retry: asyncio.TimerHandle | None = None
        self._retry_s = RETRY_FIRST_S
        self._stopped = False
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
        """Its own problems: unreadable directories and files, and the like."""
        return self._errors

    @property
    def state(self) -> str:
        return self._state

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
            self._log.error(f"{self.title} cannot start: no inotify instance",
                            extra={"root": self._root, "error": str(exc)})
            return
        self._pool = DaemonPool(max_threads=1, name=self.name)
        self._loop.add_reader(self._inotify.fileno(), self._on_readable)
        self.tasks.start("follow", self._follow, reset=self._reset)

    async def stop(self) -> None:
        self._stopped = True
        # A task waiting on a stuck thread ends at once: the thread is left behind.
        await self.tasks.stop(self.stop_wait_s)
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._inotify is None or self._inotify.closed:
            return
        self._loop.remove_reader(self._inotify.fileno())
        # The thread may still be adding watches: closing the descriptor under it could let the
        # number be reused for another file. Give it a moment; otherwise leave it to the exit.
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait([asyncio.wrap_future(self._inflight)], timeout=self.stop_wait_s)
        if self._inflight is None or self._inflight.done():
            self._inotify.close()
        self._pool.close()
        self._state = "stopped"

    def readiness(self) -> tuple[bool, str]:
        if self._failure:
            return False, self._failure
        if not self._settled:
            return False, f"first scan of {self._root} not finished"
        if self._unwatched:
            error = next(iter(self._unwatched.values()))
            return False, (f"{len(self._unwatched)} directories under {self._root} cannot be watched ({error}); "
                           f"they are walked again every {RETRY_MAX_S:g} s at most (raise fs.inotify.max_user_watches)")
        return True, ""  # a missing root is normal (no job has profiled yet): not a reason to be unready

    # ---- the task -------------------------------------------------------------------------------

    def _reset(self) -> None:
        """After the task failed (agent.lifecycle logged it): start again from a rescan."""
        self._errors += 1
        self._settled = True
        self._recover()

    async def _follow(self) -> None:
        while True:
            await self._wait_for_root()
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
                elif not await self._apply(pending):
                    self._forget_all()
                    self._log.warning("profiling root removed; waiting for it to come back",
                                      extra={"root": self._root})
                    break

    async def _next_batch(self) -> None:
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

    async def _in_thread(self, fn: Callable, *args):
        self._inflight = self._pool.submit(fn, *args)
        try:
            return await asyncio.wrap_future(self._inflight)
        finally:
            self._settle_unwatched()

    async def _wait_for_root(self) -> bool:
        """Poll until the root is a directory, logging each new condition once; True if it was not at first."""
        said = ""
        while True:
            problem = await self._in_thread(root_problem, self._root)
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
                    self._log.error(f"profiling root refused: {problem}; {self.refused}", extra={"root": self._root})
            await asyncio.sleep(self._root_poll_s)

    async def _scan(self, *args) -> Walk | None:
        """Walk the whole tree (`_walk("", *args)`) and take its watches; None if the root could not be opened."""
        self._state = "scanning"
        walk = await self._in_thread(self._walk, "", *args)
        self._scans += 1
        self._note(walk.problems)
        for wd in set(self._watches) - set(walk.watches):
            self._rm_watch(wd)
        self._watches = dict(walk.watches)
        self._settled = True
        if not walk.start_ok:
            self._forget_all()
            return None
        return walk

    # ---- watches --------------------------------------------------------------------------------

    def _forget_all(self) -> None:
        for wd in list(self._watches):
            self._rm_watch(wd)
        self._watches.clear()
        self._pending.clear()
        self._walked("", {})

    def _forget_dir(self, directory: str) -> None:
        for wd, path in list(self._watches.items()):
            if within(path, directory):
                del self._watches[wd]
                self._rm_watch(wd)  # a directory moved out of the root is still watched otherwise
        self._walked(directory, {})

    def _walked(self, scope: str, unwatched: dict[str, str]) -> None:
        """What a walk of `scope` (in the thread, or forgetting it on the loop) found it could not
        watch replaces what was known there: settled in order after each trip to the thread and
        each batch, all walks at once (a batch may walk thousands)."""
        self._walks_done.append((scope, unwatched))

    def _settle_unwatched(self) -> None:
        done = []
        while self._walks_done:
            done.append(self._walks_done.popleft())
        if not done:
            return
        last = {scope: i for i, (scope, _) in enumerate(done)}
        scopes = Scopes(last)

        def last_walk(path: str) -> int:  # the last of these walks that covered `path`; -1: none
            return max((last[scope] for scope in scopes.holding(path)), default=-1)

        had = bool(self._unwatched)
        self._unwatched = {d: why for d, why in self._unwatched.items() if last_walk(d) < 0}
        for i, (_, found) in enumerate(done):
            self._unwatched.update((d, why) for d, why in found.items() if last_walk(d) == i)
        if self._unwatched and not had:
            self._log.warning(f"{self.label}: directories cannot be watched; walking them again until they can be",
                              extra={"root": self._root, "directories": len(self._unwatched),
                                     "error": next(iter(self._unwatched.values())), "max_interval_s": RETRY_MAX_S})
        elif had and not self._unwatched:
            self._log.info(f"{self.label}: every directory is watched again", extra={"root": self._root})
        if not self._unwatched:
            self._retry_s = RETRY_FIRST_S
            if self._retry is not None:
                self._retry.cancel()
                self._retry = None
        self._schedule_retry()

    def _retry_unwatched(self) -> None:
        """Walk the unwatched directories again, as if they had just appeared: that measures them and
        tries their watches again. A directory is walked from its highest unwatched ancestor."""
        self._retry = None
        self._retry_s = min(RETRY_MAX_S, self._retry_s * 2)
        tops: list[str] = []  # the highest unwatched directories: what lies below them is walked with them
        for directory in sorted(self._unwatched, key=lambda d: d.split("/") if d else []):  # parents first
            if not tops or not within(directory, tops[-1]):
                tops.append(directory)
        by_path = {path: wd for wd, path in self._watches.items()}
        for directory in tops:
            parent, _, name = directory.rpartition("/")
            wd = by_path.get(parent) if directory else None
            if wd is None:  # the root, or a directory whose parent is not watched either: all of it
                self._overflowed = True
                break
            what = self._pending.get((wd, name), 0)
            if not what & LAST_GONE:
                self._pending[(wd, name)] = what | DIR_NEW
        self._wakeup.set()
        self._schedule_retry()

    def _schedule_retry(self) -> None:
        if self._unwatched and self._retry is None and not self._stopped:
            self._retry = self._loop.call_later(self._retry_s, self._retry_unwatched)

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
                self._note([("cannot read inotify events", ".", str(exc))])
                break
            if not data:
                break
            read = True
            if self._overflowed:
                continue  # a rescan is coming: the details no longer matter
            for wd, mask, _, name in parse_events(data):
                if mask & flags.Q_OVERFLOW:
                    self._overflow("inotify queue overflowed")
                    break
                key = (wd, name)
                before = pending.get(key, 0)
                if not name:  # about the watched directory itself
                    pending[key] = (before | (SELF_GONE if mask & _GONE_SELF else 0)
                                    | (SELF_IGNORED if mask & flags.IGNORED else 0))
                elif mask & _GONE:
                    pending[key] = (before & DIR_GONE) | LAST_GONE | (DIR_GONE if mask & flags.ISDIR else 0)
                elif mask & flags.ISDIR:
                    if mask & _ARRIVED:
                        pending[key] = (before & DIR_GONE) | DIR_NEW
                    # other events on a subdirectory (ATTRIB) say nothing about files
                else:
                    pending[key] = (before & (DIR_GONE | CLOSED)) | (CLOSED if mask & _DONE else 0)
            if len(pending) > BACKLOG_MAX:
                self._overflow("event backlog full")
        if read:
            self._wakeup.set()

    def _overflow(self, why: str) -> None:
        self._pending.clear()
        self._overflowed = True
        self._overflows += 1
        self._log.warning(f"{self.label}: {why}; rescanning", extra={"root": self._root})

    def _dispatch(self, pending: dict[tuple[int, str], int], on_name: Callable[[str, str, int], None]) -> bool:
        """Apply a batch's events on watched directories themselves and hand those on names to
        `on_name(directory, name, what)`, in order; False: the root itself went away."""
        dropped: list[int] = []
        for (wd, name), what in pending.items():
            directory = self._watches.get(wd)
            if directory is None:
                continue  # a watch already forgotten
            if name:
                on_name(directory, name, what)
                continue
            if what & SELF_GONE:
                if directory == "":
                    return False
                self._forget_dir(directory)  # its parent's event says the same; either is enough
            if what & SELF_IGNORED:
                dropped.append(wd)
        for wd in dropped:
            self._watches.pop(wd, None)
        return True

    def _note(self, problems: list[Problem]) -> None:
        """Count every problem; log each (what, path) once, and only the first LOGGED_MAX of them."""
        self._errors += len(problems)
        for what, path, error in problems:
            key = (what, path)
            if key in self._logged or len(self._logged) > LOGGED_MAX:
                continue
            self._logged.add(key)
            if len(self._logged) > LOGGED_MAX:
                self._log.warning(f"{self.label}: more problems than are worth logging; they are only counted",
                                  extra={"root": self._root})
                continue
            self._log.warning(f"{self.label}: {what}", extra={"root": self._root, "path": path, "error": error})

    # ---- walking (worker thread) ----------------------------------------------------------------

    def _walk_tree(self, start: str, out: W, list_dir: Callable[[int, str, W], list[str]]) -> W:
        """Watch, then list, `start` ("" is the root) and, all the way down, the subdirectories that
        `list_dir(fd, directory, out)` returns. Descriptors are held for the start and the deepest
        OPEN_LEVELS levels only, so a tree of any depth needs no recursion and a bounded number of
        them; a level closed meanwhile is opened again, by name, when the walk comes back to it."""
        try:
            fd = open_under(self._root, start)
        except OSError as exc:
            out.start_ok = False
            if exc.errno not in VANISHED:
                out.problems.append(("cannot open a directory", start or ".", str(exc)))
            self._walked(start, {})
            return out
        # [fd or None, directory, subdirectories left to visit] down to the current directory; each
        # fd is in `levels` before its directory is listed, so it is closed whatever happens.
        levels: list[list] = [[fd, start, []]]
        try:
            levels[-1][2].extend(self._watch_and_list(fd, start, out, list_dir))
            while levels:
                level = levels[-1]
                parent, directory, children = level
                if not children:
                    if levels.pop()[0] is not None:
                        os.close(parent)
                    continue
                name = children.pop()
                path = join(directory, name)
                try:
                    if parent is None:
                        parent = level[0] = self._reopen(levels)
                    fd = os.open(name, DIR_FLAGS, dir_fd=parent)
                except OSError as exc:
                    # Removed since it was listed (its parent's event says so), or became a symlink
                    # or a file: nothing to report, nothing of ours to follow.
                    if exc.errno not in VANISHED:
                        out.problems.append(("cannot open a directory", path, str(exc)))
                    if level[0] is None:
                        children.clear()  # its directory is gone: so are they
                    continue
                levels.append([fd, path, []])
                if len(levels) > OPEN_LEVELS + 1 and (far := levels[-OPEN_LEVELS - 1])[0] is not None:
                    os.close(far[0])
                    far[0] = None
                levels[-1][2].extend(self._watch_and_list(fd, path, out, list_dir))
        finally:
            for fd, _, _ in levels:
                if fd is not None:
                    os.close(fd)
        self._walked(start, out.unwatched)
        return out

    @staticmethod
    def _reopen(levels: list[list]) -> int:
        """A new descriptor of the last level's directory, by name from its nearest open ancestor."""
        base = next(level for level in reversed(levels) if level[0] is not None)  # the start always is
        below = levels[-1][1][len(base[1]) + 1 if base[1] else 0:]
        return open_dir(base[0], below.split("/"))

    def _watch_and_list(self, fd: int, directory: str, out: W,
                        list_dir: Callable[[int, str, W], list[str]]) -> list[str]:
        """Watch before listing: whatever appears after the listing raises an event."""
        try:
            target = f"/proc/self/fd/{fd}" if self._proc_fd else os.path.join(self._root, directory)
            try:
                out.watches[self._inotify.add_watch(target, self._mask)] = directory
            except OSError as exc:  # ENOSPC: fs.inotify.max_user_watches; ENOENT: just removed
                if exc.errno != errno.ENOENT:
                    out.unwatched[directory] = str(exc)
            return list_dir(fd, directory, out)
        except OSError as exc:
            out.problems.append(("cannot list a directory", directory or ".", str(exc)))
            return []
