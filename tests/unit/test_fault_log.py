"""The durable fault log: revisions across restarts, torn tails, epochs, cursors, failed writes, compaction.

Every write goes through the agent's own path: the `*_async` methods on an event loop, the disk I/O
in the executor's fault-log lane (the `loop` fixture)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import zlib

import pytest

from agent.common.executor import Executor, Lane
from agent.model import ActiveCode, DeviceState, Health, Level
from agent.faults.log import FaultLog
from testkit.wait import until
from tests.support.clock import FakeClock


def state(phy: int, code: int | None = None) -> DeviceState:
    if code is None:
        return DeviceState(phy, phy)
    active = ActiveCode(code, f"{code:08X}", Level.SeparateNPU, 1_780_000_000_000, 3, "")
    return DeviceState(phy, phy, Health.UNHEALTHY, Level.SeparateNPU, 1_780_000_000_000, (active,))


def churn(count: int) -> list[DeviceState]:
    """`count` changes over four devices, every other one a fault."""
    return [state(i % 4, 0x80E18402 if i % 2 else None) for i in range(count)]


def opened(tmp_path, **kwargs) -> FaultLog:
    log = FaultLog(tmp_path / "faultlog", **kwargs)
    log.open()
    return log


class Loop:
    """The agent's event loop, kept across a test's calls, and the executor lane the fault log writes in."""

    def __init__(self, runner: asyncio.Runner, lane: Lane):
        self.run = runner.run
        self.lane = lane

    def open(self, tmp_path, **kwargs) -> FaultLog:
        return opened(tmp_path, lane=self.lane, **kwargs)


@pytest.fixture
def loop():
    executor = Executor()
    with asyncio.Runner() as runner:
        yield Loop(runner, executor.lane("fault-log"))
    executor.close()


async def append_each(log: FaultLog, states: list[DeviceState]) -> None:
    """One append per change, as the fault service's passes make them (each may compact)."""
    for item in states:
        await log.append_async([item])


def test_revisions_and_states_survive_a_reopen(loop, tmp_path):
    log = loop.open(tmp_path)
    assert [c.revision for c in loop.run(log.append_async([state(0), state(1, 0x80E18402)]))] == [1, 2]
    loop.run(log.append_async([state(1)]))
    epoch = log.epoch
    loop.run(log.close_async())
    again = loop.open(tmp_path)
    assert (again.epoch, again.revision) == (epoch, 3)
    assert again.latest()[1].state == state(1) and again.latest()[1].revision == 3
    assert [c.revision for c in again.changes_after(1)] == [2, 3]
    assert again.state_at(2)[1] == state(1, 0x80E18402)
    assert [c.revision for c in loop.run(again.append_async([state(2)]))] == [4]


def test_a_torn_tail_is_cut_off_and_logged(loop, tmp_path, caplog):
    log = loop.open(tmp_path)
    loop.run(log.append_async([state(0), state(1, 0x80E18402)]))
    loop.run(log.close_async())
    path = tmp_path / "faultlog" / "log"
    whole = path.read_bytes()
    path.write_bytes(whole + whole.splitlines(keepends=True)[1][:30])  # a crash mid-write
    again = loop.open(tmp_path)
    assert again.revision == 2 and again.truncated_bytes == 30
    assert path.read_bytes() == whole
    assert "torn or corrupt tail" in caplog.text
    assert [c.revision for c in loop.run(again.append_async([state(3)]))] == [3]


def test_a_torn_tail_keeps_the_epoch(loop, tmp_path):
    log = loop.open(tmp_path)
    loop.run(log.append_async([state(0)]))
    loop.run(log.commit_async("clusterd", 1))
    loop.run(log.close_async())
    with open(tmp_path / "faultlog" / "log", "ab") as handle:
        handle.write(b"0123abcd {\"rev\":2")  # the unfinished write was never handed to anyone
    again = opened(tmp_path)
    assert again.epoch == log.epoch and again.resets == [] and again.cursor("clusterd") == 1


def test_a_corrupt_record_cuts_the_log_there_and_starts_a_new_epoch(loop, tmp_path):
    log = loop.open(tmp_path)
    loop.run(log.append_async([state(0), state(1), state(2)]))
    loop.run(log.close_async())
    path = tmp_path / "faultlog" / "log"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"phy":1', b'"phy":7')  # checksum no longer matches
    path.write_bytes(b"".join(lines))
    again = opened(tmp_path)
    assert again.revision == 1 and set(again.latest()) == {0}
    assert again.epoch != log.epoch and any("corrupt record" in r for r in again.resets)


