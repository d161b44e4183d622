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
* Never a partial record: when a write is cut short (a full disk), the whole lines that reached the
  file stay (counted as written), and the file is truncated back to the end of the last of them. If
  it cannot be truncated (an append-only file, ...), the rest of that one record is kept and written
  before anything else goes to the file; until it is, every batch is dropped (counted) rather than
  glued to it. `records_written` is the number of complete lines this writer put on disk.

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
        # (file name, its size, the bytes that complete the record, the record's size): a cut-short
        # write's partial record in a file that could not be truncated
        self._partial: tuple[str, int, bytes, int] | None = None
        self._partial_error: OSError | None = None

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
        if not self._finish_partial():
            self._error(self._partial_error, len(data), data.count(b"\n"), self._partial_context())
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
        return self._batch(lambda fd: _write_all(fd, data), lambda: (len(data), data.count(b"\n")))

    def write_from(self, source) -> int:
        """Append the complete lines waiting in `source` (`agent._native.Collector`: `pending`,
        `drain_to`, `discard`), written by it straight from its buffer; returns the bytes written.
        Exactly `write(source.drain())`, without the copy: the lines past the cap are discarded
        (whole lines, counted), a failed write drops its batch (counted). Never raises OSError."""
        waiting = source.pending()
        if not waiting:
            return 0
        if not self._finish_partial():
            self._error(self._partial_error, *source.discard(), self._partial_context())
            return 0
        room = max(0, self.limit_bytes - self.bytes_written)
        fit = waiting if waiting <= room else source.pending(room)  # whole lines
        try:
            if not fit:
                return 0
            # a failed write: the batch is gone from the collector, as `write` drops it
            return self._batch(lambda fd: source.drain_to(fd, fit), lambda: source.discard(fit))
        finally:
            if fit < waiting:  # the lines of this round past the cap
                size, lines = source.discard(waiting - fit)
                self.bytes_dropped_limit += size
                self.records_dropped_limit += lines

    # -- internals ---------------------------------------------------------------------------------

    def _batch(self, write, drop) -> int:
        """One batch: `write(fd)` appends it to the target file -> (bytes, lines), or raises OSError
        carrying `written`, `size`, `lines`, `whole`, `whole_lines` and `rest` (`_write_all`,
        `Collector.drain_to`); `drop()` discards it when no file can be opened -> (bytes, lines)."""
        try:
            fd, name = self._open_target()
            try:
                start = os.fstat(fd).st_size  # O_APPEND: where the batch goes (only this writer appends to its files)
            except OSError:
                os.close(fd)
                raise
        except OSError as exc:
            self._error(exc, *drop())
            return 0
        try:
            try:
                written, lines = write(fd)
            except OSError as exc:
                return self._cut_short(exc, fd, name, start)
            self.bytes_written += written
            self.records_written += lines
            return written
        finally:
            os.close(fd)

    def _cut_short(self, exc: OSError, fd: int, name: str, start: int) -> int:
        """A batch whose write failed after `exc.written` bytes: keep its whole lines, remove the
        partial one (or keep its rest to complete it), count the rest as dropped. Returns the bytes kept."""
        written, size, lines = exc.written, exc.size, exc.lines
        # a collector built before these were reported: back to the batch's start, nothing to complete
        whole, whole_lines = getattr(exc, "whole", 0), getattr(exc, "whole_lines", 0)
        rest = getattr(exc, "rest", b"")
        pending_bytes = pending_lines = 0
        detail = None
        if written > whole:
            try:
                os.ftruncate(fd, start + whole)
                detail = "the partial record after them truncated away"
            except OSError as cut_exc:
                reason = f"{type(cut_exc).__name__}: {cut_exc}"
                if rest:
                    pending_bytes, pending_lines = written - whole + len(rest), 1
                    self._partial = (name, start + written, rest, pending_bytes)
                    detail = (f"the partial record after them could not be truncated away ({reason}) and is "
                              f"completed before the next write")
                else:  # a source that cannot say how the record ends: nothing can mend it
                    detail = f"the partial record after them could not be truncated away ({reason})"
        self.bytes_written += whole
        self.records_written += whole_lines
        context = None
        if written:
            context = f"{whole_lines} of {lines} records written" + (f", {detail}" if detail else "")
        self._error(exc, size - whole - pending_bytes, lines - whole_lines - pending_lines, context, name)
        return whole

    def _finish_partial(self) -> bool:
        """Write the rest of the record a cut-short write left at the end of a file that could not
        be truncated. True when no partial record is left (written, or its file is gone); False
        (`_partial_error` set) when it is still there: nothing may be appended after it then."""
        if self._partial is None:
            return True
        name, end, rest, size = self._partial
        try:
            dir_fd = self._open_rank_dir()
            try:
                fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
        except FileNotFoundError:
            return self._abandon_partial()  # the file is gone (aged out), and the partial record with it
        except OSError as exc:
            self._partial_error = exc
            return False
        try:
            if os.fstat(fd).st_size != end:  # not ours any more: writing the rest could not mend it
                return self._abandon_partial()
            _write_all(fd, rest)
        except OSError as exc:
            done = getattr(exc, "written", 0)
            self._partial = (name, end + done, rest[done:], size)
            self._partial_error = exc
            return False
        finally:
            os.close(fd)
        self._partial = None
        self.bytes_written += size
        self.records_written += 1
        return True

    def _abandon_partial(self) -> bool:
        self.records_dropped_error += 1
        self.bytes_dropped_error += self._partial[3]
        self._partial = None
        return True

    def _partial_context(self) -> str:
        return f"the partial record at the end of {self._partial[0]} is not completed yet"

    def _error(self, exc: OSError, size: int, lines: int, context: str | None = None, name: str | None = None) -> None:
        self.write_errors += 1
        self.records_dropped_error += lines
        self.bytes_dropped_error += size
        self.last_error = f"{type(exc).__name__}: {exc}"
        now = self._monotonic()
        if self._last_log is None or now - self._last_log >= LOG_EVERY:
            self._last_log = now
            if name is None:
                log.warning("profiling records for rank %s not written to %s (%s)%s; dropped %d records so far",
                            self.rank, self.rank_dir, self.last_error, f": {context}" if context else "",
                            self.records_dropped_error)
            else:
                log.warning("profiling records for rank %s not %swritten to %s (%s)%s; dropped %d records so far",
                            self.rank, "all " if context else "", os.path.join(self.rank_dir, name),
                            self.last_error, f": {context}" if context else "", self.records_dropped_error)

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

    def _open_target(self) -> tuple[int, str]:
        """The file to append to now, opened for appending (the caller closes it), and its name."""
        dir_fd = self._open_rank_dir()
        try:
            name = self._target(dir_fd)
            flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dir_fd)
            except FileExistsError:
                return os.open(name, flags, dir_fd=dir_fd), name
            try:
                os.fchmod(fd, 0o644)
            except OSError:
                os.close(fd)
                raise
            self.files_created += 1
            return fd, name
        finally:
            os.close(dir_fd)


def _write_all(fd: int, data: bytes) -> tuple[int, int]:
    """`data` (whole lines) to `fd` through short writes -> (bytes, lines); on an error, OSError
    with what the native `Collector.drain_to` reports: `written` (bytes that reached the file), `size`
    and `lines` (the batch), `whole` and `whole_lines` (its complete lines within `written`), and
    `rest` (the bytes that would complete the line cut at `written`; empty when none is)."""
    view = memoryview(data)
    written = 0
    try:
        while written < len(data):
            n = os.write(fd, view[written:])
            if n == 0:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            written += n
    except OSError as exc:
        whole = data.rfind(b"\n", 0, written) + 1
        exc.written, exc.size, exc.lines = written, len(data), data.count(b"\n")
        exc.whole, exc.whole_lines = whole, data.count(b"\n", 0, whole)
        end = data.find(b"\n", written)
        exc.rest = data[written:end + 1] if written > whole and end >= 0 else b""
        raise
    return written, data.count(b"\n")

