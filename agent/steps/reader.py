"""Reading rank directories' record files (in a worker thread): from each cursor towards EOF, whole
lines only, within a byte budget shared by the ranks of one round; and their parallel_group.json.

- A read delivers up to the last `\\n`; a partial last line is read again with the next event. A
  line is at most 1 MiB (LINE_MAX, without its newline): a longer one, whether a read holds all of
  it or not, is reported as `line_too_long` and skipped to its newline.
- Files are read in name order. Whether a newer file exists is settled *before* the current one is
  read to its end: the writer finishes a file before it starts the next, so that read sees all the
  older file will ever hold. A partial line left at its end is dropped (`partial_line_at_rotation`)
  once the newer file has data; while the newer one is empty the older may still be finished.
- The current file truncated below the cursor (`file_truncated`) or replaced by another inode
  (`file_replaced`) is read again from 0.

Safety: every file is opened by name under a descriptor chain root -> job -> rank opened with
`O_NOFOLLOW | O_DIRECTORY`, with `O_NOFOLLOW | O_NONBLOCK` (a symlink is never followed, a FIFO
never blocks).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from dataclasses import dataclass, field

from agent.fstree.walk import DIR_FLAGS, VANISHED, Problem, open_dir
from agent.steps.cursors import Cursor

LINE_MAX = 1 << 20  # a longer line without "\n" is skipped
GROUP_FILE = "parallel_group.json"
GROUP_MAX = 1 << 20
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class ReadJob:
    path: str
    cursor: Cursor
    names: tuple[str, ...]  # known record names at or after the cursor's file, sorted
    group: bool  # read parallel_group.json too


@dataclass
class Group:
    kind: str  # "ok", "bad", "gone", "error"
    digest: bytes = b""
    value: object = None  # the dict, or the reason it is bad, or the error


@dataclass
class Outcome:
    cursor: Cursor
    events: list[tuple] = field(default_factory=list)  # ("lines", file, offset, data) | ("bad", reason, detail)
    sizes: dict[str, int] = field(default_factory=dict)  # sizes seen
    missing: list[str] = field(default_factory=list)  # known names found absent
    refused: list[str] = field(default_factory=list)  # record names that are not regular files
    problems: list[Problem] = field(default_factory=list)
    group: Group | None = None
    more: bool = False  # the budget ran out before EOF
    bytes_read: int = 0


@dataclass
class _Budget:
    left: int


def read_ranks(root: str, jobs: list[ReadJob], max_read: int) -> list[Outcome | None]:
    """(Worker thread.) Read each rank from its cursor towards EOF, up to `max_read` bytes in all (a
    started line is always finished); None for the ranks the budget did not reach."""
    budget = _Budget(max_read)
    try:
        root_fd = os.open(root, DIR_FLAGS)
    except OSError as exc:  # gone or swapped: its events say so; no rank can be read now
        problems = [] if exc.errno in VANISHED else [("cannot open the root", ".", str(exc))]
        return [Outcome(job.cursor, problems=problems) for job in jobs]
    try:
        return [_read_rank(root_fd, job, budget, max_read) if budget.left > 0 else None for job in jobs]
    finally:
        os.close(root_fd)


def _read_rank(root_fd: int, job: ReadJob, budget: _Budget, max_read: int) -> Outcome:
    out = Outcome(job.cursor)
    try:
        dir_fd = open_dir(root_fd, job.path.split("/"))
    except OSError as exc:
        if exc.errno not in VANISHED:  # removed: its events say so
            out.problems.append(("cannot open a rank directory", job.path, str(exc)))
        return out
    try:
        if job.group:
            out.group = read_group(dir_fd)
        _read_files(dir_fd, job, budget, max_read, out)
    finally:
        os.close(dir_fd)
    return out


def _read_files(dir_fd: int, job: ReadJob, budget: _Budget, max_read: int, out: Outcome) -> None:
    cursor = job.cursor
    names = list(job.names)
    while True:
        if cursor.file is None:
            if not names:
                break
            cursor = Cursor(names[0], 0)
        # Before reading this file to its end: is there a newer one (the writer has left this one)?
        newer, newer_size = _next_file(dir_fd, [name for name in names if name > cursor.file], out)
        names = [name for name in names if name not in out.missing and name not in out.refused]
        cursor, status, tail = _read_file(dir_fd, cursor, budget, max_read, out)
        if status == "more":
            out.more = True
            break
        if status in ("missing", "refused"):
            (out.missing if status == "missing" else out.refused).append(cursor.file)
            if newer is None:
                break  # the cursor waits on the name; a newer file moves it on
            cursor = Cursor(newer, 0)
            continue
        if status != "eof" or newer is None:
            break
        if tail:
            if newer_size == 0:
                break  # the newer file is still empty: this line may yet be finished
            out.events.append(("bad", "partial_line_at_rotation",
                               f"{job.path}/{cursor.file}: {tail} byte(s) at offset {cursor.offset} without a "
                               f"newline dropped; {newer} has data"))
        cursor = Cursor(newer, 0)
    out.cursor = cursor


def _next_file(dir_fd: int, candidates: list[str], out: Outcome) -> tuple[str | None, int]:
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


def _read_file(dir_fd: int, cursor: Cursor, budget: _Budget, max_read: int,
               out: Outcome) -> tuple[Cursor, str, int]:
    """Read `cursor.file` from the cursor towards EOF: (new cursor, "eof" | "more" | "missing" |
    "refused" | "error", bytes of a partial last line left at EOF)."""
    name = cursor.file
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
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
            cursor = Cursor(name, 0)
        elif st.st_size < cursor.offset:
            out.events.append(("bad", "file_truncated", f"{name}: {st.st_size} bytes, below offset "
                               f"{cursor.offset}; read again from 0"))
            cursor = Cursor(name, 0)
        size = st.st_size
        out.sizes[name] = size
        offset, skipping, pos, buf = cursor.offset, cursor.skipping, cursor.offset, b""
        while pos < size and (budget.left > 0 or buf):  # a started line is always finished
            chunk = os.pread(fd, min(max_read, size - pos), pos)
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
                _lines_of(name, offset, buf[:last + 1], out)
                offset += last + 1
                buf = buf[last + 1:]
            if len(buf) > LINE_MAX:
                out.events.append(_too_long(name, offset))
                offset, buf, skipping = offset + len(buf), b"", True
        cursor = Cursor(name, offset, st.st_ino, skipping)
        return cursor, ("eof" if pos >= size else "more"), pos - offset
    except OSError as exc:
        out.problems.append(("cannot read a record file", name, str(exc)))
        return cursor, "error", 0
    finally:
        os.close(fd)


def _lines_of(name: str, offset: int, block: bytes, out: Outcome) -> None:
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


def read_group(dir_fd: int) -> Group:
    """parallel_group.json of a rank directory: parsed, or why not."""
    try:
        fd = os.open(GROUP_FILE, FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return Group("gone")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return Group("bad", b"symlink", "a symlink, not followed")
        return Group("error", value=str(exc))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return Group("bad", b"not regular", "not a regular file")
        data = b""
        while len(data) <= GROUP_MAX:
            chunk = os.pread(fd, GROUP_MAX + 1 - len(data), len(data))
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        return Group("error", value=str(exc))
    finally:
        os.close(fd)
    digest = hashlib.sha256(data).digest()
    if len(data) > GROUP_MAX:
        return Group("bad", digest, f"larger than {GROUP_MAX} bytes")
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        return Group("bad", digest, f"not JSON: {exc}")
    if not isinstance(value, dict):
        return Group("bad", digest, f"not a JSON object but {type(value).__name__}")
    return Group("ok", digest, value)


def line_end(dir_fd: int, name: str) -> tuple[int, bool]:
    """Where the last complete line of `name` ends, and whether the rest is a line too long to keep."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
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


def _too_long(name: str, offset: int) -> tuple:
    return ("bad", "line_too_long", f"{name}: a line at offset {offset} is longer than {LINE_MAX} bytes; skipped")