def test_cursors_and_sink_state_persist_and_pending_counts(loop, tmp_path):
    log = loop.open(tmp_path)
    assert log.cursor("clusterd") is None and log.sink_state("clusterd") is None  # a new sink resynchronises
    loop.run(log.append_async([state(0), state(1)]))
    assert log.pending("clusterd") == 2
    loop.run(log.commit_async("clusterd", 1, {"held": ["x"]}))
    loop.run(log.close_async())
    again = opened(tmp_path)
    assert again.cursor("clusterd") == 1 and again.pending("clusterd") == 1
    assert again.sink_state("clusterd") == {"held": ["x"]}


@pytest.mark.parametrize("damage", ["deleted", "truncated", "truncated-no-sink"])
def test_a_log_lost_or_cut_between_runs_starts_a_new_epoch_and_cursors_follow(loop, tmp_path, damage):
    log = loop.open(tmp_path)
    loop.run(log.append_async([state(0), state(1, 0x80E18402), state(2)]))
    if damage != "truncated-no-sink":
        loop.run(log.commit_async("clusterd", 3, {"held": []}))
    loop.run(log.close_async())
    path = tmp_path / "faultlog" / "log"
    if damage == "deleted":
        path.unlink()
    else:
        path.write_bytes(b"".join(path.read_bytes().splitlines(keepends=True)[:1]))  # whole records, just fewer
    again = loop.open(tmp_path)
    assert again.epoch != log.epoch and again.resets
    assert again.cursor("clusterd") is None  # from another epoch: resynchronise, whatever the number says
    assert again.pending("clusterd") >= 0
    assert [c.revision for c in loop.run(again.append_async([state(5)]))] == [again.revision]
    if damage != "truncated-no-sink":
        assert again.sink_state("clusterd") == {"held": []}  # what the sink knew of its peer is still true
    loop.run(again.commit_async("clusterd", again.revision, {"held": []}))
    loop.run(again.close_async())
    third = opened(tmp_path)
    assert (third.epoch, third.resets, third.cursor("clusterd")) == (again.epoch, [], again.revision)


@pytest.mark.parametrize("content, aside", [
    (b'["not", "an", "object"]', True), (b"{oops", True), (b'{"revision": NaN}', True), (b"\xff\xfe", True),
    (b'{"sinks": {"clusterd": {"revision": 1e400, "epoch": "x"}}}', True),
    (b'{"sinks": {"clusterd": {"revision": "x"}}}', False)])  # JSON of the right shape, one sink's entry wrong
def test_cursors_of_the_wrong_shape_are_skipped_with_a_log_line(loop, tmp_path, caplog, content, aside):
    log = loop.open(tmp_path)
    loop.run(log.append_async([state(0)]))
    loop.run(log.close_async())
    path = tmp_path / "faultlog" / "cursors.json"
    path.write_bytes(content)
    again = opened(tmp_path)
    assert again.cursor("clusterd") is None and again.revision == 1
    kept = [p.read_bytes() for p in path.parent.glob("cursors.json.corrupt-*")]
    if aside:
        assert "fault log cursors of the wrong shape; moved aside" in caplog.text and kept == [content]
    else:
        assert "cursor is malformed" in caplog.text and kept == []


def test_the_first_cursor_format_is_read(loop, tmp_path):
    log = loop.open(tmp_path)
    loop.run(log.append_async([state(0), state(1)]))
    loop.run(log.close_async())
    (tmp_path / "faultlog" / "cursors.json").write_text(json.dumps({"clusterd": 1}))
    again = opened(tmp_path)
    assert (again.epoch, again.cursor("clusterd")) == (log.epoch, 1)


def test_a_failed_append_changes_nothing_and_the_next_one_works(loop, small_fs):
    log = loop.open(small_fs.path)
    loop.run(log.append_async([state(0)]))
    before = (small_fs.path / "faultlog" / "log").read_bytes()
    small_fs.fill()
    with pytest.raises(OSError):
        loop.run(log.append_async([state(1, 0x80E18402)] * 400))  # more than the page the file already has
    assert log.revision == 1 and (small_fs.path / "faultlog" / "log").read_bytes() == before
    small_fs.free()
    assert [c.revision for c in loop.run(log.append_async([state(1, 0x80E18402)]))] == [2]
    loop.run(log.close_async())
    again = opened(small_fs.path)
    assert again.revision == 2 and again.truncated_bytes == 0 and again.resets == []


