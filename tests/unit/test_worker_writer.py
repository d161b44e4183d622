"""agent.worker.writer.RankWriter on real temporary directories."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
from pathlib import Path

import pytest

from agent.worker import writer as writer_mod
from agent.worker.writer import FILE_LIMIT, RankWriter
from tests.support.clock import FakeClock

T0 = 1_755_771_234.5


def lines(n: int, size: int = 100) -> bytes:
    line = b"x" * (size - 1) + b"\n"
    return line * n


def files(rank_dir) -> list[str]:
    return sorted(os.listdir(rank_dir))


def test_first_write_creates_dirs_and_a_10_digit_file(tmp_path):
    clock = FakeClock(T0)
    w = RankWriter(str(tmp_path / "root"), "job-1", 3, 5000, clock=clock)
    assert w.write(b"a\nb\n") == 4
    rank_dir = tmp_path / "root" / "job-1" / "3"
    assert files(rank_dir) == ["1755771234"]
    assert (rank_dir / "1755771234").read_bytes() == b"a\nb\n"
    assert w.stats()["records_written"] == 2 and w.stats()["bytes_written"] == 4
    assert w.stats()["files_created"] == 1


def test_modes(tmp_path):
    old = os.umask(0o077)
    try:
        w = RankWriter(str(tmp_path / "root"), "job", 0, 5000, clock=FakeClock(T0))
        w.write(b"a\n")
    finally:
        os.umask(old)
    for path in (tmp_path / "root" / "job", tmp_path / "root" / "job" / "0"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755, path
    assert stat.S_IMODE((tmp_path / "root" / "job" / "0" / "1755771234").stat().st_mode) == 0o644


def test_appends_to_the_newest_10_digit_file(tmp_path):
    rank_dir = tmp_path / "job" / "1"
    rank_dir.mkdir(parents=True)
    (rank_dir / "1700000000").write_bytes(b"old\n")
    (rank_dir / "1700000500").write_bytes(b"newer\n")
    (rank_dir / "99999999999").write_bytes(b"")  # 11 digits: not a record file
    (rank_dir / "parallel_group.json").write_bytes(b"{}")
    (rank_dir / "1800000000").mkdir()  # a directory is skipped
    w = RankWriter(str(tmp_path), "job", 1, 5000, clock=FakeClock(T0))
    w.write(b"more\n")
    assert (rank_dir / "1700000500").read_bytes() == b"newer\nmore\n"
    assert (rank_dir / "1700000000").read_bytes() == b"old\n"
    assert w.stats()["files_created"] == 0


def test_rotation_only_when_strictly_greater_than_10_mib(tmp_path):
    rank_dir = tmp_path / "job" / "0"
    rank_dir.mkdir(parents=True)
    first = rank_dir / "1700000000"
    first.write_bytes(b"x" * (FILE_LIMIT - 1) + b"\n")  # exactly 10 MiB: not greater
    clock = FakeClock(1_755_771_300)
    w = RankWriter(str(tmp_path), "job", 0, 5000, clock=clock)
    w.write(b"a\n")  # checked before the write: 10 MiB is not > 10 MiB, so this file overshoots
    assert files(rank_dir) == ["1700000000"]
    assert first.stat().st_size == FILE_LIMIT + 2
    w.write(b"b\n")  # now > 10 MiB: a new file named after now
    assert files(rank_dir) == ["1700000000", "1755771300"]
    assert (rank_dir / "1755771300").read_bytes() == b"b\n"
    w.write(b"c\n")
    assert (rank_dir / "1755771300").read_bytes() == b"b\nc\n"


def test_rotation_by_own_writes_and_same_second_reuse(tmp_path):
    clock = FakeClock(1_755_771_000)
    w = RankWriter(str(tmp_path), "job", 0, 5000, clock=clock)
    chunk = lines(1024 * 11, 1024)  # 11 MiB in one write: one file overshoots
    w.write(chunk)
    rank_dir = tmp_path / "job" / "0"
    assert files(rank_dir) == ["1755771000"]
    w.write(b"z\n")  # same second: the "new" file has the same name, so it appends (TaskD does too)
    assert files(rank_dir) == ["1755771000"]
    clock.now += 1
    w.write(b"y\n")
    assert files(rank_dir) == ["1755771000", "1755771001"]
    assert (rank_dir / "1755771001").read_bytes() == b"y\n"


def symlinked_rank_dir(tmp_path):
    """<tmp>/root/job/2 -> <tmp>/elsewhere; returns a writer for rank 2 and the target."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "root" / "job").mkdir(parents=True)
    (tmp_path / "root" / "job" / "2").symlink_to(elsewhere)
    return RankWriter(str(tmp_path / "root"), "job", 2, 5000, clock=FakeClock(T0)), elsewhere


