"""The profiling disk guard's pure core: the usage ledger, and which files age.

The aging rule (`choose_victims`, pure) applies when usage > limit. It works in rounds; each round
takes, in every rank directory (exactly `<job>/<rank>/`), the oldest record files by mtime:
floor(count / 5), where count is the number of record files in that rank (TaskD's 20 %, but
`parallel_group.json` and other names are neither counted nor touched), and at least one when the
rank holds 2..4 of them -- otherwise a node of many short or large-file ranks could never get back
under the limit (TaskD deletes nothing under 5 files). A rank's newest record file by mtime and its
largest name (the one TaskD's writer appends to; normally the same file) are always kept. Rounds
repeat, recounting, until usage <= limit or no round finds anything; a round is always finished so
no rank is favoured by the order of the walk. Files not exactly at depth 3 are never deleted.

`limit_bytes <= 0` disables aging; usage is still measured.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from agent.fstree.paths import PathMap, is_record_name

PARTS = 5  # TaskD's NumberOfParts: a round ages a fifth of each rank's record files
@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str  # relative to the root, "/"-separated
    size: int
    mtime: float  # any ordered stamp; the guard uses st_mtime_ns

    @property
    def name(self) -> str:
        return self.path.rpartition("/")[2]


@dataclass
class UsageLedger:
    """Size of each regular file under the root, grouped by directory so a rank is one lookup, and a
    subtree that goes costs what it held."""

    _dirs: PathMap[dict[str, FileEntry]] = field(default_factory=PathMap, init=False, repr=False)
    _total: int = field(default=0, init=False)
    _count: int = field(default=0, init=False)

    @property
    def total(self) -> int:
        return self._total

    def __len__(self) -> int:
        return self._count

    def get(self, path: str) -> FileEntry | None:
        directory, _, name = path.rpartition("/")
        return self._dirs.get(directory, {}).get(name)

    def set(self, path: str, size: int, mtime: float) -> bool:
        """Record a file's size and mtime; whether the path is new."""
        directory, _, name = path.rpartition("/")
        files = self._dirs.get(directory)
        if files is None:
            self._dirs[directory] = files = {}
        old = files.get(name)
        files[name] = FileEntry(path, size, mtime)
        self._total += size - (old.size if old else 0)
        self._count += old is None
        return old is None

    def remove(self, path: str) -> FileEntry | None:
        directory, _, name = path.rpartition("/")
        files = self._dirs.get(directory)
        old = files.pop(name, None) if files is not None else None
        if old is not None:
            self._total -= old.size
            self._count -= 1
            if not files:
                del self._dirs[directory]
        return old

    def remove_tree(self, prefix: str) -> int:
        """Forget `prefix` and everything under it ("" is the whole tree); the number of files dropped."""
        return self.remove_trees([prefix])

    def remove_trees(self, prefixes: Iterable[str]) -> int:
        """`remove_tree` of each of `prefixes`, at a cost that follows what they held (a batch may
        walk thousands of directories); the number of files dropped."""
        prefixes = set(prefixes)
        dropped = sum(self.remove(prefix) is not None for prefix in prefixes if prefix)
        for prefix in prefixes:
            for _, files in self._dirs.pop_tree(prefix):
                self._total -= sum(e.size for e in files.values())
                self._count -= len(files)
                dropped += len(files)
        return dropped

    def dirs(self) -> list[str]:
        """Directories that hold at least one file."""
        return list(self._dirs)

    def files_in(self, directory: str) -> dict[str, FileEntry]:
        """Name -> entry of the files directly in `directory` (a copy)."""
        return dict(self._dirs.get(directory, {}))

    def sizes(self) -> dict[str, int]:
        return {e.path: e.size for files in self._dirs.values() for e in files.values()}


def choose_victims(ledger: UsageLedger, limit_bytes: int) -> list[FileEntry]:
    """The files to delete, round by round (and rank by rank within a round), to bring
    `ledger.total` to `limit_bytes` or below; the module docstring has the rule. Empty when under
    the limit or when `limit_bytes <= 0`."""
    usage = ledger.total
    if limit_bytes <= 0 or usage <= limit_bytes:
        return []
    ranks: list[list] = []  # per rank directory: [record files left, deletable ones oldest first, taken so far]
    for directory in sorted(ledger.dirs()):
        if directory.count("/") != 1:  # not <job>/<rank>
            continue
        records = sorted((e.mtime, name, e) for name, e in ledger.files_in(directory).items() if is_record_name(name))
        if len(records) < 2:
            continue
        # Kept: the newest by mtime (records[-1]; equal mtimes age by name) and the largest name,
        # the file TaskD's writer appends to. Neither changes from round to round.
        appended_to = max(name for _, name, _ in records)
        deletable = [e for _, name, e in records[:-1] if name != appended_to]
        ranks.append([len(records), deletable, 0])
    victims: list[FileEntry] = []
    while usage > limit_bytes:
        taken_in_round = 0
        for rank in ranks:
            count, deletable, taken = rank
            chosen = deletable[taken:taken + max(1, count // PARTS)]
            if not chosen:
                continue
            rank[0], rank[2] = count - len(chosen), taken + len(chosen)
            victims.extend(chosen)
            usage -= sum(e.size for e in chosen)
            taken_in_round += len(chosen)
        if not taken_in_round:
            break  # only the kept files are left: stay over the limit rather than touch them
    return victims