def test_a_failed_commit_keeps_the_old_cursor_and_a_later_one_saves(loop, small_fs):
    log = loop.open(small_fs.path)
    loop.run(log.append_async([state(0), state(1)]))
    loop.run(log.commit_async("clusterd", 1))
    small_fs.read_only()
    try:
        with pytest.raises(OSError):
            loop.run(log.commit_async("clusterd", 2))
        assert log.cursor("clusterd") == 1
    finally:
        small_fs.read_only(False)
    loop.run(log.commit_async("clusterd", 2))
    loop.run(log.close_async())
    again = opened(small_fs.path)
    assert again.cursor("clusterd") == 2


# The tests below append changes one at a time, as the agent does, to see what compaction keeps:
# 1100 or so, a little more than the 1034 at which a log with keep_recent=10 first compacts (at
# least 1024 dead records). They open their logs with fsync=False: on a real disk each append's
# flush costs milliseconds (at 5 ms a flush these tests took 7 to 36 s each); durability is the
# business of the tests above.


def test_compaction_keeps_what_a_lagging_sink_still_needs(loop, tmp_path):
    log = loop.open(tmp_path, keep_recent=10, fsync=False)
    loop.run(log.commit_async("clusterd", 0))
    loop.run(append_each(log, churn(1500)))
    loop.run(log.commit_async("clusterd", 1200))  # compaction may fold everything up to 1200
    assert log.changes_after(1199) is None
    assert [c.revision for c in log.changes_after(1200)][:2] == [1201, 1202]
    size = (tmp_path / "faultlog" / "log").stat().st_size
    loop.run(log.close_async())
    again = opened(tmp_path, keep_recent=10)
    assert again.revision == 1500 and again.cursor("clusterd") == 1200
    assert again.state_at(1200) == log.state_at(1200)
    assert again.latest() == log.latest()
    assert size < 100_000  # the 1500 records took 228 kB, the 300 kept 46 kB


@pytest.mark.parametrize("body", [b"[1]", b"5", b"[" * 100_000 + b"]" * 100_000, b'{"rev": 2, "state": {"phy": []}}',
                                  b'{"rev": 1e400, "state": {}}', b'{"rev": 2, "state": NaN}'])
def test_a_record_of_the_wrong_shape_is_a_corrupt_record_kept_aside(loop, tmp_path, body):
    log = loop.open(tmp_path)
    loop.run(log.append_async([state(0)]))
    loop.run(log.close_async())
    record = b"%08x %s\n" % (zlib.crc32(body), body)  # checksum right, content wrong
    with open(tmp_path / "faultlog" / "log", "ab") as handle:
        handle.write(record)
    again = opened(tmp_path)
    assert again.revision == 1 and any("corrupt record" in r for r in again.resets)
    assert [p.read_bytes() for p in (tmp_path / "faultlog").glob("log.corrupt-*")] == [record]


@pytest.mark.parametrize("content", ['{"epoch": 7}', '{"epoch": ["x"]}', "[" * 100_000 + "]" * 100_000])
def test_meta_of_the_wrong_shape_starts_a_new_epoch(loop, tmp_path, content):
    loop.run(loop.open(tmp_path).close_async())
    (tmp_path / "faultlog" / "meta.json").write_text(content)
    again = opened(tmp_path)
    assert isinstance(again.epoch, str) and len(again.epoch) == 16


def test_cursors_with_sinks_of_the_wrong_shape(loop, tmp_path):
    loop.run(loop.open(tmp_path).close_async())
    (tmp_path / "faultlog" / "cursors.json").write_text('{"epoch": "x", "sinks": 5}')
    assert opened(tmp_path).cursor("clusterd") is None


