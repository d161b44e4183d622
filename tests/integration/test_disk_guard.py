"""The real DiskGuard on real trees: inotify, live appends, symlinks, a late root, overflow, deletions.

Every test runs the guard inside `asyncio.run` and compares its ledger with a fresh walk of the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import resource
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from agent.diskguard.guard import DiskGuard
from testkit import REPO
from testkit.agent import AgentProcess
from testkit.wait import until, wait_until

T0 = 1_700_000_000
KIB = 1024


# ---- helpers ------------------------------------------------------------------------------------


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.asynccontextmanager
async def running(root: Path, limit: int, **kwargs):
    guard = DiskGuard(root, limit, **kwargs)
    await guard.start()
    try:
        yield guard
    finally:
        await guard.stop()


def walk_sizes(root: Path) -> dict[str, int]:
    """Regular files under `root` (symlinks neither followed nor counted), as the guard should see
    them; by descriptor, so at any depth."""
    sizes = {}
    for directory, _, names, dir_fd in os.fwalk(root):  # follow_symlinks=False
        for name in names:
            st = os.lstat(name, dir_fd=dir_fd)
            if stat.S_ISREG(st.st_mode):
                sizes[os.path.relpath(os.path.join(directory, name), root)] = st.st_size
    return sizes


def make_dirs(base_fd: int, names: list[str]) -> int:
    """`mkdir -p` of `names` under `base_fd`, one name at a time (past PATH_MAX a path cannot be
    used); a descriptor of the last one."""
    fd = os.dup(base_fd)
    for name in names:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, dir_fd=fd)
        child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    return fd


def remove_deep(top: Path) -> None:
    """`rm -rf` of a tree of any depth, without recursion (shutil.rmtree recurses once per level)."""
    stack = [(os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW), "")]
    try:
        while stack:
            fd = stack[-1][0]
            with os.scandir(fd) as entries:
                listed = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
            subdir = next((name for name, is_dir in listed if is_dir), None)
            if subdir is not None:
                stack.append((os.open(subdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd), subdir))
                continue
            for name, _ in listed:
                os.unlink(name, dir_fd=fd)
            os.close(fd)
            name = stack.pop()[1]
            if stack:
                os.rmdir(name, dir_fd=stack[-1][0])
    finally:
        for fd, _ in stack:
            os.close(fd)
    os.rmdir(top)


def write_at(dir_fd: int, name: str, size: int, mtime_s: float | None = None, append: bool = False) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
    try:
        os.write(fd, b"z" * size)
    finally:
        os.close(fd)
    if mtime_s is not None:
        os.utime(name, (mtime_s, mtime_s), dir_fd=dir_fd)


def write(path: Path, size: int, mtime_s: float | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    if mtime_s is not None:
        os.utime(path, (mtime_s, mtime_s))


def build_tree(root: Path, jobs: int, ranks: int, files: int, size: int = KIB) -> None:
    """Record files T0..T0+files-1 in every <job>/<rank>, mtimes in the same order, plus the two
    kinds of file the guard must never touch, older than all of them."""
    base = time.time() - 10 * files
    for j in range(jobs):
        for r in range(ranks):
            rank_dir = root / f"job{j}" / str(r)
            for i in range(files):
                write(rank_dir / str(T0 + i), size, base + i)
            write(rank_dir / "parallel_group.json", 3 * KIB, base - 100)
            write(rank_dir / "notes.txt", 2 * KIB, base - 100)


def records(rank_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in rank_dir.iterdir() if p.name.isdigit() and len(p.name) == 10)


def append(path: Path, size: int) -> None:
    with open(path, "ab") as handle:
        handle.write(b"y" * size)


# ---- tests --------------------------------------------------------------------------------------


def test_live_appends_that_cross_the_limit_are_aged_within_a_second(tmp_path):
    root = tmp_path / "profiling"
    build_tree(root, jobs=4, ranks=8, files=100)  # 3,200 record files of 1 KiB, 32 ranks
    start_usage = sum(walk_sizes(root).values())
    limit = start_usage + 64 * KIB

    async def scenario():
        async with running(root, limit) as guard:
            assert guard.readiness() == (False, f"first scan of {root} not finished")
            await until(lambda: guard.readiness()[0], 10, "the first scan")
            assert guard.readiness() == (True, "")
            assert guard.tracked() == walk_sizes(root)
            assert (guard.usage_bytes, guard.scans, guard.files_aged) == (start_usage, 1, 0)

            # The newest file of job0/0 grows past the limit: one round, 20 % of every rank. The
            # pass deletes oldest first in chunks, so usage is under the limit before the pass ends.
            crossed = time.monotonic()
            append(root / "job0" / "0" / str(T0 + 99), 100 * KIB)
            await until(lambda: guard.files_aged and guard.usage_bytes <= limit, 5, "aging")
            took = time.monotonic() - crossed
            assert took < 1.0, f"back under the limit {took:.3f} s after the write"
            await until(lambda: guard.aging_passes == 1, 5, "the end of the pass")
            assert guard.files_aged == 32 * 20 and guard.bytes_aged == 32 * 20 * KIB
            for j in range(4):
                for r in range(8):
                    rank_dir = root / f"job{j}" / str(r)
                    assert records(rank_dir) == list(range(T0 + 20, T0 + 100)), rank_dir
                    assert (rank_dir / "parallel_group.json").exists() and (rank_dir / "notes.txt").exists()
            await until(lambda: guard.tracked() == walk_sizes(root), 5, "the ledger to match the disk")
            assert sum(walk_sizes(root).values()) <= limit

            # A rank rotates: a new record file, big enough to cross again. Its previous file may
            # be aged now; the new one (the newest) stays.
            usage = guard.usage_bytes
            crossed = time.monotonic()
            write(root / "job3" / "7" / str(T0 + 1000), limit - usage + 10 * KIB)
            await until(lambda: guard.files_aged > 640 and guard.usage_bytes <= limit, 5, "the second aging")
            took = time.monotonic() - crossed
            assert took < 1.0, f"back under the limit {took:.3f} s after the rotation"
            await until(lambda: guard.aging_passes == 2, 5, "the end of the second pass")
            assert guard.files_aged == 640 + 32 * 16  # floor(80/5) each, job3/7 had 81: floor(81/5) = 16
            assert (root / "job3" / "7" / str(T0 + 1000)).exists()
            assert records(root / "job3" / "7")[:1] == [T0 + 36]
            await until(lambda: guard.tracked() == walk_sizes(root), 5, "the ledger to match the disk")
            assert guard.scans == 1 and guard.overflows == 0 and guard.errors == 0

    run(scenario())


def test_symlinks_are_never_followed_counted_or_deleted(tmp_path):
    root, outside = tmp_path / "profiling", tmp_path / "outside"
    old = time.time() - 10_000
    write(outside / "1600000000", 50 * KIB, old)  # a record-named file outside the root
    for i in range(10):
        write(outside / "ranks" / str(T0 + i), 5 * KIB, old + i)
    for i in range(10):
        write(root / "job" / "0" / str(T0 + i), KIB, old + 100 + i)
    (root / "job" / "0" / "1500000000").symlink_to(outside / "1600000000")  # record name, oldest of all
    os.utime(root / "job" / "0" / "1500000000", (old - 500, old - 500), follow_symlinks=False)
    (root / "job" / "1").symlink_to(outside / "ranks", target_is_directory=True)  # a rank that is a symlink
    (root / "elsewhere").symlink_to(outside, target_is_directory=True)
    outside_before = walk_sizes(outside)
    limit = 6 * KIB  # 10 KiB of real record files: aging is due at once

    async def scenario():
        async with running(root, limit) as guard:
            await until(lambda: guard.readiness()[0] and guard.aging_passes == 1, 10, "the first aging")
            assert guard.tracked() == walk_sizes(root)
            assert set(guard.tracked()) <= {f"job/0/{T0 + i}" for i in range(10)}
            assert records(root / "job" / "0") == [1500000000, *range(T0 + 4, T0 + 10)]

            # Symlinks made while watching, then another crossing.
            (root / "job" / "0" / "1400000000").symlink_to(outside / "1600000000")
            (root / "job" / "2").symlink_to(outside / "ranks", target_is_directory=True)
            append(root / "job" / "0" / str(T0 + 9), 2 * KIB)
            await until(lambda: guard.aging_passes == 2, 5, "the second aging")
            assert guard.usage_bytes <= limit
            await until(lambda: guard.tracked() == walk_sizes(root), 5, "the ledger to match the disk")
            assert not any("1500000000" in p or "1400000000" in p or p.startswith(("job/1", "job/2", "elsewhere"))
                           for p in guard.tracked())
        for link in ("job/0/1500000000", "job/0/1400000000", "job/1", "job/2", "elsewhere"):
            assert (root / link).is_symlink(), link
        assert walk_sizes(outside) == outside_before

    run(scenario())


def test_a_root_that_appears_late_vanishes_and_comes_back(tmp_path):
    root = tmp_path / "later" / "profiling"

    async def scenario():
        async with running(root, 10**9, root_poll_s=0.05) as guard:
            await until(lambda: guard.state == "waiting for root", 5, "the guard to wait for the root")
            assert guard.readiness() == (True, "")  # no root yet is not a reason to be unready
            assert guard.usage_bytes == 0 and guard.scans == 0

            build_tree(root, jobs=2, ranks=2, files=5)
            await until(lambda: guard.state == "watching" and guard.tracked() == walk_sizes(root), 5,
                        "the new root to be scanned")
            assert guard.scans == 1
            write(root / "job9" / "0" / str(T0), 7 * KIB)  # watched, not rescanned
            await until(lambda: guard.tracked() == walk_sizes(root), 5, "the new job")

            shutil.rmtree(root)
            await until(lambda: guard.state == "waiting for root" and guard.usage_bytes == 0, 5, "the root to go")
            assert guard.tracked() == {}

            build_tree(root, jobs=1, ranks=3, files=4)
            await until(lambda: guard.state == "watching" and guard.tracked() == walk_sizes(root), 5,
                        "the root to come back")
            assert guard.scans == 2 and guard.errors == 0

    run(scenario())


def test_a_root_that_is_a_symlink_is_refused_until_it_is_a_directory(tmp_path):
    target, root = tmp_path / "target", tmp_path / "profiling"
    build_tree(target, jobs=1, ranks=2, files=10)
    root.symlink_to(target, target_is_directory=True)
    before = walk_sizes(target)

    async def scenario():
        async with running(root, 1, root_poll_s=0.05) as guard:  # a limit every file is over
            await until(lambda: guard.state == "the root is a symlink", 5, "the refusal")
            assert guard.readiness() == (True, "")
            assert guard.usage_bytes == 0 and guard.scans == 0 and guard.files_aged == 0

            root.unlink()
            build_tree(root, jobs=1, ranks=1, files=10)
            await until(lambda: guard.state == "watching" and guard.aging_passes, 5, "the real root to be aged")
            assert records(root / "job0" / "0") == [T0 + 9]  # rounds until only the newest is left
        assert walk_sizes(target) == before

    run(scenario())


def test_external_deletions_moves_and_new_directories_keep_the_ledger_exact(tmp_path):
    root, outside = tmp_path / "profiling", tmp_path / "outside"
    build_tree(root, jobs=4, ranks=4, files=20)
    outside.mkdir()

    async def scenario():
        async with running(root, 10**9) as guard:
            await until(lambda: guard.readiness()[0], 10, "the first scan")
            for i in range(5):
                os.unlink(root / "job0" / "0" / str(T0 + i))
            shutil.rmtree(root / "job0" / "1")  # a rank
            shutil.rmtree(root / "job1")  # a job
            os.rename(root / "job2" / "2", root / "job2" / "9")  # a rank renamed inside the root
            os.rename(root / "job3", outside / "job3")  # a job moved out of the root
            (root / "job0" / "0" / "notes.txt").unlink()
            await until(lambda: guard.tracked() == walk_sizes(root), 5, "the ledger to drop the deletions")
            assert not any(p.startswith(("job1/", "job3/", "job0/1/", "job2/2/")) for p in guard.tracked())

            # Files under the moved-out job no longer count, even when they change.
            append(outside / "job3" / "0" / str(T0), 50 * KIB)
            # A new job whose directories and first files appear faster than watches can be added.
            for r in range(3):
                write(root / "new" / str(r) / str(T0), 3 * KIB)
            os.rename(outside / "job3", root / "job3")  # and back in
            await until(lambda: guard.tracked() == walk_sizes(root), 5, "the ledger to follow the moves")
            append(root / "job3" / "0" / str(T0), KIB)  # watched again after moving back
            append(root / "new" / "2" / str(T0), KIB)
            await until(lambda: guard.tracked() == walk_sizes(root), 5, "appends in moved and new directories")
            assert guard.scans == 1 and guard.errors == 0 and guard.files_aged == 0

    run(scenario())


def test_an_inotify_overflow_is_mended_by_a_rescan(tmp_path):
    root = tmp_path / "profiling"
    build_tree(root, jobs=1, ranks=2, files=10)
    max_events = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    count = max_events // 2 + 2000  # each new file raises IN_CREATE and IN_CLOSE_WRITE: more than the queue holds

    async def scenario():
        async with running(root, 10**9) as guard:
            await until(lambda: guard.readiness()[0], 10, "the first scan")
            # Blocking calls on the loop on purpose: the guard cannot read its queue meanwhile.
            for i in range(count):
                rank_dir = root / "job0" / str(i % 2)
                with open(rank_dir / f"burst-{i}", "wb"):  # noqa: ASYNC230 - blocking the loop is the point
                    pass
            os.unlink(root / "job0" / "0" / str(T0))
            files = 2 * (10 + 2) + count - 1
            await until(lambda: guard.overflows >= 1 and guard.scans >= 2 and guard.files == files, 20,
                        "a rescan after the overflow")
            assert guard.tracked() == walk_sizes(root)
            append(root / "job0" / "1" / "burst-1", 10)  # and it keeps following events afterwards
            await until(lambda: guard.tracked() == walk_sizes(root), 5, "events after the rescan")

    run(scenario())


def test_a_limit_of_zero_measures_but_never_ages(tmp_path):
    root = tmp_path / "profiling"
    build_tree(root, jobs=1, ranks=2, files=10)

    async def scenario():
        async with running(root, 0) as guard:
            await until(lambda: guard.readiness()[0], 10, "the first scan")
            append(root / "job0" / "0" / str(T0 + 9), 100 * KIB)
            await until(lambda: guard.tracked() == walk_sizes(root), 5, "the append to be measured")
            assert guard.usage_bytes == sum(walk_sizes(root).values()) and guard.files_aged == 0
        assert records(root / "job0" / "0") == list(range(T0, T0 + 10))

    run(scenario())



def test_files_and_directories_vanishing_during_the_scan_leave_an_exact_ledger(tmp_path):
    # Another writer deletes files and whole ranks while the first walk runs: whatever the walk
    # saw or missed, the events raised meanwhile must bring the ledger to the disk, with no restart.
    root = tmp_path / "profiling"
    build_tree(root, jobs=4, ranks=16, files=200, size=16)  # 12,800 records: the walk takes a while
    victims = sorted(root.glob("job*/*/17*"))
    random.Random(7).shuffle(victims)  # all over the tree, so some go before the walk reaches them
    stop = threading.Event()
    removed = []

    def churn():
        for path in victims[:4000]:
            if stop.is_set():
                return
            path.unlink(missing_ok=True)
        for j, r in ((1, 3), (2, 7), (3, 11)):
            shutil.rmtree(root / f"job{j}" / str(r))
            removed.append(f"job{j}/{r}")
        stop.set()

    async def scenario():
        worker = threading.Thread(target=churn, daemon=True)
        async with running(root, 10**9) as guard:
            worker.start()
            await until(lambda: guard.readiness()[0] and stop.is_set(), 20, "the scan and the churn")
            await until(lambda: guard.tracked() == walk_sizes(root), 5, "the ledger to match the disk")
            assert (guard.scans, guard.overflows, guard.errors, guard.state) == (1, 0, 0, "watching")
            assert not any(p.startswith(tuple(f"{r}/" for r in removed)) for p in guard.tracked())
        worker.join(5)

    run(scenario())


def test_files_whose_paths_are_longer_than_path_max_are_measured_and_aged(tmp_path):
    # The root sits just under PATH_MAX (4,096 bytes), so its record files are past it; a rank
    # also holds a directory chain 20 names of 250 bytes deep (its files are ~5,000 bytes inside
    # the root). Every change there is measured, and the record files age like any others.
    name = "d" * 250
    top_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    rest = 3950 - len(f"{tmp_path}/profiling")  # the root: 3,950 bytes
    prefix = [name] * (rest // 251) + ["f" * (rest % 251 - 1)] * (rest % 251 > 1)
    root = Path(str(tmp_path) + "/" + "/".join(prefix) + "/profiling")
    job = "j" * 250
    base = time.time() - 100
    fds = {}
    try:
        fds["root"] = make_dirs(top_fd, [*prefix, "profiling"])
        for r in ("0", "1"):
            fds[r] = make_dirs(fds["root"], [job, r])
            for i in range(5):
                write_at(fds[r], str(T0 + i), 10 * KIB, base + i)
        fds["deep"] = make_dirs(fds["0"], ["deep", *[name] * 20])
        write_at(fds["deep"], "notes.txt", KIB)
        assert len(str(root)) < 4096 < len(f"{root}/{job}/0/{T0}")
        deep_file = next(p for p in walk_sizes(root) if p.endswith("notes.txt"))
        assert len(deep_file) > 4096
        start_usage = sum(walk_sizes(root).values())
        limit = start_usage + 5 * KIB

        async def scenario():
            async with running(root, limit) as guard:
                await until(lambda: guard.readiness()[0], 10, "the first scan")
                assert guard.tracked() == walk_sizes(root)
                write_at(fds["deep"], "notes.txt", 2 * KIB, append=True)
                write_at(fds["deep"], "more.txt", KIB)
                await until(lambda: guard.tracked() == walk_sizes(root), 10, "the deep changes to be measured")
                write_at(fds["0"], str(T0 + 4), 10 * KIB, append=True)  # over the limit
                await until(lambda: guard.files_aged and guard.usage_bytes <= limit, 10, "aging")
                await until(lambda: guard.tracked() == walk_sizes(root), 10, "the ledger to match the disk")
                assert guard.errors == 0
                assert sorted(os.listdir(fds["0"])) == [*[str(T0 + i) for i in range(1, 5)], "deep"]
                assert sorted(os.listdir(fds["1"])) == [str(T0 + i) for i in range(1, 5)]

        run(scenario())
    finally:
        for fd in [top_fd, *fds.values()]:
            os.close(fd)


def test_a_tree_hundreds_of_levels_deep_is_walked_with_a_bounded_number_of_descriptors():
    # Two chains of 420 directories (paths past PATH_MAX) side by side, a file at the bottom of
    # each, walked with descriptors for 300 more files than the process has open: a walk holding
    # one per level would run out on the way (and starve the rest of the agent meanwhile).
    # Not under pytest's tmp_path: its clean-up of old runs (shutil.rmtree) recurses once per level.
    top = Path(tempfile.mkdtemp(prefix="npa-deep-", dir="/tmp"))
    root = top / "profiling"
    bottoms = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    async def scenario():
        async with running(root, 10**9) as guard:
            await until(lambda: guard.readiness()[0], 20, "the first scan")
            assert guard.tracked() == files and guard.errors == 0
            for fd in bottoms:
                write_at(fd, "notes.txt", KIB, append=True)
            await until(lambda: guard.tracked() == dict.fromkeys(files, 2 * KIB), 10, "the appends to be measured")
            assert guard.errors == 0

    try:
        (root / "job" / "0").mkdir(parents=True)
        for branch in ("x", "y"):
            base = os.open(root / "job" / "0", os.O_RDONLY | os.O_DIRECTORY)
            bottoms.append(make_dirs(base, [branch] + ["a" * 10] * 420))
            os.close(base)
            write_at(bottoms[-1], "notes.txt", KIB)
        files = {f"job/0/{branch}/" + "aaaaaaaaaa/" * 420 + "notes.txt": KIB for branch in ("x", "y")}
        assert all(len(path) > 4096 for path in files)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 300, hard))
        run(scenario())
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in bottoms:
            os.close(fd)
        remove_deep(top)


def test_the_agent_ages_its_profiling_root_and_exports_the_figures(start_agent, tmp_path):
    # The whole agent from its configuration: the guard runs, ages, and /metrics says so per node.
    root = tmp_path / "profiling"
    build_tree(root, jobs=1, ranks=4, files=10, size=30 * KIB)  # 1,220 KiB, limit 1,024 KiB: one round
    agent, _ = start_agent(profiling={"root": str(root), "disk_limit_mb": 1})
    wait_until(lambda: (agent.metric("npu_agent_profiling_files_aged_total") or 0) >= 8, 10, "aging")
    for r in range(4):
        assert records(root / "job0" / str(r)) == list(range(T0 + 2, T0 + 10))  # a fifth of 10, twice
    wait_until(lambda: agent.metric("npu_agent_profiling_disk_usage_bytes") == sum(walk_sizes(root).values()),
               5, "usage in the scrape to match the disk")
    assert agent.metric("npu_agent_profiling_disk_limit_bytes") == 1 << 20
    assert agent.metric("npu_agent_profiling_disk_usage_bytes") <= 1 << 20
    assert agent.metric("npu_agent_profiling_bytes_aged_total") == 8 * 30 * KIB
    assert agent.metric("npu_agent_profiling_scans_total") == 1
    agent.wait_for_log("aged profiling record files", files=8)

@pytest.mark.parametrize("watches", [8, 0], ids=["ranks-unwatched", "root-unwatched"])
def test_directories_that_cannot_be_watched_are_measured_until_their_watches_can_be_added(tmp_path, watches):
    # The agent runs in a user namespace of its own whose inotify limit (user.max_inotify_watches,
    # counted per user in each namespace) holds `watches` of the tree's 32 directories: nothing
    # else on the machine is touched. What it cannot watch is measured and aged all the same,
    # /readyz and /metrics say so, and once the limit is raised every directory gets its watch.
    root, limit = tmp_path / "profiling", 1 << 20
    base = time.time() - 1000
    for r in range(30):
        for i in range(2):
            write(root / "job" / str(r) / str(T0 + i), KIB, base + i)
    agent = AgentProcess(tmp_path, {"devices": {"backend": "simulated"},
                                    "profiling": {"root": str(root), "disk_limit_mb": 1, "metrics": False}})
    agent.launcher = ["unshare", "--user", "--map-root-user", "sh", "-c",
                      'echo "$0" > /proc/sys/user/max_inotify_watches && exec "$@"', str(watches)]

    def usage_converged():
        on_disk = sum(walk_sizes(root).values())
        return on_disk <= limit and agent.metric("npu_agent_profiling_disk_usage_bytes") == on_disk

    agent.start()
    try:
        wait_until(lambda: "cannot be watched" in agent.http("/readyz")[1], 20, "/readyz to say so")
        assert agent.http("/readyz")[0] == 503
        unwatched = agent.metric("npu_agent_profiling_unwatched_directories")
        assert unwatched == 32 - watches, unwatched
        agent.wait_for_log("profiling tree: directories cannot be watched; walking them again until they can be")
        # 6 MiB more, in every rank, watched or not.
        for r in range(30):
            for i in range(2, 12):
                write(root / "job" / str(r) / str(T0 + i), 20 * KIB, base + i)
        wait_until(usage_converged, 90, "usage measured and brought under the limit without watches")
        assert agent.metric("npu_agent_profiling_files_aged_total") > 0

        raised = subprocess.run(["nsenter", "--user", "--target", str(agent.process.pid), "sh", "-c",
                                 "echo 100000 > /proc/sys/user/max_inotify_watches"], capture_output=True, text=True)
        assert raised.returncode == 0, raised.stderr
        wait_until(lambda: agent.http("/readyz")[0] == 200, 90, "every directory watched")
        assert agent.metric("npu_agent_profiling_unwatched_directories") == 0
        agent.wait_for_log("profiling tree: every directory is watched again")
        # Watched now: a rank that was not crosses the limit and is aged at once, by its events.
        write(root / "job" / "29" / str(T0 + 20), 100 * KIB, base + 20)
        wait_until(lambda: sum(walk_sizes(root).values()) <= limit, 10, "aging after a watched write")
        wait_until(usage_converged, 10, "usage to match the disk")
    finally:
        agent.stop()


UNREADABLE_SCRIPT = r"""
import asyncio, json, logging, os, sys
from pathlib import Path
from agent.diskguard.guard import DiskGuard

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append({"msg": record.getMessage(), "path": getattr(record, "path", None)})
logging.getLogger("agent.diskguard.guard").addHandler(Keep())
logging.getLogger("agent.diskguard.guard").setLevel(logging.INFO)

