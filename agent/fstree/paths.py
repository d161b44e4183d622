"""The profiling tree's names: what a record file is, and collections of paths relative to the root
that answer for whole subtrees (what holds a path, what lies below one)."""

from __future__ import annotations

import re
from collections.abc import ItemsView, Iterable, Iterator, ValuesView
from typing import Generic, TypeVar

V = TypeVar("V")

_RECORD_NAME = re.compile(r"[0-9]{10}")  # [0-9], not \d: only ASCII digits
_RANK_NAME = re.compile(r"0|[1-9][0-9]{0,8}")  # canonical decimal: "01" would collide with "1"


def is_record_name(name: str) -> bool:
    """A profiling record file: exactly 10 ASCII digits."""
    return _RECORD_NAME.fullmatch(name) is not None


def is_rank_name(name: str) -> bool:
    """A rank directory the tailer follows: a rank number in canonical decimal."""
    return _RANK_NAME.fullmatch(name) is not None


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


def join(directory: str, name: str) -> str:
    return f"{directory}/{name}" if directory else name


def within(path: str, scope: str) -> bool:
    return not scope or path == scope or path.startswith(scope + "/")


class PathMap(Generic[V]):
    """A dict keyed by paths relative to the root ("" is the root) that also lists, or drops,
    everything at and below a path at a cost that follows what is there, not the size of the map:
    a large subtree that goes costs once its own size, not once the map per directory in it."""

    def __init__(self) -> None:
        self._values: dict[str, V] = {}
        # path -> its children (in order of arrival) that hold a value or have one below them
        self._children: dict[str, dict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, path: str) -> bool:
        return path in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __getitem__(self, path: str) -> V:
        return self._values[path]

    def get(self, path: str, default: V | None = None) -> V | None:
        return self._values.get(path, default)

    def items(self) -> ItemsView[str, V]:
        return self._values.items()

    def values(self) -> ValuesView[V]:
        return self._values.values()

    def __setitem__(self, path: str, value: V) -> None:
        if path not in self._values:
            child = path
            while child:  # link it to its ancestors, up to the first that already leads to something
                parent = child.rpartition("/")[0]
                children = self._children.setdefault(parent, {})
                if child in children:
                    break
                children[child] = None
                child = parent
        self._values[path] = value

    def pop(self, path: str, default: V | None = None) -> V | None:
        if path not in self._values:
            return default
        value = self._values.pop(path)
        self._unlink(path)
        return value

    def __delitem__(self, path: str) -> None:
        del self._values[path]
        self._unlink(path)

    def under(self, scope: str) -> list[tuple[str, V]]:
        """(path, value) of `scope` and everything below it, parents first."""
        found, stack = [], [scope]
        while stack:
            path = stack.pop()
            if path in self._values:
                found.append((path, self._values[path]))
            stack.extend(reversed(self._children.get(path, ())))
        return found

    def pop_tree(self, scope: str) -> list[tuple[str, V]]:
        """Remove `scope` and everything below it; what was there, parents first."""
        found, stack = [], [scope]
        while stack:
            path = stack.pop()
            if path in self._values:
                found.append((path, self._values.pop(path)))
            stack.extend(reversed(self._children.pop(path, {})))
        self._unlink(scope)
        return found

    def _unlink(self, path: str) -> None:
        """Unlink `path`, then each ancestor, from its parent while it holds nothing and leads nowhere."""
        while path and path not in self._values and not self._children.get(path):
            self._children.pop(path, None)
            parent = path.rpartition("/")[0]
            children = self._children.get(parent)
            if children is not None:
                children.pop(path, None)
            path = parent
