"""The profiling disk guard: one node-level owner keeps the profiling tree under its size limit.

TaskD makes every worker process walk the whole tree every 60 s and delete files of its own rank
number (any name but `parallel_group.json`). Here one component walks the tree once, at start-up,
and then follows it with inotify: a write costs one `lstat` of the file written, not a walk, so
the cost does not grow with the files already on disk.

The tree is `<root>/<job>/<rank>/<file>`; record files are named by exactly 10 ASCII digits (the
Unix second the rank started the file) and a rank appends to its newest one. Usage counts every
regular file anywhere under the root; symlinks are never followed, counted or deleted.

Events are coalesced while they wait: per (directory, name) only what matters is kept (is it gone,
is it a new directory, or must it be `lstat`ed), so a batch costs one `lstat` per file touched,
however many writes it saw, and the backlog is bounded by the files touched, not the events.

Which files age is decided by `disk_rules.choose_victims` (pure). A pass deletes them oldest first
in chunks, updating usage after each: it is back under the limit after the first chunk or so, and
finishes the round for fairness. A write that crosses the limit is seen after the batch window
(0.1 s), so usage is back under it about that long after.

`limit_bytes <= 0` disables aging; usage is still measured.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from inotify_simple import INotify, flags, parse_events

from agent.devices.pool import DaemonPool
from agent.profiling.disk_rules import FileEntry, UsageLedger, choose_victims, is_record_name

log = logging.getLogger(__name__)

ROOT_POLL_S = 2.0
# After the first event of a batch, let the kernel queue more for this long (not reading it, so
# not woken by each): a write's MODIFY and CLOSE_WRITE and the other ranks' writes then cost one
# wake-up and one trip to the worker thread instead of one each.
BATCH_WINDOW_S = 0.1
STUCK_RETRY_S = 30.0  # over the limit with nothing deletable: look again this often (or on a new record file)
# Distinct files with events waiting while a scan or an aging pass runs (~10 MB at most); past
# this, a rescan. Our own deletions count too: a pass of more than this many files ends in a rescan.
BACKLOG_MAX = 65_536
AGING_CHUNK = 500  # files deleted per trip to the worker thread; usage is updated after each
LOGGED_MAX = 1_000  # distinct problems logged; later ones are only counted

# Directories only, never through a symlink. CREATE/MOVED_TO/DELETE/MOVED_FROM keep the set of
# files; MODIFY/CLOSE_WRITE say a file grew; ATTRIB catches `touch`, which reorders aging.
WATCH_MASK = (flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO | flags.MODIFY
              | flags.CLOSE_WRITE | flags.ATTRIB | flags.DELETE_SELF | flags.MOVE_SELF
              | flags.ONLYDIR | flags.DONT_FOLLOW)
_GONE_SELF = flags.DELETE_SELF | flags.MOVE_SELF | flags.UNMOUNT
_GONE = flags.DELETE | flags.MOVED_FROM
_ARRIVED = flags.CREATE | flags.MOVED_TO
# What the waiting events of one (directory, name) add up to; no bit set: lstat it.
_LAST_GONE = 1  # the last event said the name went away
_DIR_GONE = 2  # a directory of that name went away at some point (forget it, whatever came after)
_DIR_NEW = 4  # the last event said a directory arrived (walk it)
_SELF_GONE = 8  # name "": the watched directory itself was deleted, moved or unmounted
_SELF_IGNORED = 16  # name "": the kernel dropped the watch


def _join(directory: str, name: str) -> str:
    return f"{directory}/{name}" if directory else name


@dataclass
class _Walk:
    """What a walk of a subtree found (built in a worker thread, applied on the loop)."""
    start_ok: bool = True  # the start directory could be opened
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (size, mtime_ns)
    watches: dict[int, str] = field(default_factory=dict)  # wd -> directory
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (what, path, error)


@dataclass
class _Refresh:
    stats: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # None: not a regular file (any more)
    walks: list[tuple[str, _Walk]] = field(default_factory=list)
    problems: list[tuple[str, str, str]] = field(default_factory=list)


@dataclass
class _Deleted:
    """One chunk of an aging pass."""
    deleted: list[tuple[str, int]] = field(default_factory=list)  # (path, bytes)
    vanished: list[str] = field(default_factory=list)  # chosen, but no longer a regular file there
    problems: list[tuple[str, str, str]] = field(default_factory=list)


class DiskGuard:
    """Measures the profiling tree with inotify and ages record files when it outgrows `limit_bytes`.

    All state changes happen in one task on the loop; walks, `lstat`s and deletions run on one
    daemon thread (a hung file system must not hold the loop or SIGTERM). The inotify descriptor is
    read with `loop.add_reader`; events are coalesced until the task takes them as one batch.
    """

    name = "disk-guard"

    def __init__(self, root: Path, limit_bytes: int, *, clock: Callable[[], float] = time.monotonic,
                 root_poll_s: float = ROOT_POLL_S, batch_window_s: float = BATCH_WINDOW_S):
        self.root = Path(os.path.abspath(root))
        self.limit_bytes = limit_bytes
        self._root = str(self.root)
        self._clock = clock
        self._root_poll_s = root_poll_s
        self._batch_window_s = batch_window_s
        self._ledger = UsageLedger()
        self._watches: dict[int, str] = {}  # wd -> directory relative to the root ("" is the root)
        self._inotify: INotify | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: DaemonPool | None = None
        self._task: asyncio.Task | None = None
        self._inflight: Future | None = None
        self._pending: dict[tuple[int, str], int] = {}  # (wd, name) -> _LAST_GONE | _DIR_GONE | ...
        self._overflowed = False  # IN_Q_OVERFLOW, or our own backlog full: rescan
        self._wakeup = asyncio.Event()
        self._stuck_at: float | None = None  # when a pass found nothing deletable while over the limit
        self._logged: set[tuple[str, str]] = set()
        self._settled = False  # the first scan is done, or there was no root to scan
        self._failure = ""
        self._state = "not started"
        self._files_aged = 0
        self._bytes_aged = 0
        self._aging_passes = 0
        self._scans = 0
        self._overflows = 0
        self._errors = 0

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
        return self._scans

    @property
    def overflows(self) -> int:
        """Events lost (the kernel's IN_Q_OVERFLOW, or our own backlog cap), each mended by a rescan."""
        return self._overflows

    @property
    def errors(self) -> int:
        return self._errors

    @property
    def state(self) -> str:
        return self._state

    def tracked(self) -> dict[str, int]:
        """Path (relative to the root) -> size of every file counted."""
        return self._ledger.sizes()

    # ---- component ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            self._inotify = INotify(nonblocking=True)
        except OSError as exc:  # e.g. fs.inotify.max_user_instances reached
            self._failure = f"cannot watch {self._root}: inotify: {exc}"
            self._state = "failed"
            self._errors += 1
            log.error("profiling disk guard cannot start: no inotify instance", extra={
                "root": self._root, "error": str(exc)})
            return
        self._pool = DaemonPool(max_threads=1, name="disk-guard")
        self._loop.add_reader(self._inotify.fileno(), self._on_readable)
        if self.limit_bytes <= 0:
            log.info("profiling disk limit is 0: usage is measured, nothing is aged", extra={"root": self._root})
        self._task = asyncio.create_task(self._run(), name="disk-guard")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._inotify is None or self._inotify.closed:
            return
        self._loop.remove_reader(self._inotify.fileno())
        # The thread may still be adding watches: closing the descriptor under it could let the
        # number be reused for another file. Give it a moment; otherwise leave it to the exit.
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait([asyncio.wrap_future(self._inflight)], timeout=1.0)
        if self._inflight is None or self._inflight.done():
            self._inotify.close()
        self._pool.close()
        self._state = "stopped"

    def readiness(self) -> tuple[bool, str]:
        if self._failure:
            return False, self._failure
        if not self._settled:
            return False, f"first scan of {self._root} not finished"
        return True, ""  # a missing root is normal (no job has profiled yet): not a reason to be unready

    # ---- the task -------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end the guard for good: start again from a fresh scan
                self._errors += 1
                self._settled = True
                log.exception("profiling disk guard failed; starting again", extra={"root": self._root})
                self._forget_all()
                await asyncio.sleep(self._root_poll_s)

    async def _follow(self) -> None:
        while True:
            await self._wait_for_root()
            if not await self._rescan():
                await asyncio.sleep(self._root_poll_s)  # vanished or unreadable: look again later, not in a spin
                continue
            while True:
                await self._next_batch()
                pending, self._pending = self._pending, {}
                overflowed, self._overflowed = self._overflowed, False
                verdict = "rescan" if overflowed else await self._handle(pending)
                if verdict == "root gone":
                    self._forget_all()
                    log.warning("profiling root removed; waiting for it to come back", extra={"root": self._root})
                    break
                if verdict == "rescan" and not await self._rescan():
                    break
                await self._age_while_over()

    async def _next_batch(self) -> None:
        await self._wakeup.wait()
        if self._batch_window_s > 0:
            fd = self._inotify.fileno()
            self._loop.remove_reader(fd)  # let the kernel queue (and merge) for a while
            try:
                await asyncio.sleep(self._batch_window_s)
            finally:
                self._loop.add_reader(fd, self._on_readable)
            self._on_readable()
        self._wakeup.clear()

    async def _in_thread(self, fn: Callable, *args):
        self._inflight = self._pool.submit(fn, *args)
        return await asyncio.wrap_future(self._inflight)

    async def _wait_for_root(self) -> None:
        said = ""
        while True:
            problem = await self._in_thread(self._root_problem)
            if not problem:
                return
            self._state = problem
            self._settled = True
            if problem != said:  # each new condition once, not every poll
                said = problem
                if problem == "waiting for root":
                    log.info("profiling root does not exist yet; polling for it", extra={
                        "root": self._root, "interval_s": self._root_poll_s})
                else:
                    log.error(f"profiling root refused: {problem}; nothing is followed, measured or aged",
                              extra={"root": self._root})
            await asyncio.sleep(self._root_poll_s)

    def _root_problem(self) -> str:
        try:
            mode = os.lstat(self._root).st_mode
        except FileNotFoundError:
            return "waiting for root"
        except OSError as exc:
            return f"cannot stat the root: {exc}"
        if stat.S_ISLNK(mode):
            return "the root is a symlink"
        if not stat.S_ISDIR(mode):
            return "the root is not a directory"
        return ""

    async def _rescan(self) -> bool:
        """Walk the whole tree and rebuild the ledger and the watches; False if the root was not there."""
        self._state = "scanning"
        started = self._clock()
        walk = await self._in_thread(self._walk, "")
        self._scans += 1
        self._record(walk.problems)
        stale = set(self._watches) - set(walk.watches)
        self._watches = dict(walk.watches)
        for wd in stale:
            self._rm_watch(wd)
        self._ledger = UsageLedger()
        for path, (size, mtime) in walk.files.items():
            self._ledger.set(path, size, mtime)
        self._stuck_at = None
        self._settled = True
        if not walk.start_ok:
            self._forget_all()
            return False
        self._state = "watching"
        log.info("profiling tree scanned", extra={
            "root": self._root, "files": len(self._ledger), "usage_bytes": self._ledger.total,
            "limit_bytes": self.limit_bytes, "directories": len(self._watches),
            "took_ms": round((self._clock() - started) * 1e3, 1)})
        await self._age_while_over()
        return True

    def _forget_all(self) -> None:
        for wd in list(self._watches):
            self._rm_watch(wd)
        self._watches.clear()
        self._ledger = UsageLedger()
        self._pending.clear()

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
                self._errors += 1
                log.error("cannot read inotify events", extra={"root": self._root, "error": str(exc)})
                break
            if not data:
                break
            read = True
            if self._overflowed:
                continue  # a rescan is coming: the details no longer matter
            for wd, mask, _, name in parse_events(data):
                if mask & flags.Q_OVERFLOW:
                    self._overflowed = True
                    self._overflows += 1
                    log.warning("profiling tree: inotify queue overflowed; rescanning", extra={"root": self._root})
                    break
                key = (wd, name)
                before = pending.get(key, 0)
                if not name:  # about the watched directory itself
                    pending[key] = (before | (_SELF_GONE if mask & _GONE_SELF else 0)
                                    | (_SELF_IGNORED if mask & flags.IGNORED else 0))
                elif mask & _GONE:
                    pending[key] = before | _LAST_GONE | (_DIR_GONE if mask & flags.ISDIR else 0)
                elif mask & flags.ISDIR:
                    if mask & _ARRIVED:
                        pending[key] = (before & _DIR_GONE) | _DIR_NEW
                    # other events on a subdirectory (ATTRIB) say nothing about sizes
                else:
                    pending[key] = before & _DIR_GONE  # a file changed or arrived: lstat it
            if len(pending) > BACKLOG_MAX:
                pending.clear()
                self._overflowed = True
                self._overflows += 1
                log.warning("profiling tree: event backlog full; rescanning", extra={"root": self._root})
        if read:
            self._wakeup.set()

    async def _handle(self, pending: dict[tuple[int, str], int]) -> str:
        """Apply one batch: "" when done, "root gone"."""
        touched: list[str] = []  # files to lstat, each once per batch
        new_dirs: list[str] = []
        dropped: list[int] = []
        for (wd, name), what in pending.items():
            directory = self._watches.get(wd)
            if directory is None:
                continue  # a watch already forgotten
            if not name:
                if what & _SELF_GONE:
                    if directory == "":
                        return "root gone"
                    self._forget_dir(directory)  # its parent's event says the same; either is enough
                if what & _SELF_IGNORED:
                    dropped.append(wd)
                continue
            path = _join(directory, name)
            if what & _DIR_GONE:
                self._forget_dir(path)
            if what & _LAST_GONE:
                self._ledger.remove(path)  # gone: no need to look
            elif what & _DIR_NEW:
                new_dirs.append(path)
            else:
                touched.append(path)
        for wd in dropped:
            self._watches.pop(wd, None)
        if not touched and not new_dirs:
            return ""
        refresh = await self._in_thread(self._refresh, touched, new_dirs)
        self._record(refresh.problems)
        for path, found in refresh.stats.items():
            if found is None:
                self._ledger.remove(path)
            elif self._ledger.set(path, *found):
                self._unstick(path)
        for directory, walk in refresh.walks:
            self._record(walk.problems)
            self._ledger.remove_tree(directory)  # a directory moved over another one, or over a file
            self._watches.update(walk.watches)
            for path, (size, mtime) in walk.files.items():
                self._ledger.set(path, size, mtime)
                self._unstick(path)
        return ""

    def _forget_dir(self, directory: str) -> None:
        self._ledger.remove_tree(directory)
        below = directory + "/"
        for wd, path in list(self._watches.items()):
            if path == directory or path.startswith(below):
                del self._watches[wd]
                self._rm_watch(wd)  # a directory moved out of the root is still watched otherwise

    def _unstick(self, path: str) -> None:
        if self._stuck_at is not None and path.count("/") == 2 and is_record_name(path.rpartition("/")[2]):
            self._stuck_at = None  # a rank rotated: its previous file may be aged now

    def _record(self, problems: list[tuple[str, str, str]]) -> None:
        """Count every problem; log each (what, path) once, and only the first LOGGED_MAX of them."""
        self._errors += len(problems)
        for what, path, error in problems:
            key = (what, path)
            if key in self._logged or len(self._logged) > LOGGED_MAX:
                continue
            self._logged.add(key)
            if len(self._logged) > LOGGED_MAX:
                log.warning("profiling tree: more problems than are worth logging; they are only counted",
                            extra={"root": self._root})
                continue
            log.warning(f"profiling tree: {what}", extra={"root": self._root, "path": path, "error": error})

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
            victims = await self._in_thread(self._choose)
            deleted = freed = vanished = failed = 0
            under_ms = None
            for at in range(0, len(victims), AGING_CHUNK):
                chunk = await self._quietly(self._delete, victims[at:at + AGING_CHUNK])
                self._record(chunk.problems)
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

    async def _quietly(self, fn: Callable, *args):
        """Run a short job in the thread without reading events meanwhile: the events of our own
        deletions wait in the kernel (a chunk raises far fewer than its queue holds) instead of
        waking the loop, which would take the GIL from the thread, hundreds of times a chunk."""
        fd = self._inotify.fileno()
        self._loop.remove_reader(fd)
        try:
            return await self._in_thread(fn, *args)
        finally:
            self._loop.add_reader(fd, self._on_readable)
            self._on_readable()

    def _choose(self) -> list[FileEntry]:
        """The pass's victims, oldest first across ranks: the oldest data goes first (worker thread)."""
        victims = choose_victims(self._ledger, self.limit_bytes)
        victims.sort(key=lambda e: (e.mtime, e.path))
        return victims

    def _delete(self, victims: list[FileEntry]) -> _Deleted:
        """Delete the chosen files (worker thread), each re-checked right before its unlink."""
        result = _Deleted()
        real_root = os.path.realpath(self._root)
        by_dir: dict[str, list[FileEntry]] = {}
        for victim in victims:
            by_dir.setdefault(victim.path.rpartition("/")[0], []).append(victim)
        for directory, entries in by_dir.items():
            try:
                dir_fd = self._open_rank_dir(directory, real_root)
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

    def _open_rank_dir(self, directory: str, real_root: str) -> int:
        """A descriptor of `<root>/<job>/<rank>`, only if that really is a directory of the tree."""
        expected = os.path.join(real_root, *directory.split("/"))
        if os.path.realpath(os.path.join(self._root, directory)) != expected:
            raise OSError(errno.EXDEV, "resolves outside the profiling root (a symlink on the way)")
        fd = os.open(expected, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            opened = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            opened = expected  # no /proc: the realpath check above has to do
        if opened != expected:  # a job directory swapped for a symlink between the check and the open
            os.close(fd)
            raise OSError(errno.EXDEV, f"opened {opened}, not the rank directory")
        return fd

    # ---- walking (worker thread) ----------------------------------------------------------------

    def _walk(self, start: str) -> _Walk:
        """Watch and list every directory from `start` down, never through a symlink."""
        out = _Walk()
        pending = [start]
        while pending:
            directory = pending.pop()
            path = os.path.join(self._root, directory) if directory else self._root
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                if directory == start:
                    out.start_ok = False
                # Removed since it was listed (its parent's event says so), or became a symlink or
                # a file: nothing to report, nothing of ours to follow.
                if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                    out.problems.append(("cannot read a directory", directory or ".", str(exc)))
                continue
            try:
                try:
                    # Watch before listing: whatever appears after the listing raises an event.
                    out.watches[self._inotify.add_watch(path, WATCH_MASK)] = directory
                except OSError as exc:  # ENOSPC: fs.inotify.max_user_watches; ENOENT: just removed
                    if exc.errno != errno.ENOENT:
                        out.problems.append(("cannot watch a directory", directory or ".", str(exc)))
                with os.scandir(fd) as entries:
                    for entry in entries:
                        child = _join(directory, entry.name)
                        try:
                            if entry.is_dir(follow_symlinks=False):
                                pending.append(child)
                            elif entry.is_file(follow_symlinks=False):
                                st = entry.stat(follow_symlinks=False)
                                if stat.S_ISREG(st.st_mode):
                                    out.files[child] = (st.st_size, st.st_mtime_ns)
                            # symlinks, sockets, fifos: not counted, never followed
                        except FileNotFoundError:
                            pass  # deleted since it was listed: normal (a rank or TaskD ages its files too)
                        except OSError as exc:
                            out.problems.append(("cannot stat a file", child, str(exc)))
            except OSError as exc:
                out.problems.append(("cannot list a directory", directory or ".", str(exc)))
            finally:
                os.close(fd)
        return out

    def _refresh(self, paths: list[str], new_dirs: list[str]) -> _Refresh:
        """lstat the files a batch touched; walk the directories it created."""
        out = _Refresh()
        for path in paths:
            try:
                st = os.lstat(os.path.join(self._root, path))
            except (FileNotFoundError, NotADirectoryError):
                out.stats[path] = None
                continue
            except OSError as exc:
                out.problems.append(("cannot stat a file", path, str(exc)))
                continue
            out.stats[path] = (st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None
        for directory in new_dirs:
            out.walks.append((directory, self._walk(directory)))
        return out
