"""The profiling tree's names: what a record file is, and sets of directories that hold what is below them."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

_RECORD_NAME = re.compile(r"[0-9]{10}")  # [0-9], not \d: only ASCII digits


def is_record_name(name: str) -> bool:
    """A profiling record file: exactly 10 ASCII digits."""
    return _RECORD_NAME.fullmatch(name) is not None


class Scopes:
    """Directories relative to the root ("" is the root), each holding itself and all below it.
    Which of them hold a path costs one slice and lookup per distinct length, however many there are."""

    def __init__(self, directories: Iterable[str]):
        self._set = set(directories)
        self._lengths = sorted({len(d) for d in self._set})

    def __iter__(self) -> Iterator[str]:
        return iter(self._set)

    def holding(self, path: str) -> list[str]:
        """The scopes that hold `path`, shallowest first."""
        found = []
        for n in self._lengths:
            if n > len(path):
                break
            if (n == 0 or n == len(path) or path[n] == "/") and path[:n] in self._set:
                found.append(path[:n])
        return found