if os.geteuid() == 0:  # root reads everything: become the tree's owner, after every import
    os.setgid(65534)
    os.setuid(65534)

async def main(root):
    guard = DiskGuard(Path(root), 1)
    await guard.start()
    deadline = asyncio.get_running_loop().time() + 10
    while not (guard.readiness()[0] and guard.aging_passes):
        assert asyncio.get_running_loop().time() < deadline, "no aging"
        await asyncio.sleep(0.01)
    out = {"errors": guard.errors, "tracked": guard.tracked(), "logs": records}
    await guard.stop()
    print(json.dumps(out))

asyncio.run(main(sys.argv[1]))
"""


def test_an_unreadable_directory_is_logged_once_counted_and_survived():
    # Root reads any directory, so the guard runs in a child that drops to nobody (uid 65534).
    top = Path(tempfile.mkdtemp(prefix="npa-disk-", dir="/tmp"))
    try:
        root = top / "profiling"
        build_tree(root, jobs=1, ranks=2, files=5)
        for directory, _, names in os.walk(top):
            for path in [directory, *(os.path.join(directory, n) for n in names)]:
                if os.geteuid() == 0:
                    os.chown(path, 65534, 65534)
        os.chmod(top, 0o755)
        os.chmod(root / "job0" / "1", 0)
        child = subprocess.run([sys.executable, "-c", UNREADABLE_SCRIPT, str(root)], cwd=REPO, check=False,
                               capture_output=True, text=True, timeout=30)
        assert child.returncode == 0, child.stderr
        out = json.loads(child.stdout)
        assert out["errors"] == 1
        complaints = [r for r in out["logs"] if r["path"] == "job0/1"]
        assert len(complaints) == 1 and "cannot" in complaints[0]["msg"], out["logs"]
        assert not any(p.startswith("job0/1/") for p in out["tracked"])
        assert records(root / "job0" / "0") == [T0 + 4]  # the readable rank was aged
        os.chmod(root / "job0" / "1", 0o755)
        assert records(root / "job0" / "1") == list(range(T0, T0 + 5))  # the unreadable one untouched
    finally:
        for directory, dirs, _ in os.walk(top):
            for d in dirs:
                os.chmod(os.path.join(directory, d), 0o755)
        shutil.rmtree(top, ignore_errors=True)
