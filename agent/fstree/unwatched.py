"""Directories whose inotify watch could not be added (ENOSPC: fs.inotify.max_user_watches reached).

Such a directory raises no events, so the follower walks it again, as if it had just appeared,
every RETRY_FIRST_S doubling to RETRY_MAX_S: that measures it and tries its watch again, until the
watch holds. Meanwhile readiness says how many directories are unwatched.
"""

from __future__ import annotations

import logging
from collections import deque

from agent.fstree.paths import Scopes, within

# A directory that cannot be watched is walked again after this long, doubling up to the maximum:
# the most its usage can lag behind while fs.inotify.max_user_watches is too low.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0


class Unwatched:
    """What the walks found they could not watch, settled in order on the loop, and how long to wait
    before walking it again."""

    def __init__(self, log: logging.Logger, label: str, root: str):
        self._log, self._label, self._root = log, label, root
        self._found: dict[str, str] = {}  # directory -> why it cannot be watched
        self._walks_done: deque[tuple[str, dict[str, str]]] = deque()  # (scope, unwatched) to settle, in order
        self.delay_s = RETRY_FIRST_S  # before the next walk of them

    def __len__(self) -> int:
        return len(self._found)

    def error(self) -> str:
        return next(iter(self._found.values()))

    def walked(self, scope: str, unwatched: dict[str, str]) -> None:
        """What a walk of `scope` (in the thread, or forgetting it on the loop) found it could not
        watch replaces what was known there: settled in order after each trip to the thread and
        each batch, all walks at once (a batch may walk thousands)."""
        self._walks_done.append((scope, unwatched))

    def settle(self) -> None:
        done = []
        while self._walks_done:
            done.append(self._walks_done.popleft())
        if not done:
            return
        last = {scope: i for i, (scope, _) in enumerate(done)}
        scopes = Scopes(last)

        def last_walk(path: str) -> int:  # the last of these walks that covered `path`; -1: none
            return max((last[scope] for scope in scopes.holding(path)), default=-1)

        had = bool(self._found)
        self._found = {d: why for d, why in self._found.items() if last_walk(d) < 0}
        for i, (_, found) in enumerate(done):
            self._found.update((d, why) for d, why in found.items() if last_walk(d) == i)
        if self._found and not had:
            self._log.warning(f"{self._label}: directories cannot be watched; walking them again until they can be",
                              extra={"root": self._root, "directories": len(self._found), "error": self.error(),
                                     "max_interval_s": RETRY_MAX_S})
        elif had and not self._found:
            self._log.info(f"{self._label}: every directory is watched again", extra={"root": self._root})
        if not self._found:
            self.delay_s = RETRY_FIRST_S

    def tops(self) -> list[str]:
        """The highest unwatched directories, to walk again (what lies below them is walked with
        them); the wait before the next time doubles."""
        self.delay_s = min(RETRY_MAX_S, self.delay_s * 2)
        tops: list[str] = []
        for directory in sorted(self._found, key=lambda d: d.split("/") if d else []):  # parents first
            if not tops or not within(directory, tops[-1]):
                tops.append(directory)
        return tops