def test_symlinked_rank_dir_is_refused(tmp_path):
    w, elsewhere = symlinked_rank_dir(tmp_path)
    assert w.write(b"a\nb\n") == 0
    assert os.listdir(elsewhere) == []
    s = w.stats()
    assert s["write_errors"] == 1 and s["records_dropped_error"] == 2 and s["bytes_dropped_error"] == 4
    assert "symlink" in s["last_error"]


def test_symlinked_newest_file_is_not_followed(tmp_path):
    rank_dir = tmp_path / "job" / "0"
    rank_dir.mkdir(parents=True)
    target = tmp_path / "target"
    target.write_bytes(b"")
    (rank_dir / "1755771234").symlink_to(target)  # the name the writer would create now
    w = RankWriter(str(tmp_path), "job", 0, 5000, clock=FakeClock(T0))
    assert w.write(b"a\n") == 0
    assert target.read_bytes() == b""
    assert w.stats()["write_errors"] == 1


def test_rank_path_longer_than_1024_is_refused(tmp_path):
    w = RankWriter(str(tmp_path), "j" * 1100, 0, 5000, clock=FakeClock(T0))
    assert w.write(b"a\n") == 0
    assert w.stats()["write_errors"] == 1
    assert os.listdir(tmp_path) == []


def test_limit_writes_whole_lines_that_fit_then_drops_and_counts(tmp_path):
    w = RankWriter(str(tmp_path), "job", 0, 1, clock=FakeClock(T0))  # 1 MiB
    limit = 1024 * 1024
    assert w.write(lines(10000, 100)) == 10000 * 100  # 1,000,000 bytes
    assert w.write(lines(1000, 100)) == (limit - 1_000_000) // 100 * 100  # 485 lines fit
    s = w.stats()
    assert s["bytes_written"] == 1_048_500 <= limit
    assert s["records_dropped_limit"] == 1000 - 485
    assert s["bytes_dropped_limit"] == (1000 - 485) * 100
    assert w.write(b"a\n") == 2  # 76 bytes of room left: a line that fits is still written
    assert w.write(lines(1, 200)) == 0  # one that does not is dropped
    assert w.stats()["records_dropped_limit"] == 1000 - 485 + 1
    assert w.stats()["bytes_written"] == 1_048_502
    on_disk = sum(f.stat().st_size for f in (tmp_path / "job" / "0").iterdir())
    assert on_disk == w.stats()["bytes_written"] <= limit


def test_limit_zero_never_writes(tmp_path):
    w = RankWriter(str(tmp_path), "job", 0, 0, clock=FakeClock(T0))
    assert w.write(b"a\nb\n") == 0
    assert w.stats()["records_dropped_limit"] == 2
    assert not (tmp_path / "job").exists()


def test_limit_counts_only_this_processes_bytes(tmp_path):
    rank_dir = tmp_path / "job" / "0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "1700000000").write_bytes(b"x" * (2 * 1024 * 1024))  # someone else's 2 MiB
    w = RankWriter(str(tmp_path), "job", 0, 1, clock=FakeClock(T0))
    assert w.write(b"a\n") == 2


def test_unwritable_root_is_counted_not_raised(tmp_path, caplog):
    root = tmp_path / "ro"
    root.mkdir()
    os.chmod(root, 0o555)
    try:
        if os.access(root, os.W_OK):
            pytest.skip("running as root: permissions are not enforced")
        w = RankWriter(str(root), "job", 0, 5000, clock=FakeClock(T0))
        with caplog.at_level("WARNING", logger="agent.worker"):
            assert w.write(b"a\nb\n") == 0
            assert w.write(b"c\n") == 0
        s = w.stats()
        assert s["write_errors"] == 2 and s["records_dropped_error"] == 3 and s["bytes_dropped_error"] == 6
        assert len([r for r in caplog.records if r.name == "agent.worker"]) == 1  # at most once a minute
    finally:
        os.chmod(root, 0o755)


