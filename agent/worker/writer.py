"""Append whole record lines to `<root>/<job>/<rank>/<10-digit unix seconds>` (TaskD's layout, §1.6).

* Each write goes to the newest 10-digit file of the rank directory; a new file named after the
  current second is started when there is none or the newest is strictly larger than 10 MiB (checked
  before each write, so a file overshoots by at most one write). Two rotations within one second
  append to the same name, as TaskD does.
* Directories are created 0755, files 0644. The rank directory is opened with O_NOFOLLOW (a rank path
  that is a symlink is refused) and the file is opened relative to it, again with O_NOFOLLOW.
* The process's own output never exceeds `limit_mb` MiB: whole lines that fit are written, the rest is
  dropped and counted. Aging the tree is the node agent's disk guard's job, not this one.
* A write error (read-only, ENOSPC, refused path) drops that batch, is counted, and is logged at most
  once a minute; nothing is kept for a retry, so memory never grows.

`write(data)` takes the lines as bytes; `write_from(collector)` has the native collector write its
waiting lines from its own buffer to the file (`drain_to`, no copy through Python, no GIL while
writing), with the same cap, rotation, checks, counters and logging.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time

log = logging.getLogger("agent.worker")

FILE_LIMIT = 10 * 1024 * 1024
MAX_RANK_PATH = 1024
_NAME = re.compile(r"^\d{10}$")
LOG_EVERY = 60.0


class RankWriter:
    def __init__(self, root: str, job: str, rank: int, limit_mb: int, *, clock=time.time,
                 monotonic=time.monotonic) -> None:
        self.root = root
        self.job = job
        self.rank = rank
        self.limit_bytes = max(0, int(limit_mb)) * 1024 * 1024
        self.rank_dir = os.path.join(root, job, str(rank))
        self._clock = clock
        self._monotonic = monotonic
        self._last_log = None
        self.bytes_written = 0
        self.records_written = 0
        self.files_created = 0
        self.records_dropped_limit = 0
        self.bytes_dropped_limit = 0
        self.records_dropped_error = 0
        self.bytes_dropped_error = 0
        self.write_errors = 0
        self.last_error = ""

    def stats(self) -> dict:
        return {
            "bytes_written": self.bytes_written, "records_written": self.records_written,
            "files_created": self.files_created,
            "records_dropped_limit": self.records_dropped_limit, "bytes_dropped_limit": self.bytes_dropped_limit,
            "records_dropped_error": self.records_dropped_error, "bytes_dropped_error": self.bytes_dropped_error,
            "write_errors": self.write_errors, "last_error": self.last_error,
        }

    def write(self, data: bytes) -> int:
        """Append `data` (complete lines); returns the bytes written. Never raises OSError."""
        if not data:
            return 0
        room = self.limit_bytes - self.bytes_written
        if len(data) > room:
            cut = data.rfind(b"\n", 0, room) + 1 if room > 0 else 0
            dropped = data[cut:]
            self.records_dropped_limit += dropped.count(b"\n")
            self.bytes_dropped_limit += len(dropped)
            data = data[:cut]
            if not data:
                return 0
        try:
            written = self._append(data)
        except OSError as exc:
            self._error(exc, len(data), data.count(b"\n"))
            return 0
        self.bytes_written += written
        self.records_written += data.count(b"\n")
        return written

    def write_from(self, source) -> int:
        """Append the complete lines waiting in `source` (`agent._native.Collector`: `pending`,
        `drain_to`, `discard`), written by it straight from its buffer; returns the bytes written.
        Exactly `write(source.drain())`, without the copy: the lines past the cap are discarded
        (whole lines, counted), a failed write drops its batch (counted). Never raises OSError."""
        waiting = source.pending()
        if not waiting:
            return 0
        room = max(0, self.limit_bytes - self.bytes_written)
        fit = waiting if waiting <= room else source.pending(room)  # whole lines
        try:
            if not fit:
                return 0
            try:
                fd = self._open_target()
            except OSError as exc:
                self._error(exc, *source.discard(fit))
                return 0
            try:
                written, lines = source.drain_to(fd, fit)
            except OSError as exc:  # the batch is gone from the collector, as `write` drops it
                self._error(exc, exc.size, exc.lines)
                return 0
            finally:
                os.close(fd)
            self.bytes_written += written
            self.records_written += lines
            return written
        finally:
            if fit < waiting:  # the lines of this round past the cap
                size, lines = source.discard(waiting - fit)
                self.bytes_dropped_limit += size
                self.records_dropped_limit += lines

    # -- internals ---------------------------------------------------------------------------------

    def _error(self, exc: OSError, size: int, lines: int) -> None:
        self.write_errors += 1
        self.records_dropped_error += lines
        self.bytes_dropped_error += size
        self.last_error = f"{type(exc).__name__}: {exc}"
        now = self._monotonic()
        if self._last_log is None or now - self._last_log >= LOG_EVERY:
            self._last_log = now
            log.warning("profiling records for rank %s not written to %s (%s); dropped %d records so far",
                        self.rank, self.rank_dir, self.last_error, self.records_dropped_error)

    def _makedirs(self) -> None:
        os.makedirs(self.root, 0o755, exist_ok=True)
        self._mkdir(os.path.join(self.root, self.job))

    @staticmethod
    def _mkdir(path: str) -> None:
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            return
        os.chmod(path, 0o755)  # whatever the umask

    def _open_rank_dir(self) -> int:
        if len(self.rank_dir) > MAX_RANK_PATH:
            raise OSError(errno.ENAMETOOLONG, "rank path longer than 1024 characters", self.rank_dir)
        self._makedirs()
        self._mkdir(self.rank_dir)
        try:
            return os.open(self.rank_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(self.rank_dir):
                raise OSError(errno.ELOOP, "rank directory is a symlink; refused", self.rank_dir) from None
            raise

    def _target(self, dir_fd: int) -> str:
        newest = None
        for name in os.listdir(dir_fd):
            if _NAME.match(name) and (newest is None or name > newest):
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                newest = name
        if newest is not None:
            st = os.stat(newest, dir_fd=dir_fd, follow_symlinks=False)
            if st.st_size <= FILE_LIMIT:
                return newest
        return "%010d" % int(self._clock())

    def _open_target(self) -> int:
        """The file to append to now, opened for appending (the caller closes it)."""
        dir_fd = self._open_rank_dir()
        try:
            name = self._target(dir_fd)
            flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd)
            except FileExistsError:
                return os.open(name, flags, dir_fd=dir_fd)
            try:
                os.fchmod(fd, 0o644)
            except OSError:
                os.close(fd)
                raise
            self.files_created += 1
            return fd
        finally:
            os.close(dir_fd)

    def _append(self, data: bytes) -> int:
        fd = self._open_target()
        try:
            view = memoryview(data)
            total = 0
            while total < len(data):
                total += os.write(fd, view[total:])
            return total
        finally:
            os.close(fd)

