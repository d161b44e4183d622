"""The real ProfilingTailer on real trees: inotify, partial lines, rotation, restarts, aging, overflow.

Each test runs the tailer inside `asyncio.run` with a consumer that records every call, and checks
that each rank's deliveries are contiguous, whole lines, byte-exact against what was written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import threading
import time
from pathlib import Path

from agent.common.executor import Executor
from agent.steps.cursors import Position
from agent.steps.reader import read_ranks
from agent.steps.records import RankKey
from agent.steps.tail import ProfilingTailer
from testkit.wait import until

T0 = 1_700_000_000
KEY = RankKey("job", 0)


# ---- helpers ------------------------------------------------------------------------------------


def run(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


class HeldReads:
    """The tailer's executor, on a file system whose record reads hang until `release` is set (and
    say so on `entered`); walks and the rest run at once."""

    def __init__(self, release: threading.Event, entered: threading.Event | None = None):
        self.release, self.entered = release, entered or threading.Event()
        self.pool = Executor(name="held-reads").lane("reads")

    def submit(self, fn, *args):
        if fn is read_ranks:
            return self.pool.submit(self._held, fn, *args)
        return self.pool.submit(fn, *args)

    def _held(self, fn, *args):
        self.entered.set()
        self.release.wait(30)
        return fn(*args)


class Recorder:
    """A consumer that keeps every call, in order; commits everything it gets when `auto_commit`."""

    def __init__(self, auto_commit: bool = False):
        self.calls: list[tuple] = []
        self.auto_commit = auto_commit
        self.tailer: ProfilingTailer | None = None

    def on_lines(self, key, file, offset, data):
        self.calls.append(("lines", key, file, offset, data))
        if self.auto_commit:
            self.tailer.commit(key, Position(file, offset + len(data)))

    def on_group(self, key, group):
        self.calls.append(("group", key, group))

    def on_rank_gone(self, key):
        self.calls.append(("gone", key))

    def on_bad_input(self, key, reason, detail):
        self.calls.append(("bad", key, reason, detail))

    def on_batch_end(self):
        self.calls.append(("batch",))

    def deliveries(self, key=KEY) -> list[tuple[str, int, bytes]]:
        return [(c[2], c[3], c[4]) for c in self.calls if c[0] == "lines" and c[1] == key]

    def files(self, key=KEY) -> dict[str, bytes]:
        """What a rank got, per file; asserts whole lines, in file and offset order, no gap, no overlap."""
        out: dict[str, bytes] = {}
        last = None
        for file, offset, data in self.deliveries(key):
            assert data.endswith(b"\n"), (file, offset, data[-40:])
            if last is not None and file == last[0]:
                assert offset == last[1], f"{file}: delivery at {offset}, expected {last[1]}"
            else:
                assert last is None or file > last[0], f"{file} after {last[0]}"
                assert last is None or offset == 0, f"{file} started at {offset}"
            out[file] = out.get(file, b"") + data
            last = (file, offset + len(data))
        return out

    def first(self, key=KEY) -> tuple[str, int]:
        file, offset, _ = self.deliveries(key)[0]
        return file, offset

    def bad(self, reason: str | None = None) -> list[tuple]:
        return [(c[1], c[2], c[3]) for c in self.calls if c[0] == "bad" and reason in (None, c[2])]


@contextlib.asynccontextmanager
async def running(root: Path, state: Path, consumer: Recorder | None = None, **kwargs):
    consumer = consumer or Recorder()
    kwargs.setdefault("batch_window_s", 0.02)
    tailer = ProfilingTailer(root, state, consumer, **kwargs)
    consumer.tailer = tailer
    await tailer.start()
    try:
        await until(lambda: tailer.readiness()[0], 10, "the first scan")
        yield tailer, consumer
    finally:
        await tailer.stop()


def lines(first: int, count: int, pad: int = 0) -> bytes:
    """Record-like lines, numbered so a duplicate or a gap would show."""
    return b"".join(json.dumps({"Kind": 1, "Flag": 16, "Timestamp": T0 * 10**9 + i, "Id": i,
                                "Name": f"step {i}", "Pad": "x" * pad}).encode() + b"\n"
                    for i in range(first, first + count))


def append(path: Path, data: bytes) -> None:
    """As TaskD writes: open, one write, close."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as handle:
        handle.write(data)


