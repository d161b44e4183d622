"""Pairing markers into steps: any order, across writes and files, the device clock when the range is on a stream."""

from __future__ import annotations

import random

from agent.steps.pairing import RankAssembler

MS = 1_000_000
PID, DEV = 4242, 3


def m(flag, source, ts_ms, ident, name=b"NULL", domain=b"default"):
    """A marker as `records.parse` gives it: the raw text of every field."""
    fields = (flag, source, int(ts_ms * MS), ident, PID if source == 0 else DEV)
    return (*(str(v).encode() for v in fields), name, domain)


def stream_range(ident, name, start_ms, end_ms, device_lag_ms=0.5):
    """A range on a stream: host start/end (16/32) and device start/end; only starts carry the name."""
    return [m(16, 0, start_ms, ident, name), m(16, 1, start_ms + device_lag_ms, ident, name),
            m(32, 0, end_ms, ident), m(32, 1, end_ms + device_lag_ms, ident)]


def host_range(ident, name, start_ms, end_ms):
    return [m(2, 0, start_ms, ident, name), m(4, 0, end_ms, ident)]


def one_step(number, t0_ms, ident0):
    """step `number` from t0 for 1000 ms: dataloader 50 ms, two forwards of 300 ms, a checkpoint-free step."""
    return (stream_range(ident0, f"step {number}".encode(), t0_ms, t0_ms + 1000)
            + host_range(ident0 + 1, b"dataloader", t0_ms + 10, t0_ms + 60)
            + stream_range(ident0 + 2, b"forward", t0_ms + 100, t0_ms + 400)
            + stream_range(ident0 + 3, b"forward", t0_ms + 500, t0_ms + 800))


def test_a_step_on_a_stream_is_timed_on_the_device_with_its_phases():
    assembler = RankAssembler()
    assembler.feed(one_step(7, 10_000, 100), ("0000000001", 0))
    [sample] = assembler.finalize()
    assert (sample.step, sample.pid, sample.clock) == (7, PID, "device")
    assert sample.duration_s == 1.0 and sample.wall_end_s == 11.0
    assert sample.forward_s == 0.6 and sample.dataloader_s == 0.05 and not sample.checkpoint
    assert assembler.finalize() == [] and assembler.oldest_needed() is None and not assembler.errors


def five_steps():
    records = [r for n in range(5) for r in one_step(n, 10_000 + n * 1000, 100 + 10 * n)]
    expected = RankAssembler()
    expected.feed(list(records), ("f", 0))
    want = expected.finalize()
    assert [s.step for s in want] == [0, 1, 2, 3, 4] and {s.forward_s for s in want} == {0.6}
    return records, want


def test_records_in_any_order_within_a_write_give_the_same_steps():
    records, want = five_steps()
    for seed in range(20):
        shuffled = records[:]
        random.Random(seed).shuffle(shuffled)
        assembler = RankAssembler()
        assembler.feed(shuffled, ("f", 0))
        assert assembler.finalize() == want and not assembler.errors


def test_writes_cut_anywhere_with_device_records_late_give_the_same_steps():
    # What TaskD does: each source's records in time order, the device's later than the host's,
    # a write (and a file) ending anywhere, so starts and ends of one range land in different ones.
    records, want = five_steps()
    for seed in range(20):
        rng = random.Random(seed)
        lag_ms = rng.choice([0, 300, 1500, 2500])
        ordered = sorted(records, key=lambda r: int(r[2]) + (lag_ms * MS if r[1] == b"1" else 0))
        cuts = sorted(rng.sample(range(1, len(ordered)), 8))
        assembler, got = RankAssembler(), []
        for index, (low, high) in enumerate(zip([0, *cuts], [*cuts, len(ordered)])):
            assembler.feed(ordered[low:high], (f"{index // 3:010d}", low))
            got += assembler.finalize()
        assert got == want, (seed, lag_ms)
        assert not assembler.errors and assembler.oldest_needed() is None


def test_a_host_only_step_uses_the_host_clock_and_host_forwards():
    assembler = RankAssembler()
    assembler.feed(host_range(1, b"step 3", 0, 2000) + host_range(2, b"forward", 100, 1600), ("f", 0))
    [sample] = assembler.finalize()
    assert sample.clock == "host" and sample.duration_s == 2.0 and sample.forward_s == 1.5