def test_root_that_is_a_file_is_counted_not_raised(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    w = RankWriter(str(tmp_path / "file"), "job", 0, 5000, clock=FakeClock(T0))
    assert w.write(b"a\n") == 0
    assert w.stats()["write_errors"] == 1


def test_unwritable_procfs_root_is_counted_not_raised():
    w = RankWriter("/proc/self/npu-agent-profiling", "job", 0, 5000, clock=FakeClock(T0))
    assert w.write(b"a\n") == 0
    assert w.stats()["write_errors"] == 1 and w.stats()["records_dropped_error"] == 1


def test_read_only_file_system_error_during_write(tmp_path, monkeypatch):
    w = RankWriter(str(tmp_path), "job", 0, 5000, clock=FakeClock(T0))

    def erofs(fd, data):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(writer_mod.os, "write", erofs)
    assert w.write(b"a\nb\n") == 0
    monkeypatch.undo()
    s = w.stats()
    assert s["write_errors"] == 1 and s["records_dropped_error"] == 2 and "Read-only" in s["last_error"]
    assert w.write(b"c\n") == 2  # the next round works again; the failed batch is gone
    assert (tmp_path / "job" / "0" / "1755771234").read_bytes() == b"c\n"


def test_write_error_log_is_rate_limited(small_fs, caplog):
    mono = [1000.0]
    w = RankWriter(str(small_fs.path), "job", 0, 5000, clock=FakeClock(T0), monotonic=lambda: mono[0])
    small_fs.fill()
    with caplog.at_level("WARNING", logger="agent.worker"):
        for _ in range(5):
            w.write(b"a\n")
        mono[0] += 59
        w.write(b"a\n")
        mono[0] += 1
        w.write(b"a\n")
    assert len(caplog.records) == 2
    assert w.stats()["write_errors"] == 7 and w.stats()["records_dropped_error"] == 7
    assert "No space left" in w.stats()["last_error"]


def test_empty_write_is_a_no_op(tmp_path):
    w = RankWriter(str(tmp_path), "job", 0, 5000, clock=FakeClock(T0))
    assert w.write(b"") == 0
    assert not (tmp_path / "job").exists()


def test_file_names_are_ten_digits(tmp_path):
    assert writer_mod._NAME.match("1755771234")
    assert not writer_mod._NAME.match("175577123")


# -- write_from: the native collector writes its lines itself --------------------------------------

class LinesSource:
    """The consumer side of agent._native.Collector (pending, drain_to, discard) over bytes: whole
    lines only, taken either way, OSError carrying written/size/lines/whole/whole_lines/rest
    (tests/integration checks the real one)."""

    def __init__(self, data: bytes = b"") -> None:
        self.data = data

    def _cut(self, max_bytes: int) -> int:
        if max_bytes < 0 or max_bytes >= len(self.data):
            return len(self.data)
        return self.data.rfind(b"\n", 0, max_bytes) + 1

    def pending(self, max_bytes: int = -1) -> int:
        return self._cut(max_bytes)

    def discard(self, max_bytes: int = -1) -> tuple[int, int]:
        n = self._cut(max_bytes)
        taken, self.data = self.data[:n], self.data[n:]
        return n, taken.count(b"\n")

    def drain_to(self, fd: int, max_bytes: int = -1) -> tuple[int, int]:
        n = self._cut(max_bytes)
        taken, self.data = self.data[:n], self.data[n:]
        written = 0
        try:
            while written < n:
                written += os.write(fd, taken[written:])
        except OSError as exc:
            whole = taken.rfind(b"\n", 0, written) + 1
            exc.written, exc.size, exc.lines = written, n, taken.count(b"\n")
            exc.whole, exc.whole_lines = whole, taken.count(b"\n", 0, whole)
            exc.rest = taken[written:taken.index(b"\n", written) + 1] if written > whole else b""
            raise
        return n, taken.count(b"\n")


def feed(w: RankWriter, data: bytes, direct: bool) -> int:
    if not direct:
        return w.write(data)
    source = LinesSource(data)
    written = w.write_from(source)
    assert source.data == b""  # every line of the round is written or dropped, none left behind
    return written


def run_both(tmp_path, limit_mb: int, steps, prepare=None) -> dict:
    """The same rounds through write() and write_from(): files and stats of each."""
    results = {}
    for direct in (False, True):
        root = tmp_path / ("direct" if direct else "bytes")
        if prepare is not None:
            prepare(root)
        clock = FakeClock(1_755_771_000)
        w = RankWriter(str(root), "job", 0, limit_mb, clock=clock)
        returned = []
        for step in steps:
            if step == "next second":
                clock.now += 1
            else:
                returned.append(feed(w, step, direct))
        rank_dir = root / "job" / "0"
        files = {p.name: p.read_bytes() for p in sorted(rank_dir.iterdir())} if rank_dir.is_dir() else None
        results[direct] = (returned, w.stats(), files)
    return results


@pytest.mark.parametrize("limit_mb, steps", [
    (1, [lines(10000, 100), lines(1000, 100), b"a\n", lines(1, 200), b"b\n" * 40, lines(3, 10)]),  # the cap
    (0, [b"a\nb\n", b"c\n"]),
    (5000, [lines(1024 * 11, 1024), b"z\n", "next second", b"y\n", b"", lines(5, 7)]),  # rotation past 10 MiB
    (5000, [b"x\n" * 3, "next second", b"\n\n", b"last\n"]),
])
def test_write_from_is_write_without_the_copy(tmp_path, limit_mb, steps):
    results = run_both(tmp_path, limit_mb, steps)
    assert results[True] == results[False]


def test_write_from_rotates_and_appends_like_write(tmp_path):
    def prepare(root):
        rank_dir = root / "job" / "0"
        rank_dir.mkdir(parents=True)
        (rank_dir / "1700000000").write_bytes(b"x" * (FILE_LIMIT - 1) + b"\n")  # exactly 10 MiB
        (rank_dir / "parallel_group.json").write_bytes(b"{}")

    results = run_both(tmp_path, 5000, [b"a\n", b"b\n", b"c\n"], prepare)
    assert results[True] == results[False]
    files = results[True][2]
    assert sorted(files) == ["1700000000", "1755771000", "parallel_group.json"]
    assert files["1755771000"] == b"b\nc\n"


def test_write_from_refuses_a_symlinked_rank_dir_and_drops_the_batch(tmp_path):
    w, elsewhere = symlinked_rank_dir(tmp_path)
    source = LinesSource(b"a\nb\n")
    assert w.write_from(source) == 0 and source.data == b""
    assert os.listdir(elsewhere) == []
    s = w.stats()
    assert s["write_errors"] == 1 and s["records_dropped_error"] == 2 and s["bytes_dropped_error"] == 4
    assert "symlink" in s["last_error"]


def test_write_from_counts_a_failed_write_and_goes_on(tmp_path, monkeypatch, caplog):
    w = RankWriter(str(tmp_path), "job", 0, 1, clock=FakeClock(T0))  # 1 MiB

    def erofs(fd, data):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(writer_mod.os, "write", erofs)
    with caplog.at_level("WARNING", logger="agent.worker"):
        assert w.write_from(LinesSource(b"a\nb\n" + lines(20000, 100))) == 0
    monkeypatch.undo()
    s = w.stats()
    # what fits under the cap is the failed batch; the rest of the round is over the cap
    assert s["write_errors"] == 1 and s["records_dropped_error"] == 2 + 10485 and "Read-only" in s["last_error"]
    assert s["records_dropped_limit"] == 20000 - 10485
    assert len(caplog.records) == 1
    assert w.write_from(LinesSource(b"c\n")) == 2
    assert (tmp_path / "job" / "0" / "1755771234").read_bytes() == b"c\n"


def test_write_from_with_nothing_waiting_touches_nothing(tmp_path):
    w = RankWriter(str(tmp_path), "job", 0, 5000, clock=FakeClock(T0))
    assert w.write_from(LinesSource()) == 0
    assert not (tmp_path / "job").exists()


# -- a full disk: never a partial record -------------------------------------------------------------

PAGE = os.sysconf("SC_PAGE_SIZE")


def leave_room(fs, pages: int) -> None:
    """Fill the file system, then free `pages` pages: a longer write is cut short, the next fails (ENOSPC)."""
    fs.fill()
    filler = fs.path / ".filler"
    os.truncate(filler, filler.stat().st_size - pages * PAGE)


def torn_batch() -> tuple[bytes, bytes, bytes]:
    """10 short lines, a line longer than the room `leave_room(fs, 2)` leaves, 10 short lines."""
    return lines(10, 100), b"L" * (5 * PAGE) + b"\n", lines(10, 100)


def on_disk(w: RankWriter) -> bytes:
    return b"".join((Path(w.rank_dir) / name).read_bytes() for name in files(w.rank_dir))


@pytest.mark.parametrize("direct", [False, True], ids=["write", "write_from"])
def test_a_full_disk_never_leaves_a_partial_record(small_fs, caplog, direct):
    w = RankWriter(str(small_fs.path / "root"), "job", 0, 5000, clock=FakeClock(T0))
    first = lines(20, 100)
    assert feed(w, first, direct) == len(first)
    leave_room(small_fs, 2)
    before, long, after = torn_batch()
    with caplog.at_level("WARNING", logger="agent.worker"):
        assert feed(w, before + long + after, direct) == len(before)  # cut short inside the long line
    data = on_disk(w)
    assert data == first + before  # the whole lines that made it; the partial one truncated away
    s = w.stats()
    assert s["records_written"] == data.count(b"\n") == 30 and s["bytes_written"] == len(data)
    assert (s["write_errors"], s["records_dropped_error"]) == (1, 11)
    assert s["bytes_dropped_error"] == len(long + after) and "No space left" in s["last_error"]
    (message,) = [r.getMessage() for r in caplog.records if r.name == "agent.worker"]
    assert message == (f"profiling records for rank 0 not all written to {w.rank_dir}/1755771234 (OSError: [Errno 28] "
                       f"No space left on device): 10 of 21 records written, the partial record after them "
                       f"truncated away; dropped 11 records so far")
    small_fs.free()
    last = lines(5, 100)
    assert feed(w, last, direct) == len(last)  # space again: the next batch is whole
    assert on_disk(w) == first + before + last
    assert w.stats()["records_written"] == 35


@pytest.fixture
def append_only():
    """chattr +a on files (undone afterwards): such a file cannot be truncated (EPERM)."""
    made = []

    def set_(path) -> None:
        done = subprocess.run(["chattr", "+a", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"this file system cannot make a file append-only: {done.stderr.strip()}")
        made.append(path)

    yield set_
    for path in made:
        subprocess.run(["chattr", "-a", str(path)], capture_output=True)


@pytest.mark.parametrize("direct", [False, True], ids=["write", "write_from"])
def test_a_partial_record_that_cannot_be_truncated_is_completed_before_the_next_batch(small_fs, append_only,
                                                                                       caplog, direct):
    w = RankWriter(str(small_fs.path / "root"), "job", 0, 5000, clock=FakeClock(T0))
    first = lines(20, 100)
    feed(w, first, direct)
    append_only(Path(w.rank_dir) / "1755771234")
    leave_room(small_fs, 2)
    before, long, after = torn_batch()
    with caplog.at_level("WARNING", logger="agent.worker"):
        assert feed(w, before + long + after, direct) == len(before)
        torn = on_disk(w)
        # the whole lines, then a part of the long one
        assert (first + before + long).startswith(torn) and len(first + before) < len(torn) < len(first + before + long)
        s = w.stats()
        assert (s["records_written"], s["write_errors"], s["records_dropped_error"]) == (30, 1, 10)
        assert feed(w, lines(3, 100), direct) == 0  # still full: not glued to the partial record, dropped
        assert on_disk(w) == torn
    s = w.stats()
    assert (s["records_written"], s["write_errors"], s["records_dropped_error"]) == (30, 2, 13)
    (message,) = [r.getMessage() for r in caplog.records if r.name == "agent.worker"]  # once a minute
    assert message == (f"profiling records for rank 0 not all written to {w.rank_dir}/1755771234 (OSError: [Errno 28] "
                       f"No space left on device): 10 of 21 records written, the partial record after them "
                       f"could not be truncated away (PermissionError: [Errno 1] Operation not permitted) and is "
                       f"completed before the next write; dropped 10 records so far")
    small_fs.free()
    last = lines(5, 100)
    assert feed(w, last, direct) == len(last)
    data = on_disk(w)
    assert data == first + before + long + last  # completed, then the next batch whole
    s = w.stats()
    assert s["records_written"] == data.count(b"\n") == 36 and s["bytes_written"] == len(data)
    assert s["records_dropped_error"] == 13