def test_acknowledging_every_record_lets_compaction_fold_them_and_a_clean_stop_is_noted(loop, tmp_path):
    log = loop.open(tmp_path, keep_recent=10, fsync=False)
    assert [c.revision for c in loop.run(log.append_async([state(0), state(1, 0x80E18402)]))] == [1, 2]
    loop.run(log.commit_async("clusterd", 2, {"held": ["x"]}))
    loop.run(append_each(log, [state(i % 4) for i in range(1100)]))
    loop.run(log.commit_async("clusterd", log.revision))  # every record acknowledged: compaction folds them
    assert log.changes_after(1) is None and log.revision == 1102
    loop.run(log.close_async())
    again = opened(tmp_path)
    assert (again.revision, again.cursor("clusterd"), again.previous_clean) == (1102, 1102, True)
    assert again.latest()[1].state == state(1)


def test_a_caller_cancelled_mid_write_leaves_the_log_consistent(loop, tmp_path):
    async def body():
        log = loop.open(tmp_path)
        release = threading.Event()
        loop.lane.submit(release.wait, 10)  # the disk is busy: the write waits behind this
        write = asyncio.ensure_future(log.append_async([state(0, 0x80E18402)]))
        await asyncio.sleep(0)
        write.cancel()
        release.set()
        assert [c.revision for c in await log.append_async([state(0)])] == [2]  # after the first, not instead
        return log

    log = loop.run(body())
    again = opened(tmp_path)
    assert again.revision == 2 and [c.state for c in again.changes_after(0)] == [state(0, 0x80E18402), state(0)]
    assert log.latest() == again.latest()


def test_a_write_that_does_not_return_makes_the_log_stalled_until_it_does(loop, tmp_path):
    async def body():
        log = loop.open(tmp_path, slow_write_s=0.05)
        release = threading.Event()
        loop.lane.submit(release.wait, 10)  # a hung disk
        write = asyncio.ensure_future(log.append_async([state(0)]))
        await until(lambda: log.stalled, 20, "the write to be reported slow")
        assert "has not returned" in log.stalled
        release.set()
        assert [c.revision for c in await write] == [1]
        assert log.stalled == ""

    loop.run(body())


# ---- the cursor of a sink that is switched off ---------------------------------------------------

DAY = 86400.0
RETIRING = "cursor of a sink that is not configured; kept for a while, then dropped"
DROPPED = "cursor of a sink no longer configured dropped; the fault log compacts without it"


@pytest.fixture
def info_log(caplog):
    caplog.set_level(logging.INFO, logger="agent.faults.log")  # the retirement's lines are info
    return caplog


def lines(tmp_path) -> int:
    return len((tmp_path / "faultlog" / "log").read_bytes().splitlines())


def saved_sinks(tmp_path) -> dict:
    return json.loads((tmp_path / "faultlog" / "cursors.json").read_text())["sinks"]


def switched_off(loop, tmp_path, clock, **kwargs) -> FaultLog:
    """A run that acknowledged up to revision 0 for clusterd, then a start with clusterd switched off."""
    on = loop.open(tmp_path, keep_recent=10, sinks=["clusterd"], clock=clock)
    loop.run(on.commit_async("clusterd", 0, {"held": ["x"]}))
    loop.run(on.close_async())
    return loop.open(tmp_path, keep_recent=10, sinks=[], retire_after_s=DAY, clock=clock, **kwargs)


@pytest.mark.parametrize("elapsed, kept", [(DAY - 1, True), (DAY, False)])
def test_a_switched_off_sinks_cursor_holds_the_log_for_a_while_then_is_dropped(loop, tmp_path, info_log, elapsed,
                                                                                kept):
    clock = FakeClock()
    log = switched_off(loop, tmp_path / "a", clock, fsync=False)
    clock.advance(elapsed)
    loop.run(append_each(log, churn(1100)))
    if kept:  # switched back on now, it would resume from its cursor
        assert log.cursor("clusterd") == 0 and len(log.changes_after(0)) == 1100
        assert DROPPED not in info_log.text
    else:
        # The same appends in a log that never had the cursor: what the configured sinks need.
        alone = loop.open(tmp_path / "b", keep_recent=10, sinks=[], fsync=False)
        loop.run(append_each(alone, churn(1100)))
        assert (lines(tmp_path / "a"), lines(tmp_path / "b")) == (77, 77)  # base record + 76 changes
        assert log.cursor("clusterd") is None
        assert info_log.text.count(DROPPED) == 1
        assert log.sink_state("clusterd") == {"held": ["x"]}  # what it knew of its peer, for a resync
        assert saved_sinks(tmp_path / "a")["clusterd"]["revision"] is None  # saved at once, not at a clean stop
    assert info_log.text.count(RETIRING) == 1