def test_a_step_waits_for_its_device_half_and_falls_back_to_the_host_once_a_later_step_is_done():
    assembler = RankAssembler()
    first = stream_range(1, b"step 1", 0, 1000)
    assembler.feed([r for r in first if r[1] == b"0"], ("f", 0))  # the device half is late
    assert assembler.finalize() == []
    assert assembler.oldest_needed() == ("f", 0)
    assembler.feed(stream_range(2, b"step 2", 1000, 2000), ("f", 100))
    samples = assembler.finalize()
    assert [(s.step, s.clock) for s in samples] == [(1, "host"), (2, "device")]
    assert assembler.errors["device_range_missing"] == 1


def test_a_checkpoint_overlapping_the_step_marks_it():
    assembler = RankAssembler()
    assembler.feed(stream_range(1, b"step 9", 0, 5000) + host_range(2, b"save_checkpoint", 4000, 9000), ("f", 0))
    [sample] = assembler.finalize()
    assert sample.checkpoint


def test_a_checkpoint_between_steps_marks_neither():
    assembler = RankAssembler()
    assembler.feed(stream_range(1, b"step 1", 0, 1000) + host_range(2, b"save_checkpoint", 1100, 1900)
                   + stream_range(3, b"step 2", 2000, 3000), ("f", 0))
    assert [s.checkpoint for s in assembler.finalize()] == [False, False]


def test_the_oldest_needed_position_is_the_oldest_unfinished_record():
    assembler = RankAssembler()
    step = stream_range(1, b"step 1", 0, 1000)
    assembler.feed(step[:1], ("0000000001", 10))
    assembler.feed(host_range(2, b"forward", 100, 200), ("0000000001", 500))
    assembler.feed(step[1:2], ("0000000002", 0))
    assert assembler.finalize() == []
    assert assembler.oldest_needed() == ("0000000001", 10)
    assembler.feed(step[2:], ("0000000002", 300))
    assert len(assembler.finalize()) == 1
    assert assembler.oldest_needed() is None  # the forward inside the step was used and dropped


def test_bad_sequences_are_counted_and_never_make_a_step():
    assembler = RankAssembler()
    assembler.feed([m(32, 0, 50, 1)], ("f", 0))  # an end without a start (its start never comes)
    assembler.feed([m(16, 0, 100, 2, b"step 1"), m(16, 0, 120, 2, b"step 1")], ("f", 1))  # id reused
    assembler.feed([m(32, 0, 90, 2)], ("f", 2))  # ends before it started: timestamps going backwards
    assembler.feed(host_range(3, b"step one", 0, 10), ("f", 3))  # no step number
    assembler.feed([m(2, 0, 0, 4), m(4, 0, 5, 4)], ("f", 4))  # a range nobody named
    assert assembler.finalize() == []
    assert dict(assembler.errors) == {"id_reused": 1, "negative_duration": 1, "bad_step_name": 1, "unnamed_range": 1}


def test_unpaired_records_are_bounded():
    assembler = RankAssembler()
    assembler.feed([m(2, 0, i, i, b"forward") for i in range(5000)], ("f", 0))
    assert assembler.errors["unpaired"] == 5000 - 4096


def test_communication_and_unknown_names_are_ignored():
    assembler = RankAssembler()
    assembler.feed(host_range(1, b'{"opName":"HcclAllReduce"}', 0, 10) + host_range(2, b"step 5", 0, 10)[:0]
                   + host_range(3, b"optimizer", 0, 10), ("f", 0))
    assembler.feed([m(2, 0, 0, 4, b"step 6", b"communication"), m(4, 0, 1, 4)], ("f", 1))
    assert assembler.finalize() == [] and not assembler.errors


def test_shedding_drops_the_oldest_of_what_is_held():
    assembler = RankAssembler()
    for i in range(100):  # starts whose ends have not come: a name and a half-seen range each
        assembler.feed([m(2, 0, i, i, f"op {i}".encode())], ("f", i))
    assert assembler.held == 200 and assembler.oldest_needed() == ("f", 0)
    assert assembler.shed(100) == 100
    assert assembler.held == 100 and assembler.oldest_needed() == ("f", 50)
    assert assembler.shed(100) == 0
