"""Walking the profiling tree (in a worker thread): directories opened by name under their parent's
descriptor, never through a symlink, and watched before they are listed.

A directory is opened with O_NOFOLLOW under its parent's descriptor, so one swapped for a symlink is
never entered or watched; nothing is reached by a full path, so depth (past PATH_MAX) is no limit.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from agent.fstree.paths import join

OPEN_LEVELS = 64  # a walk holds descriptors of this many levels at most (and of its start)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
VANISHED = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)  # removed, or became a file or a symlink

Problem = tuple[str, str, str]  # (what, path, error): counted, and logged once per (what, path)


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
    """What a walk found (built in the worker thread, applied on the loop); owners add their findings."""
    start_ok: bool = True  # the start directory could be opened
    watches: dict[int, str] = field(default_factory=dict)  # wd -> directory
    unwatched: dict[str, str] = field(default_factory=dict)  # directory -> why its watch could not be added
    problems: list[Problem] = field(default_factory=list)


W = TypeVar("W", bound=Walk)
Watch = Callable[[int, str], int]  # (descriptor, directory) -> the inotify watch added; OSError if it cannot be
ListDir = Callable[[int, str, W], list[str]]  # (descriptor, directory, walk) -> the subdirectories to walk


def walk_tree(root: str, start: str, out: W, watch: Watch, list_dir: ListDir) -> W:
    """Watch, then list, `start` ("" is the root) and, all the way down, the subdirectories that
    `list_dir(fd, directory, out)` returns. Descriptors are held for the start and the deepest
    OPEN_LEVELS levels only, so a tree of any depth needs no recursion and a bounded number of
    them; a level closed meanwhile is opened again, by name, when the walk comes back to it."""
    try:
        fd = open_under(root, start)
    except OSError as exc:
        out.start_ok = False
        if exc.errno not in VANISHED:
            out.problems.append(("cannot open a directory", start or ".", str(exc)))
        return out
    # [fd or None, directory, subdirectories left to visit] down to the current directory; each
    # fd is in `levels` before its directory is listed, so it is closed whatever happens.
    levels: list[list] = [[fd, start, []]]
    try:
        levels[-1][2].extend(_watch_and_list(fd, start, out, watch, list_dir))
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
                    parent = level[0] = _reopen(levels)
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
            levels[-1][2].extend(_watch_and_list(fd, path, out, watch, list_dir))
    finally:
        for fd, _, _ in levels:
            if fd is not None:
                os.close(fd)
    return out


def _reopen(levels: list[list]) -> int:
    """A new descriptor of the last level's directory, by name from its nearest open ancestor."""
    base = next(level for level in reversed(levels) if level[0] is not None)  # the start always is
    below = levels[-1][1][len(base[1]) + 1 if base[1] else 0:]
    return open_dir(base[0], below.split("/"))


def _watch_and_list(fd: int, directory: str, out: W, watch: Watch, list_dir: ListDir) -> list[str]:
    """Watch before listing: whatever appears after the listing raises an event."""
    try:
        try:
            out.watches[watch(fd, directory)] = directory
        except OSError as exc:  # ENOSPC: fs.inotify.max_user_watches; ENOENT: just removed
            if exc.errno != errno.ENOENT:
                out.unwatched[directory] = str(exc)
        return list_dir(fd, directory, out)
    except OSError as exc:
        out.problems.append(("cannot list a directory", directory or ".", str(exc)))
        return []
