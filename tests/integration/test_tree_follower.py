"""The tree follower on its own, owned by the smallest TreeEvents: what an owner is told, and that the
blocking work runs on the executor it is given (which stays the giver's: stop does not close it)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil

from agent.common.executor import Executor
from agent.fstree.events import CLOSED, DIR_GONE, DIR_NEW, LAST_GONE
from agent.fstree.paths import join
from agent.fstree.tree import TreeFollower
from agent.fstree.walk import Walk
from agent.lifecycle import Tasks
from testkit.wait import until


class Counting:
    """An executor shared with others: counts what it is given."""

    def __init__(self):
        self.pool = Executor(name="shared").lane("walks", 2)
        self.submitted = 0

    def submit(self, fn, *args):
        self.submitted += 1
        return self.pool.submit(fn, *args)


class Owner:
    """Keeps the set of directories under the root and the changes it was handed."""

    name = "tree-test"

    def __init__(self, root, executor=None):
        self.tasks = Tasks(self.name)
        self.tree = TreeFollower(root, self, tasks=self.tasks, log=logging.getLogger("tree-test"), title="tree test",
                                 label="tree test", refused="nothing is followed", batch_window_s=0.02,
                                 executor=executor)
        self.dirs: set[str] = set()
        self.changes: list[tuple[str, int]] = []
        self.initial: list[bool] = []

    def list_dir(self, fd: int, directory: str, walk: Walk) -> list[str]:
        with os.scandir(fd) as entries:
            return [entry.name for entry in entries if entry.is_dir(follow_symlinks=False)]

    async def rescan(self, initial: bool) -> bool:
        self.initial.append(initial)
        walk = await self.tree.scan(Walk())
        if walk is not None:
            self.dirs = set(walk.watches.values())
        return walk is not None

    async def apply(self, changes) -> None:
        new = []
        for directory, name, what in changes:
            self.changes.append((join(directory, name), what))
            if what & DIR_NEW:
                new.append(join(directory, name))
        for path in new:
            walk = await self.tree.run(self.tree.walk, path, Walk())
            self.tree.take(walk)
            self.dirs |= set(walk.watches.values())

    def gone(self, directory: str) -> None:
        self.dirs = {d for d in self.dirs if not (d == directory or d.startswith(directory + "/"))}

    async def catch_up(self) -> bool:
        return False

    def failed(self) -> None:
        pass


def test_an_owner_is_told_what_changed_and_what_went_on_the_executor_it_gave(tmp_path):
    root = tmp_path / "root"
    (root / "old").mkdir(parents=True)
    executor = Counting()

    async def scenario():
        owner = Owner(root, executor)
        await owner.tree.start()
        try:
            await until(lambda: owner.tree.readiness()[0] and owner.tree.state == "watching", 5, "the scan")
            assert owner.initial == [True] and owner.dirs == {"", "old"} and owner.tree.watched == 2
            (root / "a" / "b" / "c").mkdir(parents=True)
            await until(lambda: owner.tree.watched == 5, 5, "the new directories watched")
            (root / "a" / "b" / "c" / "f").write_bytes(b"x")
            await until(lambda: ("a/b/c/f", CLOSED) in owner.changes, 5, "the file written")
            shutil.rmtree(root / "a")
            await until(lambda: owner.tree.watched == 2 and owner.dirs == {"", "old"}, 5, "the subtree gone")
            assert ("a", LAST_GONE | DIR_GONE) in owner.changes  # forgotten (gone) before it was handed on
            assert owner.tree.errors == 0 and owner.tree.scans == 1
        finally:
            await owner.tree.stop()
        assert owner.tree.state == "stopped" and executor.submitted >= 3  # the root looked at, the scan, a walk
        assert executor.pool.submit(sum, (1, 2)).result(5) == 3  # the giver's executor is still open

    asyncio.run(asyncio.wait_for(scenario(), 30))
