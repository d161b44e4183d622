"""Where the tailer is in each rank's record files, and where a restart resumes.

- Each rank has a cursor (file, offset of the first byte not delivered) and the record names at or
  after it with their last known sizes. Files are read in name order (agent.steps.reader).
- A resume position comes from the consumer (`commit`): everything before it is used. It is saved
  to the state file (`profiling-offsets.json`) every `commit_interval_s` when changed, and on stop,
  with the size the tailer last knew of that file (`"size"`, an addition to `file`/`offset`: after
  a restart it tells whether a committed file aged away while the agent was down still held unread
  bytes). Until the consumer commits, a rank's resume position is where the tailer started it, so
  a restart never skips what was never delivered.
- First sight of a rank: its saved position if there is one; else, for ranks already on disk when
  the agent starts, the end of the last complete line of the newest file (history is not replayed;
  `replay_existing=True` reads it from 0); else (a rank, job or root that appears while running)
  offset 0 of its first file.
- `records_lost` is reported when a file is deleted with bytes the tailer knew of but had not read
  (its size from the last walk or read, so a file deleted before the tailer ever saw its size, or
  one created and deleted while the agent was down, is not noticed).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent.common.fsutil import atomic_write, read_state
from agent.fstree.paths import is_rank_name, is_record_name
from agent.steps.records import RankKey

STATE_VERSION = 1
ORIGIN = "0000000000"  # resume position of a rank with no file yet: the first file, from 0
FINISHED_KEPT = 16  # final sizes of files the cursor left, for the saved "size" of a lagging commit


@dataclass(frozen=True, slots=True)
class Position:
    file: str  # the 10-digit file name
    offset: int  # byte offset in that file


@dataclass(frozen=True, slots=True)
class Cursor:
    file: str | None  # None: start at the first file there is
    offset: int  # first byte not delivered (the start of a partial line, if any)
    inode: int | None = None  # of `file` when last read; None: not read yet in this run
    skipping: bool = False  # inside a line too long: drop bytes up to the next "\n"


@dataclass
class RankSeen:
    """One rank directory as a walk found it."""
    path: str  # "<job>/<rank>"
    inode: int
    files: dict[str, int] = field(default_factory=dict)  # record name -> size
    group: bool = False  # parallel_group.json is a regular file there
    end: tuple[int, bool] = (0, False)  # newest file: end of its last complete line, skipping (if asked)

    @property
    def key(self) -> RankKey:
        job, _, rank = self.path.rpartition("/")
        return RankKey(job, int(rank))


@dataclass(eq=False)
class Rank:
    key: RankKey
    path: str
    inode: int  # of the rank directory: one replaced under the same name is a new rank
    cursor: Cursor
    files: dict[str, int | None]  # record names at or after the cursor's file -> last known size
    finished: dict[str, int] = field(default_factory=dict)  # final sizes of files the cursor left
    group_dirty: bool = False
    group_digest: bytes | None = None  # of the parallel_group.json last handed over (or reported)

    @property
    def lag(self) -> int:
        """Bytes known to be on disk and not delivered yet."""
        total = 0
        for name, size in self.files.items():
            if size is not None:
                total += max(size - self.cursor.offset, 0) if name == self.cursor.file else size
        return total

    def ahead(self, name: str) -> bool:
        """At or after the cursor's file: an older name is never written again."""
        return self.cursor.file is None or name >= self.cursor.file

    def drop(self, name: str) -> str:
        """A known file went away: what was lost ("" if nothing, as far as its size is known)."""
        if name not in self.files:
            return ""
        size = self.files.pop(name)
        read = self.cursor.offset if name == self.cursor.file else 0
        if size is not None and size > read:
            return f"{self.path}/{name} deleted with {size - read} byte(s) not read (read to {read} of {size})"
        return ""

    def move_to(self, cursor: Cursor) -> None:
        """The cursor after a read: the files it left keep their final size (for a lagging commit's)."""
        self.cursor = cursor
        if cursor.file is None:
            return
        for name in [name for name in self.files if name < cursor.file]:
            size = self.files.pop(name)
            if size is not None:
                self.finished[name] = size
        while len(self.finished) > FINISHED_KEPT:
            del self.finished[min(self.finished)]

    def size_of(self, name: str) -> int | None:
        return self.files.get(name, self.finished.get(name))