def test_the_while_counts_from_the_first_start_without_the_sink_across_restarts(loop, tmp_path, info_log):
    clock = FakeClock()
    loop.run(switched_off(loop, tmp_path, clock).close_async())
    clock.advance(DAY - 1)
    again = loop.open(tmp_path, keep_recent=10, sinks=[], retire_after_s=DAY, clock=clock)
    assert again.cursor("clusterd") == 0
    loop.run(again.close_async())
    clock.advance(1)
    third = loop.open(tmp_path, keep_recent=10, sinks=[], retire_after_s=DAY, clock=clock)
    assert third.cursor("clusterd") is None
    loop.run(third.close_async())
    fourth = opened(tmp_path, keep_recent=10, sinks=["clusterd"], retire_after_s=DAY, clock=clock)
    assert fourth.cursor("clusterd") is None and fourth.sink_state("clusterd") == {"held": ["x"]}
    assert (info_log.text.count(RETIRING), info_log.text.count(DROPPED)) == (1, 1)  # once each, over four starts


def test_a_sink_switched_back_on_within_the_while_resumes_and_its_while_starts_afresh(loop, tmp_path):
    clock = FakeClock()
    off = switched_off(loop, tmp_path, clock, fsync=False)
    loop.run(append_each(off, churn(1100)))
    loop.run(off.close_async())
    clock.advance(DAY - 1)
    on = loop.open(tmp_path, keep_recent=10, sinks=["clusterd"], retire_after_s=DAY, clock=clock)
    assert on.cursor("clusterd") == 0 and len(on.changes_after(0)) == 1100
    assert on.sink_state("clusterd") == {"held": ["x"]}
    assert "unconfigured_since" not in saved_sinks(tmp_path)["clusterd"]
    loop.run(on.close_async())
    clock.advance(2)  # past the first while: switched off again, the while starts again
    again = opened(tmp_path, keep_recent=10, sinks=[], retire_after_s=DAY, clock=clock)
    assert again.cursor("clusterd") == 0


@pytest.mark.parametrize("since", ['"yesterday"', "true", "[1]", "null", "{}", "4e12"])  # 4e12: far in the future
def test_a_retirement_time_of_the_wrong_shape_starts_the_while_again(loop, tmp_path, since):
    clock = FakeClock()
    loop.run(switched_off(loop, tmp_path, clock).close_async())
    path = tmp_path / "faultlog" / "cursors.json"
    path.write_text(path.read_text().replace('"unconfigured_since": 1800000000.0', f'"unconfigured_since": {since}'))
    clock.advance(DAY - 1)
    again = loop.open(tmp_path, keep_recent=10, sinks=[], retire_after_s=DAY, clock=clock)
    assert again.cursor("clusterd") == 0
    loop.run(again.close_async())
    clock.advance(DAY)
    assert opened(tmp_path, keep_recent=10, sinks=[], retire_after_s=DAY, clock=clock).cursor("clusterd") is None


def test_a_retired_cursor_saved_as_null_is_read_back_without_an_error(loop, tmp_path, info_log):
    clock = FakeClock()
    loop.run(switched_off(loop, tmp_path, clock).close_async())
    clock.advance(DAY)
    loop.run(loop.open(tmp_path, keep_recent=10, sinks=[], retire_after_s=DAY, clock=clock).close_async())
    again = opened(tmp_path, keep_recent=10, sinks=["clusterd"], retire_after_s=DAY, clock=clock)
    assert again.cursor("clusterd") is None and again.pending("clusterd") == again.revision
    assert "malformed" not in info_log.text


def test_a_cursor_whose_while_ends_during_a_run_is_dropped_and_compacted_past(loop, tmp_path, info_log):
    clock = FakeClock()
    log = switched_off(loop, tmp_path, clock, fsync=False)
    clock.advance(DAY)
    loop.run(append_each(log, [state(i % 4) for i in range(1100)]))
    assert log.cursor("clusterd") is None and log.changes_after(1000) is None  # compacted past its cursor
    loop.run(log.close_async())
    assert saved_sinks(tmp_path)["clusterd"]["revision"] is None and info_log.text.count(DROPPED) == 1
