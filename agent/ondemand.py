"""Components built when a directory first holds something.

The disk guard and the step pipeline follow the profiling root. On a node where no job has written
there yet they have nothing to do, yet their code and state are about a megabyte of the agent's
memory. `OnDemand` stands in for them. At start it looks at the root once: when the root holds an
entry, or is anything but a plain directory (the followers then say what is wrong with it), they
are built and started at once, exactly as without it. Otherwise it watches the root with inotify
(and polls for it every 2 s while it is missing, as the followers would) and builds them at the
first event. Built late, they read the tree from its start: all of it was written while the agent
ran. Once built they stay built.

Its blocking calls (one inotify watch, one directory listing) run in an executor lane with a
time-out; a root that does not answer is treated as in use, so the followers report it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from inotify_simple import INotify, flags

from agent.common.executor import CallTimeout, Lane
from agent.lifecycle import Component, Tasks

log = logging.getLogger(__name__)

POLL_S = 2.0  # while the root is missing (agent.fstree.tree.ROOT_POLL_S)
LOOK_TIMEOUT_S = 10.0
# Any of these on the root ends the wait: something arrived, or the root itself went (the followers
# cope with that as they do with a missing root).
MASK = flags.CREATE | flags.MOVED_TO | flags.DELETE_SELF | flags.MOVE_SELF | flags.ONLYDIR | flags.DONT_FOLLOW
EMPTY, MISSING, IN_USE = "empty", "missing", "in use"
T = TypeVar("T")


def look(root: str) -> str:
    """EMPTY, MISSING, or IN_USE (an entry, no plain directory, or unreadable: the followers say why)."""
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            return IN_USE
        with os.scandir(root) as entries:
            return IN_USE if next(entries, None) is not None else EMPTY
    except FileNotFoundError:
        return MISSING
    except OSError:
        return IN_USE


def watch(root: str) -> tuple[INotify | None, str]:
    """An inotify watch on an empty `root` (the listing is taken after the watch is added, so nothing
    slips in between), or None and why not."""
    try:
        inotify = INotify()
    except OSError:  # out of inotify instances: the followers will fail the same way, and say so
        return None, IN_USE
    try:
        inotify.add_watch(root, MASK)
        state = look(root)
    except FileNotFoundError:
        state = MISSING
    except OSError:
        state = IN_USE
    if state != EMPTY:
        inotify.close()
        return None, state
    return inotify, EMPTY


async def readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class OnDemand:
    """Stands for the components `build(fresh)` returns until `root` first holds something; then
    builds and starts them in order, stops them in reverse, and lists them in `parts` (which
    agent.lifecycle.Readiness reports instead of this component). `fresh`: everything under the
    root appeared while the agent ran."""

    def __init__(self, name: str, root: Path, build: Callable[[bool], list[Component]], *, lane: Lane,
                 poll_s: float = POLL_S, look_timeout_s: float = LOOK_TIMEOUT_S):
        self.name = name
        self.root = os.path.abspath(root)
        self.tasks = Tasks(name)
        self.parts: tuple[Component, ...] = ()
        self._build = build
        self._lane = lane
        self._poll_s = poll_s
        self._look_timeout_s = look_timeout_s
        self._started: list[Component] = []

    def part(self, kind: type[T]) -> T | None:
        """The built part of class `kind`; None before they are built and after they stop."""
        return next((part for part in self.parts if isinstance(part, kind)), None)

    async def start(self) -> None:
        if await self._look() != IN_USE:
            log.info("nothing under the root yet: its components are built when something appears there",
                     extra={"component": self.name, "root": self.root})
            self.tasks.start("wait", self._wait)
        else:
            await self._bring_up(fresh=False)

    async def stop(self) -> None:
        await self.tasks.stop()
        await self._stop_parts()

    def readiness(self) -> tuple[bool, str]:
        return True, ""

    async def _look(self) -> str:
        try:
            return await self._lane.run(look, self.root, timeout=self._look_timeout_s)
        except CallTimeout:
            return IN_USE

    async def _watch(self) -> tuple[INotify | None, str]:
        try:
            return await self._lane.run(watch, self.root, timeout=self._look_timeout_s)
        except CallTimeout:
            return None, IN_USE

    async def _wait(self) -> None:
        while True:
            inotify, state = await self._watch()
            if state == MISSING:
                await asyncio.sleep(self._poll_s)
                continue
            if inotify is not None:
                try:
                    await readable(inotify.fd)
                finally:
                    inotify.close()
            break
        await self._bring_up(fresh=True)
        log.info("something appeared under the root: its components are built", extra={
            "component": self.name, "root": self.root, "components": [part.name for part in self.parts]})

    async def _bring_up(self, fresh: bool) -> None:
        parts = self._build(fresh)
        try:
            for part in parts:
                await part.start()
                self._started.append(part)
        except BaseException:
            await self._stop_parts()
            raise
        self.parts = tuple(parts)

    async def _stop_parts(self) -> None:
        self.parts = ()
        while self._started:
            part = self._started.pop()
            try:
                await part.stop()
            except Exception:
                log.exception("component failed to stop", extra={"component": part.name})