def first_sight(found: RankSeen, saved: tuple[Position, int | None] | None, from_origin: bool) -> tuple[Rank, Position]:
    """A rank seen for the first time, and the position a restart must read again from until the
    consumer commits: its saved one; else, unless `from_origin`, the end of the last complete line of
    its newest file; else the start of its first file."""
    files: dict[str, int | None] = dict(found.files)
    if saved is not None:
        start, size = saved
        cursor = Cursor(start.file, start.offset)
        files.setdefault(start.file, size)  # aged away meanwhile: the first read says what was lost
    elif from_origin or not files:
        cursor, start = Cursor(None, 0), Position(ORIGIN, 0)
    else:  # on disk before the agent started: from the end of the newest file's last line
        newest = max(files)
        offset, skipping = found.end
        cursor, start = Cursor(newest, offset, skipping=skipping), Position(newest, offset)
    rank = Rank(found.key, found.path, found.inode, cursor,
                {name: size for name, size in files.items() if cursor.file is None or name >= cursor.file},
                group_dirty=found.group)
    return rank, start


class Offsets:
    """The position each rank resumes from after a restart: saved in `path`, committed since."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._committed: dict[RankKey, Position] = {}
        self._saved: dict[RankKey, tuple[Position, int | None]] = {}  # read at start, until the rank is seen
        self._dirty = False

    def load(self) -> None:
        # One of the wrong shape is moved aside: ranks start as if new (from the end of their newest file).
        self._saved = read_state(self.path, "profiling tailer state", _parse_state) or {}

    def take_saved(self, key: RankKey) -> tuple[Position, int | None] | None:
        return self._saved.pop(key, None)

    def drop_saved(self) -> None:
        """The ranks saved and not seen by a whole scan are gone."""
        if self._saved:
            self._saved.clear()
            self._dirty = True

    def commit(self, key: RankKey, position: Position) -> None:
        if self._committed.get(key) != position:
            self._committed[key] = position
            self._dirty = True

    def forget(self, key: RankKey) -> None:
        if self._committed.pop(key, None) is not None:
            self._dirty = True

    def save(self, size_of: Callable[[RankKey, str], int | None]) -> None:
        """Write the state file if anything changed, with `size_of(key, file)` as each position's "size";
        OSError if it cannot be written (it is tried again next time)."""
        if not self._dirty:
            return
        ranks = {_name(key): _entry(position, size) for key, (position, size) in self._saved.items()}
        for key, position in self._committed.items():
            ranks[_name(key)] = _entry(position, size_of(key, position.file))
        data = json.dumps({"version": STATE_VERSION, "ranks": ranks}, sort_keys=True).encode()
        atomic_write(self.path, data)  # small and local: written on the loop, like the fault history
        self._dirty = False


def _name(key: RankKey) -> str:
    return f"{key.job_id}/{key.rank}"


def _entry(position: Position, size: int | None) -> dict:
    return {"file": position.file, "offset": position.offset} | ({} if size is None else {"size": size})


def _parse_state(doc: dict) -> dict[RankKey, tuple[Position, int | None]]:
    """The state file as `Offsets.save` writes it, checked: anything else raises."""
    if doc.get("version") != STATE_VERSION or not isinstance(doc.get("ranks"), dict):
        raise ValueError(f"not a version {STATE_VERSION} state with a ranks object")
    resume = {}
    for name, entry in doc["ranks"].items():
        job, _, rank = name.rpartition("/")
        file, offset, size = entry.get("file"), entry.get("offset"), entry.get("size")
        if not (job and is_rank_name(rank) and isinstance(file, str) and is_record_name(file)
                and type(offset) is int and offset >= 0 and (size is None or type(size) is int)):
            raise ValueError(f"bad entry {name!r:.80}: {entry!r:.200}")
        resume[RankKey(job, int(rank))] = (Position(file, offset), size)
    return resume