def rank_file(root: Path, name: int, job: str = "job", rank: int = 0) -> Path:
    return root / job / str(rank) / str(name)


def state_of(path: Path) -> dict:
    return json.loads(path.read_text())["ranks"]


# ---- tests --------------------------------------------------------------------------------------


def test_live_appends_split_mid_line_reach_the_consumer_as_whole_lines(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    root.mkdir()
    content = {0: lines(0, 300, pad=20), 1: lines(1000, 200, pad=50)}
    rng = random.Random(5)

    async def scenario():
        async with running(root, state) as (tailer, rec):
            # Cut each rank's stream at random points, inside lines too; the tailer reads after each piece.
            for rank, data in content.items():
                cuts = sorted(rng.sample(range(1, len(data)), 25)) + [len(data)]
                done = 0
                for cut in cuts:
                    before = tailer.bytes_read
                    append(rank_file(root, T0, rank=rank), data[done:cut])
                    done = cut
                    await until(lambda: tailer.bytes_read > before, 5, "the piece to be read")
            for rank, data in content.items():
                key = RankKey("job", rank)
                await until(lambda: rec.files(key).get(str(T0)) == data, 5, f"rank {rank} complete")
                assert rec.first(key) == (str(T0), 0)  # a rank that appeared while running: from 0
            assert len(rec.deliveries(KEY)) > 10  # delivered piecewise, never half a line
            assert tailer.lines_delivered == 500 and rec.bad() == []
            assert rec.calls[-1] == ("batch",)
            assert (tailer.ranks, tailer.files_followed, tailer.lag_bytes, tailer.errors) == (2, 2, 0, 0)

    run(scenario())


def test_rotation_finishes_the_old_file_first_and_drops_a_partial_line_once_the_new_one_has_data(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    (root / "job" / "0").mkdir(parents=True)
    a, b, c, d = (rank_file(root, T0 + i) for i in range(4))

    async def scenario():
        async with running(root, state) as (tailer, rec):
            append(a, lines(0, 10))
            await until(lambda: rec.files().get(a.name) == lines(0, 10), 5, "the first file")

            # A final append to the old file and the new file in the same moment (the loop is not
            # running in between): the old file's lines come first.
            append(a, lines(10, 5))
            append(b, lines(15, 5))
            await until(lambda: b.name in rec.files(), 5, "the new file")
            assert rec.files() == {a.name: lines(0, 15), b.name: lines(15, 5)}

            # The old file ends in a partial line and the new one is still empty: the line may be finished.
            append(b, b'{"Id": 20, "half')
            c.touch()
            await until(lambda: tailer.files_followed == 2, 5, "the empty newer file")
            append(b, b'": 1}\n')
            await until(lambda: rec.files()[b.name].endswith(b'"half": 1}\n'), 5, "the line finished late")

            # Now a partial line and a newer file with data: reported, dropped, and the new file follows.
            append(c, lines(22, 3) + b'{"Id": 25, "never finished')
            append(d, lines(26, 2))
            await until(lambda: d.name in rec.files(), 5, "the fourth file")
            assert rec.files() == {a.name: lines(0, 15), b.name: lines(15, 5) + b'{"Id": 20, "half": 1}\n',
                                   c.name: lines(22, 3), d.name: lines(26, 2)}
            [(key, reason, detail)] = rec.bad()
            assert (key, reason) == (KEY, "partial_line_at_rotation") and c.name in detail
            order = [call[2] for call in rec.calls if call[0] in ("bad", "lines")]
            assert order.index("partial_line_at_rotation") == order.index(d.name) - 1
            assert tailer.lag_bytes == 0 and tailer.files_followed == 1

    run(scenario())


def test_an_existing_tree_starts_at_its_end_and_new_jobs_ranks_and_files_from_zero(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    old, newest = rank_file(root, T0), rank_file(root, T0 + 1)
    append(old, lines(0, 50))
    append(newest, lines(50, 20) + b'{"Id": 70, "half')  # a write stopped inside a line
    partial_at = len(lines(50, 20))

    async def scenario():
        async with running(root, state) as (tailer, rec):
            assert tailer.ranks == 1
            append(newest, b'": 1}\n' + lines(71, 2))
            await until(lambda: rec.deliveries(), 5, "the append")
            # History is not replayed; the line that was half written when the agent started is whole.
            assert rec.first() == (newest.name, partial_at)
            assert rec.files()[newest.name] == b'{"Id": 70, "half": 1}\n' + lines(71, 2)

            append(rank_file(root, T0 + 5), lines(100, 3))  # a new file in a known rank
            append(rank_file(root, T0 + 9, rank=1), lines(200, 4))  # a new rank
            append(rank_file(root, T0 + 9, job="job2", rank=7), lines(300, 5))  # a new job
            await until(lambda: rec.deliveries(RankKey("job2", 7)) and rec.deliveries(RankKey("job", 1))
                        and str(T0 + 5) in rec.files(), 5, "the new job, rank and file")
            assert rec.files(RankKey("job2", 7)) == {str(T0 + 9): lines(300, 5)}
            assert rec.files(RankKey("job", 1)) == {str(T0 + 9): lines(200, 4)}
            assert rec.files()[str(T0 + 5)] == lines(100, 3)
            assert rec.bad() == [] and tailer.errors == 0

    run(scenario())

    async def replay():
        async with running(root, tmp_path / "other.json", replay_existing=True) as (tailer, rec):
            await until(lambda: tailer.lag_bytes == 0 and str(T0 + 5) in rec.files(), 5, "the replay")
            assert rec.files() == {old.name: lines(0, 50), newest.name: lines(50, 20) + b'{"Id": 70, "half": 1}\n'
                                   + lines(71, 2), str(T0 + 5): lines(100, 3)}
            assert rec.first() == (old.name, 0)

    run(replay())


def test_a_restart_resumes_exactly_after_the_committed_position(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    (root / "job" / "0").mkdir(parents=True)
    (root / "job" / "1").mkdir(parents=True)
    a, b = rank_file(root, T0), rank_file(root, T0 + 1)
    other = rank_file(root, T0, rank=1)
    mid = len(lines(0, 4))

    async def first_run():
        async with running(root, state) as (tailer, rec):
            append(a, lines(0, 10))
            append(other, lines(500, 3))
            await until(lambda: rec.files().get(a.name) == lines(0, 10)
                        and rec.files(RankKey("job", 1)).get(other.name) == lines(500, 3), 5, "both ranks")
            tailer.commit(KEY, Position(a.name, mid))  # the consumer used only the first 4 lines
            tailer.commit(RankKey("job", 1), Position(other.name, len(lines(500, 3))))

    run(first_run())
    assert state_of(state) == {"job/0": {"file": a.name, "offset": mid, "size": len(lines(0, 10))},
                               "job/1": {"file": other.name, "offset": len(lines(500, 3)), "size": len(lines(500, 3))}}
    # While the agent is down: more lines, and a rotation.
    append(a, lines(10, 5))
    append(b, lines(15, 5))
    append(other, lines(503, 2))

    async def second_run():
        async with running(root, state, Recorder(auto_commit=True)) as (tailer, rec):
            await until(lambda: rec.files().get(b.name) == lines(15, 5)
                        and rec.deliveries(RankKey("job", 1)), 5, "the backlog")
            assert rec.first() == (a.name, mid)
            assert rec.files() == {a.name: lines(4, 11), b.name: lines(15, 5)}
            assert rec.files(RankKey("job", 1)) == {other.name: lines(503, 2)}
            assert rec.first(RankKey("job", 1)) == (other.name, len(lines(500, 3)))
            assert rec.bad() == []

    run(second_run())
    append(b, lines(20, 2))

    async def third_run():
        async with running(root, state) as (tailer, rec):
            await until(lambda: rec.deliveries(), 5, "the new lines")
            assert rec.files() == {b.name: lines(20, 2)}  # nothing twice
            assert rec.first() == (b.name, len(lines(15, 5)))

    run(third_run())


def test_a_rank_never_committed_resumes_where_the_tailer_started_it(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    (root / "job" / "0").mkdir(parents=True)

    async def first_run():
        async with running(root, state) as (tailer, rec):
            append(rank_file(root, T0), lines(0, 3))
            await until(lambda: rec.deliveries(), 5, "the lines")  # delivered, never committed

    run(first_run())
    assert state_of(state) == {"job/0": {"file": "0000000000", "offset": 0}}
    append(rank_file(root, T0 + 1), lines(3, 2))

    async def second_run():
        async with running(root, state) as (tailer, rec):
            await until(lambda: str(T0 + 1) in rec.files(), 5, "everything again")
            assert rec.files() == {str(T0): lines(0, 3), str(T0 + 1): lines(3, 2)}

    run(second_run())


def test_a_committed_file_aged_while_stopped_continues_with_the_next_file(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    for rank in (0, 1):
        (root / "job" / str(rank)).mkdir(parents=True)
    a0, a1 = rank_file(root, T0), rank_file(root, T0, rank=1)

    async def first_run():
        async with running(root, state) as (tailer, rec):
            append(a0, lines(0, 10))
            append(a1, lines(0, 10))
            await until(lambda: rec.files().get(a0.name) == lines(0, 10)
                        and rec.files(RankKey("job", 1)).get(a1.name) == lines(0, 10), 5, "both ranks")
            tailer.commit(KEY, Position(a0.name, len(lines(0, 6))))  # 4 lines not used yet
            tailer.commit(RankKey("job", 1), Position(a1.name, len(lines(0, 10))))  # all used

    run(first_run())
    for rank in (0, 1):
        append(rank_file(root, T0 + 3, rank=rank), lines(10, 3))
        append(rank_file(root, T0 + 7, rank=rank), lines(13, 3))
    a0.unlink()  # aged by the disk guard while the agent was down
    a1.unlink()

    async def second_run():
        async with running(root, state) as (tailer, rec):
            await until(lambda: str(T0 + 7) in rec.files() and str(T0 + 7) in rec.files(RankKey("job", 1)), 5,
                        "the next files")
            for key in (KEY, RankKey("job", 1)):
                assert rec.files(key) == {str(T0 + 3): lines(10, 3), str(T0 + 7): lines(13, 3)}
                assert rec.first(key) == (str(T0 + 3), 0)
            [(key, reason, detail)] = rec.bad()
            assert (key, reason) == (KEY, "records_lost") and a0.name in detail and str(len(lines(6, 4))) in detail

    run(second_run())


def test_files_aged_before_they_were_read_are_reported_lost(tmp_path):
    # The walk knows the sizes; the files go before the first read (held back here) gets to them.
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    for i in range(3):
        append(rank_file(root, T0 + i), lines(10 * i, 10))
    gate = threading.Event()

    async def scenario():
        tailer = ProfilingTailer(root, state, rec := Recorder(), batch_window_s=0.02, replay_existing=True,
                                 executor=HeldReads(gate))
        rec.tailer = tailer
        await tailer.start()
        try:
            await until(lambda: tailer.readiness()[0], 5, "the scan")
            rank_file(root, T0).unlink()
            rank_file(root, T0 + 1).unlink()
            gate.set()
            await until(lambda: rec.deliveries(), 5, "the last file")
            assert rec.files() == {str(T0 + 2): lines(20, 10)}
            lost = rec.bad("records_lost")
            assert [detail.split(" ")[0] for _, _, detail in lost] == [f"job/0/{T0}", f"job/0/{T0 + 1}"]
            assert tailer.lag_bytes == 0
        finally:
            gate.set()
            await tailer.stop()

    run(scenario())


def test_truncated_and_replaced_files_are_read_again_from_zero(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    (root / "job" / "0").mkdir(parents=True)
    a = rank_file(root, T0)
    rec = Recorder()

    def after(reason: str) -> bytes:
        """What was delivered after the report, checked to start at 0 and be contiguous."""
        at = next(i for i, c in enumerate(rec.calls) if c[0] == "bad" and c[2] == reason)
        got = [c for c in rec.calls[at:] if c[0] == "lines"]
        assert got[0][3] == 0 and all(x[3] + len(x[4]) == y[3] for x, y in zip(got, got[1:]))
        return b"".join(c[4] for c in got)

    async def scenario():
        async with running(root, state, rec) as (tailer, _):
            append(a, lines(0, 20))
            await until(lambda: rec.files().get(a.name) == lines(0, 20), 5, "the file")

            a.write_bytes(lines(100, 2))  # truncated in place, shorter than what was read
            await until(lambda: rec.bad("file_truncated"), 5, "the truncation")
            await until(lambda: rec.deliveries()[-1][2].endswith(lines(101, 1)), 5, "the new content")
            assert after("file_truncated") == lines(100, 2)

            tmp = a.with_name("new.tmp")
            tmp.write_bytes(lines(200, 30))  # longer than the offset: only the inode tells
            os.rename(tmp, a)
            await until(lambda: rec.bad("file_replaced"), 5, "the replacement")
            await until(lambda: rec.deliveries()[-1][2].endswith(lines(229, 1)), 5, "the replacing content")
            assert after("file_replaced") == lines(200, 30)
            assert [r for _, r, _ in rec.bad()] == ["file_truncated", "file_replaced"]

    run(scenario())


def test_a_line_longer_than_a_mebibyte_is_skipped_to_its_newline(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    (root / "job" / "0").mkdir(parents=True)
    a = rank_file(root, T0)
    long_line = b'{"Name": "' + b"z" * (3 << 19) + b'"}\n'  # 1.5 MiB

    async def scenario():
        async with running(root, state, max_read_bytes=256 << 10) as (tailer, rec):
            append(a, lines(0, 3))
            append(a, long_line[:700_000])
            append(a, long_line[700_000:] + lines(3, 3))
            await until(lambda: rec.deliveries() and rec.deliveries()[-1][2].endswith(lines(5, 1)), 5, "the lines")
            [(file, offset, data)] = [d for d in rec.deliveries() if d[1] > 0]
            assert (offset, data) == (len(lines(0, 3)) + len(long_line), lines(3, 3))
            assert [r for _, r, _ in rec.bad()] == ["line_too_long"]

    run(scenario())


def test_a_complete_line_longer_than_a_mebibyte_is_refused_even_when_one_read_holds_it(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    (root / "job" / "0").mkdir(parents=True)
    a = rank_file(root, T0)
    longest = b'{"Name": "' + b"z" * ((1 << 20) - 12) + b'"}\n'  # 1 MiB without its newline: the most there may be
    too_long = [b'{"Name": "' + b"z" * size + b'"}\n' for size in ((1 << 20) - 11, 3 << 20)]
    assert len(longest) == (1 << 20) + 1

    async def scenario():
        async with running(root, state) as (tailer, rec):  # reads of 4 MiB
            append(a, lines(0, 3) + too_long[0] + lines(3, 2) + longest + too_long[1] + lines(5, 1))
            await until(lambda: rec.deliveries() and rec.deliveries()[-1][2].endswith(lines(5, 1)), 5, "the lines")
            start = len(lines(0, 3))
            assert [(offset, data) for _, offset, data in rec.deliveries()] == [
                (0, lines(0, 3)), (start + len(too_long[0]), lines(3, 2) + longest),
                (start + len(too_long[0]) + len(lines(3, 2) + longest) + len(too_long[1]), lines(5, 1))]
            assert [detail for _, reason, detail in rec.bad("line_too_long")] == [
                f"{T0}: a line at offset {start} is longer than {1 << 20} bytes; skipped",
                f"{T0}: a line at offset {start + len(too_long[0]) + len(lines(3, 2) + longest)} is longer than "
                f"{1 << 20} bytes; skipped"]
            assert len(rec.bad()) == 2

    run(scenario())


def test_job_directories_whose_name_is_not_utf8_are_reported_once_and_not_followed(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    append(Path(os.fsdecode(bytes(root) + b"/job-\xff/0/" + str(T0).encode())), lines(0, 2))
    append(rank_file(root, T0), b"")

    async def scenario():
        async with running(root, state, replay_existing=True) as (tailer, rec):
            append(Path(os.fsdecode(bytes(root) + b"/\xfe\xfe/0/" + str(T0).encode())), lines(10, 2))
            append(rank_file(root, T0), lines(0, 3))
            await until(lambda: rec.deliveries() and len(rec.bad("job_dir")) == 2, 5, "the real rank and the report")
            assert sorted(detail for _, _, detail in rec.bad("job_dir")) == ["\\xfe\\xfe", "job-\\xff"]
            append(Path(os.fsdecode(bytes(root) + b"/job-\xff/1/" + str(T0).encode())), lines(20, 2))
            append(rank_file(root, T0), lines(3, 1))
            await until(lambda: rec.files()[str(T0)] == lines(0, 4), 5, "the next lines")
            assert {c[1] for c in rec.calls if c[0] == "lines"} == {KEY} and tailer.ranks == 1
            assert len(rec.bad()) == 2

    run(scenario())


def test_bad_rank_directories_and_symlinks_are_not_followed(tmp_path):
    root, state, outside = tmp_path / "profiling", tmp_path / "state.json", tmp_path / "outside"
    append(outside / "ranks" / str(T0), lines(900, 5))
    append(outside / str(T0 + 50), lines(950, 5))
    (root / "job" / "0").mkdir(parents=True)
    (root / "job" / "abc").mkdir()
    (root / "job" / "01").mkdir()  # not canonical: would collide with rank 1
    (root / "job" / "5").symlink_to(outside / "ranks", target_is_directory=True)
    (root / "linked").symlink_to(outside, target_is_directory=True)
    (root / "job" / "0" / str(T0 + 50)).symlink_to(outside / str(T0 + 50))  # the largest name, a symlink

    async def scenario():
        async with running(root, state, replay_existing=True) as (tailer, rec):
            assert sorted(detail for key, reason, detail in rec.bad("rank_dir")) == ["job/01", "job/abc"]
            (root / "job" / "xyz").mkdir()
            (root / "job" / "6").symlink_to(outside / "ranks", target_is_directory=True)
            (root / "job" / "0" / str(T0 + 60)).symlink_to(outside / str(T0 + 50))
            append(outside / "ranks" / str(T0), lines(905, 1))
            append(outside / str(T0 + 50), lines(955, 1))
            append(rank_file(root, T0 + 10), lines(0, 3))
            await until(lambda: rec.deliveries() and len(rec.bad("rank_dir")) == 3, 5, "the real rank")
            (root / "job" / "xyz" / "later").mkdir()  # nothing new to say about it
            append(rank_file(root, T0 + 10), lines(3, 1))
            await until(lambda: rec.files()[str(T0 + 10)] == lines(0, 4), 5, "the next lines")
            assert rec.bad("rank_dir")[-1] == (None, "rank_dir", "job/xyz") and len(rec.bad()) == 3
            assert {c[1] for c in rec.calls if c[0] == "lines"} == {KEY}
            assert tailer.ranks == 1

    run(scenario())


def test_a_root_that_appears_late_or_is_a_symlink(tmp_path):
    root, state, target = tmp_path / "later" / "profiling", tmp_path / "state.json", tmp_path / "target"
    append(target / "job" / "0" / str(T0), lines(0, 3))

    async def scenario():
        async with running(root, state, root_poll_s=0.05) as (tailer, rec):
            await until(lambda: tailer.state == "waiting for root", 5, "the wait")
            assert tailer.readiness() == (True, "")
            root.parent.mkdir()
            root.symlink_to(target, target_is_directory=True)
            await until(lambda: tailer.state == "the root is a symlink", 5, "the refusal")
            root.unlink()
            append(rank_file(root, T0), lines(10, 4))  # created after the agent started: from 0
            await until(lambda: rec.deliveries(), 5, "the late root")
            assert rec.files() == {str(T0): lines(10, 4)} and tailer.state == "watching"

            shutil.rmtree(root)
            await until(lambda: ("gone", KEY) in rec.calls and tailer.state == "waiting for root", 5, "root gone")
            append(rank_file(root, T0 + 1), lines(20, 2))
            await until(lambda: str(T0 + 1) in rec.files(), 5, "the root back")
            assert rec.first() == (str(T0), 0) and rec.files()[str(T0 + 1)] == lines(20, 2)

    run(scenario())


def test_removed_ranks_and_jobs_are_gone_and_leave_the_state(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    root.mkdir()

    async def scenario():
        async with running(root, state, commit_interval_s=0.05) as (tailer, rec):
            for job, rank in (("a", 0), ("a", 1), ("b", 0), ("b", 3)):
                append(rank_file(root, T0, job=job, rank=rank), lines(0, 2))
            await until(lambda: tailer.ranks == 4 and len(rec.deliveries(RankKey("b", 3))) == 1, 5, "four ranks")
            await until(lambda: state.exists() and len(state_of(state)) == 4, 5, "the state")
            shutil.rmtree(root / "a" / "1")
            shutil.rmtree(root / "b")
            await until(lambda: tailer.ranks == 1, 5, "the removals")
            assert sorted((c[1].job_id, c[1].rank) for c in rec.calls if c[0] == "gone") == [("a", 1), ("b", 0), ("b", 3)]
            await until(lambda: list(state_of(state)) == ["a/0"], 5, "the state without them")
            tailer.commit(RankKey("b", 0), Position(str(T0), 5))  # late: ignored
            (root / "a" / "1").mkdir()  # a rank back under the same name is a new rank
            append(rank_file(root, T0 + 1, job="a", rank=1), lines(7, 1))
            await until(lambda: rec.files(RankKey("a", 1)).get(str(T0 + 1)), 5, "the new rank")
        assert sorted(state_of(state)) == ["a/0", "a/1"]

    run(scenario())


def test_an_inotify_overflow_loses_and_repeats_no_line(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    (root / "job" / "0").mkdir(parents=True)
    (root / "job" / "1").mkdir(parents=True)
    max_events = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    count = max_events // 2 + 2000  # CREATE and CLOSE_WRITE each: more than the queue holds

    async def scenario():
        async with running(root, state) as (tailer, rec):
            append(rank_file(root, T0), lines(0, 5))
            append(rank_file(root, T0, rank=1), lines(0, 5))
            await until(lambda: len(rec.deliveries(RankKey("job", 1))) and rec.deliveries(), 5, "the first lines")
            # Blocking the loop on purpose: the tailer cannot read its queue meanwhile.
            for i in range(count):
                rank = i % 2
                with open(root / "job" / str(rank) / f"burst-{i}", "wb"):  # noqa: ASYNC230
                    pass
                if i % 1000 == 0:
                    append(rank_file(root, T0, rank=rank), lines(5 + i, 1))
            append(rank_file(root, T0 + 1, rank=1), lines(90_000, 3))  # a rotation while events are lost
            append(rank_file(root, T0 + 1, job="job2", rank=4), lines(0, 2))  # a new job too
            await until(lambda: tailer.overflows >= 1 and str(T0 + 1) in rec.files(RankKey("job", 1))
                        and rec.deliveries(RankKey("job2", 4)), 20, "the rescan")
            assert tailer.rescans >= 2
            append(rank_file(root, T0), lines(99_999, 1))  # and it keeps following afterwards
            await until(lambda: rec.files()[str(T0)].endswith(lines(99_999, 1)), 5, "events after the rescan")
        expected = {0: lines(0, 5), 1: lines(0, 5)}
        for i in range(0, count, 1000):
            expected[i % 2] += lines(5 + i, 1)
        assert rec.files() == {str(T0): expected[0] + lines(99_999, 1)}
        assert rec.files(RankKey("job", 1)) == {str(T0): expected[1], str(T0 + 1): lines(90_000, 3)}
        assert rec.files(RankKey("job2", 4)) == {str(T0 + 1): lines(0, 2)}
        assert rec.bad() == []

    run(scenario())


def test_parallel_group_is_handed_over_on_appearance_and_change(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    group_file = root / "job" / "0" / "parallel_group.json"
    group = {"hccl_world": {"group_name": "default_group", "group_rank": 0, "global_ranks": [0, 1]}}
    append(group_file, json.dumps(group).encode())

    async def scenario():
        async with running(root, state) as (tailer, rec):
            await until(lambda: [c for c in rec.calls if c[0] == "group"], 5, "the existing group")
            changed = {**group, "tp": {"group_name": "tp", "group_rank": 1, "global_ranks": [0, 1, 2, 3]}}
            group_file.write_text(json.dumps(changed))
            await until(lambda: len([c for c in rec.calls if c[0] == "group"]) == 2, 5, "the change")
            group_file.write_text(json.dumps(changed))  # the same content again: nothing new
            group_file.write_text("[1, 2]")
            await until(lambda: rec.bad("parallel_group"), 5, "the bad group")
            group_file.write_text("{not json")
            await until(lambda: len(rec.bad("parallel_group")) == 2, 5, "the broken group")
            group_file.unlink()
            append(rank_file(root, T0), lines(0, 1))
            await until(lambda: rec.deliveries(), 5, "a line after the removal")
            tmp = group_file.with_name("g.tmp")
            tmp.write_text(json.dumps(changed))
            os.rename(tmp, group_file)
            await until(lambda: len([c for c in rec.calls if c[0] == "group"]) == 3, 5, "the group back")
            assert [c[2] for c in rec.calls if c[0] == "group"] == [group, changed, changed]
            assert [c[1] for c in rec.calls if c[0] == "group"] == [KEY] * 3
            assert len(rec.bad()) == 2

    run(scenario())


def test_a_corrupt_state_file_is_moved_aside_and_the_tailer_starts_without_it(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    append(rank_file(root, T0), lines(0, 5))
    state.write_text('{"version": 1, "ranks": {"job/0": {"file": "17000', "utf-8")

    async def scenario():
        async with running(root, state) as (tailer, rec):
            [aside] = tmp_path.glob("state.json.corrupt-*")
            assert aside.read_text() == '{"version": 1, "ranks": {"job/0": {"file": "17000'
            append(rank_file(root, T0), lines(5, 2))
            await until(lambda: rec.deliveries(), 5, "new lines")
            assert rec.files() == {str(T0): lines(5, 2)}  # as without a state: from the end
            tailer.commit(KEY, Position(str(T0), len(lines(0, 7))))

    run(scenario())
    assert state_of(state) == {"job/0": {"file": str(T0), "offset": len(lines(0, 7)), "size": len(lines(0, 7))}}


def test_stop_returns_within_a_second_when_a_read_is_stuck(tmp_path):
    root, state = tmp_path / "profiling", tmp_path / "state.json"
    (root / "job" / "0").mkdir(parents=True)
    entered, stuck = threading.Event(), threading.Event()

    async def scenario():
        rec = Recorder()
        tailer = ProfilingTailer(root, state, rec, batch_window_s=0.02, executor=HeldReads(stuck, entered))
        rec.tailer = tailer
        await tailer.start()
        await until(entered.is_set, 5, "a stuck read")
        started = time.monotonic()
        await tailer.stop()
        took = time.monotonic() - started
        assert took < 1.0, took
        assert tailer.state == "stopped" and state_of(state) == {"job/0": {"file": "0000000000", "offset": 0}}

    try:
        run(scenario())
    finally:
        stuck.set()
