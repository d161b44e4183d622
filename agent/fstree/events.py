"""What the inotify events of one batch add up to, per (watch, name): only what the followers act on.

A batch keeps, per (directory, name), whether it is gone, is a new directory, or must be looked at
(`lstat`ed or read), so it costs one look per file touched, however many writes it saw, and the
backlog is bounded by the names touched, not the events.
"""

from __future__ import annotations

from inotify_simple import flags, parse_events

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
DIR_GONE = 2  # a directory of that name went away at some point (the follower forgot it before handing it on)
DIR_NEW = 4  # the last event said a directory arrived (walk it)
SELF_GONE = 8  # name "": the watched directory itself was deleted, moved or unmounted
SELF_IGNORED = 16  # name "": the kernel dropped the watch
CLOSED = 32  # the file was closed after writing or moved in

Change = tuple[str, str, int]  # (directory, name, LAST_GONE | DIR_GONE | DIR_NEW | CLOSED), as owners get them


def coalesce(pending: dict[tuple[int, str], int], data: bytes) -> bool:
    """Add the events in `data` (whole events, as read from the descriptor) to `pending`; True if
    the kernel's queue overflowed (events were lost: the rest no longer matters)."""
    for wd, mask, _, name in parse_events(data):
        if mask & flags.Q_OVERFLOW:
            return True
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
    return False
