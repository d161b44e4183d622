"""The training-job generator (`testkit.training`): its layout, the records it writes and the timings
it models, checked against the facts it is meant to reproduce."""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import defaultdict

import pytest

from agent.steps.pairing import RankAssembler
from agent.steps.records import parse
from testkit.training import Layout, SlowWorker, TrainingJob

LINE = re.compile(r'\{"Kind":1,"Flag":(2|4|16|32),"SourceKind":([01]),"Timestamp":(\d+),"Id":(\d+),'
                  r'"MsptiObjectId":\{"Pt":\{"ProcessId":(\d+),"ThreadId":\5\},"Ds":\{"DeviceId":\5,"StreamId":\5\}\},'
                  r'"Name":"([^"]*)","Domain":"(default|NULL)"\}')
END = math.inf


def ranges(job: TrainingJob) -> dict[int, list[dict]]:
    """Per rank, its ranges in id order: {"name", "host": (start, end), "device": (start, end) | None} in ns."""
    records = defaultdict(dict)  # (rank, id) -> {(flag, source): timestamp, "name": ...}
    for flush in job.flushes(END):
        for line in flush.data.decode().splitlines():
            flag, source, stamp, ident, _, name, _ = LINE.fullmatch(line).groups()
            entry = records[flush.rank, int(ident)]
            entry[int(flag), int(source)] = int(stamp)
            if name != "NULL":
                entry["name"] = name
    out = defaultdict(list)
    for (rank, _), entry in sorted(records.items()):
        host_only = (2, 0) in entry
        out[rank].append({"name": entry["name"],
                          "host": (entry[2 if host_only else 16, 0], entry[4 if host_only else 32, 0]),
                          "device": None if host_only else (entry[16, 1], entry[32, 1])})
    return out


def named(found: list[dict], name: str) -> list[dict]:
    return [r for r in found if r["name"] == name]


def ratios_to_stage_median(job: TrainingJob, step: int) -> dict[int, float]:
    """Each rank's forward over the median forward of its stage in that step."""
    forward, per_stage = job.timings(step).forward, defaultdict(list)
    for rank in range(job.layout.ranks):
        per_stage[job.layout.stage(rank)].append(rank)
    return {r: forward[r] / statistics.median(forward[m] for m in members)
            for members in per_stage.values() for r in members}


def test_layout_places_ranks_the_megatron_way():
    layout = Layout(tp=4, dp=4, pp=4)
    assert layout.ranks == 64 and list(layout.workers) == list(range(0, 64, 4))
    assert layout.worker(5) == 4 and list(layout.members(4)) == [4, 5, 6, 7]
    assert layout.stage(16) == 1 and layout.stage(15) == 0 and layout.stage(63) == 3
    assert layout.node(9) == 1 and layout.node(7) == 0
    assert layout.coordinates(5) == (1, 1, 0) and layout.rank(1, 2, 3) == 57 and layout.coordinates(57) == (1, 2, 3)
    assert layout.stage_peers(4) == [0, 8, 12] and layout.stage_peers(20) == [16, 24, 28]
    assert layout.parallel_group(5) == {
        "tp_group_4": {"group_name": "tp", "group_rank": 1, "global_ranks": [4, 5, 6, 7]},
        "dp_group_1": {"group_name": "dp", "group_rank": 1, "global_ranks": [1, 5, 9, 13]},
        "pp_group_5": {"group_name": "pp", "group_rank": 0, "global_ranks": [5, 21, 37, 53]},
        "default_group_0": {"group_name": "default_group", "group_rank": 5, "global_ranks": list(range(64))},
    }
    assert layout.parallel_group(57)["pp_group_9"]["group_rank"] == 3
    wide = Layout(tp=16, dp=2, pp=4)
    assert {wide.node(r) for r in wide.members(16)} == {2, 3}  # a TP group of 16 spans two 8-rank nodes
    # 128 ranks: no default group
    assert [g["group_name"] for g in wide.parallel_group(0).values()] == ["tp", "dp", "pp"]
    with pytest.raises(ValueError):
        layout.worker(64)


def test_records_are_taskd_lines_flushed_by_phase():
    def make() -> TrainingJob:
        return TrainingJob(tp=2, dp=2, pp=2, steps=12, checkpoint_every=5, seed=3)
    job = make()
    flushes = list(job.flushes(END))
    assert [f.wall for f in flushes] == sorted(f.wall for f in flushes)
    per_rank = defaultdict(list)
    for flush in flushes:
        cycles = (flush.wall - job.start_wall - job.phases[flush.rank]) / job.flush_s
        assert abs(cycles - round(cycles)) < 1e-6 and 0 <= job.phases[flush.rank] < job.flush_s
        previous = per_rank[flush.rank][-1].wall if per_rank[flush.rank] else -1
        lines = flush.data.decode().splitlines()
        stamps = [int(LINE.fullmatch(line).group(3)) for line in lines]
        assert stamps == sorted(stamps) and previous * 1e9 - 1e3 < stamps[0] and stamps[-1] <= flush.wall * 1e9 + 1e3
        for line in lines:
            assert list(json.loads(line)) == ["Kind", "Flag", "SourceKind", "Timestamp", "Id", "MsptiObjectId", "Name",
                                              "Domain"]
            flag, source, _, _, obj, name, domain = LINE.fullmatch(line).groups()
            assert int(obj) == (40000 + flush.rank if source == "0" else flush.rank % 8)
            assert (domain == "NULL") == (name == "NULL") == (flag in ("4", "32"))
        per_rank[flush.rank].append(flush)
    found = ranges(make())
    for rank in range(8):
        data = b"".join(f.data for f in per_rank[rank])
        assert data.count(b"\n") == 12 * 10 + 2 * 2  # step 4 + dataloader 2 + forward 4, + checkpoint 2
        started = [int(m[4]) for m in LINE.finditer(data.decode()) if m[1] in ("2", "16") and m[2] == "0"]
        assert started == list(range(1, 12 * 3 + 2 + 1))  # one id per range, increasing
        steps = [r for r in found[rank] if r["name"].startswith("step ")]
        assert [r["name"] for r in steps] == [f"step {s}" for s in range(1, 13)] and all(r["device"] for r in steps)
        assert len(found[rank]) == 12 * 3 + 2  # every id once, each range complete
        # the job's last record goes out at the rank's next flush, and nothing after
        assert per_rank[rank][-1].wall - job.flush_s < steps[-1]["device"][1] / 1e9 <= per_rank[rank][-1].wall
    assert list(job.flushes(END)) == []


def test_flushes_resume_where_they_stopped_and_replay_from_the_seed():
    whole = list(TrainingJob(seed=9, steps=30, gc_every=7).flushes(END))
    job = TrainingJob(seed=9, steps=30, gc_every=7)
    parts = []
    for until in (job.start_wall - 1, job.start_wall + 3.3, job.start_wall + 11, job.start_wall + 11, END):
        parts += job.flushes(until)
    assert parts == whole
    assert [f.data for f in TrainingJob(seed=10, steps=30, gc_every=7).flushes(END)] != [f.data for f in whole]


def test_timings_do_not_depend_on_the_order_they_are_asked_for():
    one, other = TrainingJob(seed=4, steps=50, seq_imbalance=True), TrainingJob(seed=4, steps=50, seq_imbalance=True)
    late = one.timings(37), one.step_start(37)
    for step in range(1, 51):
        other.timings(step)
    assert (other.timings(37), other.step_start(37)) == late
    assert other.last_wall == one.last_wall == one.step_end(50)


def test_the_records_say_what_the_timings_say():
    job = TrainingJob(tp=2, dp=2, pp=2, steps=10, checkpoint_every=4, gc_every=3, slow=(SlowWorker(6, 1.4),), seed=2)
    assemblers = defaultdict(RankAssembler)
    for flush in job.flushes(END):
        assemblers[flush.rank].feed(parse(flush.data).markers, flush.wall)
    for rank, assembler in assemblers.items():
        samples = assembler.finalize()
        assert [s.step for s in samples] == list(range(1, 11)) and not assembler.errors
        for sample in samples:
            truth = job.timings(sample.step)
            assert sample.clock == "device"
            assert sample.start_ns / 1e9 == pytest.approx(job.step_start(sample.step) + 40e-6, abs=1e-6)
            assert sample.duration_s == pytest.approx(truth.rank_duration[rank], abs=1e-8)
            assert sample.forward_s == pytest.approx(truth.forward[rank], abs=1e-8)
            assert sample.dataloader_s == pytest.approx(truth.dataloader[rank], abs=1e-8)
            assert sample.checkpoint == (sample.step % 4 == 0)


def test_a_slow_worker_slows_its_forward_and_everyone_s_step():
    job = TrainingJob(tp=2, dp=4, pp=2, steps=40, slow=(SlowWorker(2, 1.3, from_step=11, until_step=30),), seed=5)
    slow_steps, normal_steps = range(11, 31), [*range(1, 11), *range(31, 41)]
    for rank in (2, 3):
        peers = [r for w in job.layout.stage_peers(2) for r in job.layout.members(w)]
        assert peers == [0, 1, 4, 5, 6, 7]

        def ratio(step: int) -> float:
            forward = job.timings(step).forward
            return forward[rank] / statistics.median(forward[p] for p in peers)
        assert statistics.median(map(ratio, slow_steps)) == pytest.approx(1.3, abs=0.02)
        assert statistics.median(map(ratio, normal_steps)) == pytest.approx(1.0, abs=0.02)
    for rank in range(16):
        slow = statistics.median(job.timings(s).rank_duration[rank] for s in slow_steps)
        normal = statistics.median(job.timings(s).rank_duration[rank] for s in normal_steps)
        assert slow / normal == pytest.approx(1 + 0.65 * 0.3, abs=0.03)


def test_the_published_slow_worker_doubles_the_step():
    job = TrainingJob(dp=8, pp=8, steps=20, slow=(SlowWorker(13, 2.5),), step_s=23.5, forward_s=5.0, seed=1)
    assert statistics.median(job.timings(s).duration for s in range(1, 21)) == pytest.approx(46.3, rel=0.02)


def test_tp_members_agree_and_dp_peers_scatter_by_the_noise():
    job = TrainingJob(tp=4, dp=16, pp=1, steps=40, seed=6)
    spread = []
    for step in range(1, 41):
        timing = job.timings(step)
        for worker in job.layout.workers:
            forwards = [timing.forward[r] for r in job.layout.members(worker)]
            assert max(forwards) / min(forwards) - 1 < 0.003
        spread += [r - 1 for r in ratios_to_stage_median(job, step).values()]
    assert 0.008 < statistics.pstdev(spread) < 0.012


def test_sequence_imbalance_reproduces_the_published_spread():
    job = TrainingJob(dp=32, pp=2, steps=320, seq_imbalance=True, seed=8)
    per_rank = defaultdict(list)
    for step in range(1, 321):
        for rank, ratio in ratios_to_stage_median(job, step).items():
            per_rank[rank].append(ratio)
    ratios = [r for values in per_rank.values() for r in values]
    quantiles = statistics.quantiles(ratios, n=100)
    assert len(ratios) >= 20_000
    assert quantiles[89] == pytest.approx(1.12, abs=0.01) and quantiles[98] == pytest.approx(1.27, abs=0.02)
    assert all(0.94 <= statistics.median(values) <= 1.04 for values in per_rank.values())  # nobody persistently slow


def test_stage_factors_make_the_last_stage_slower():
    job = TrainingJob(dp=2, pp=4, steps=60, stage_factors=(1, 1, 1, 2.07), noise=0.002, seed=7)
    last = [job.timings(s).forward[6] / job.timings(s).forward[0] for s in range(1, 61)]
    assert statistics.median(last) == pytest.approx(2.07, rel=0.005)
    ratios = [ratios_to_stage_median(job, s) for s in range(1, 61)]
    for rank in range(8):  # the ranks of a stage agree
        assert statistics.median(r[rank] for r in ratios) == pytest.approx(1, abs=0.005)


def test_checkpoints_lie_inside_their_step_and_lengthen_it():
    job = TrainingJob(steps=15, checkpoint_every=5, checkpoint_s=4.0, seed=11)
    found = ranges(job)
    for rank in range(job.layout.ranks):
        steps = {int(r["name"].split()[1]): r for r in found[rank] if r["name"].startswith("step ")}
        saves = named(found[rank], "save_checkpoint")
        assert len(saves) == 3 and all(r["device"] is None for r in saves)
        for save, step in zip(saves, (5, 10, 15)):
            start, end = steps[step]["host"]
            assert start < save["host"][0] < save["host"][1] < end
            assert (save["host"][1] - save["host"][0]) / 1e9 == pytest.approx(4.0, rel=0.05)
            forward = named(found[rank], "forward")[step - 1]
            assert forward["host"][1] <= save["host"][0]
    durations = [job.timings(s).duration for s in range(1, 16)]
    assert statistics.mean(durations[4::5]) - statistics.mean(durations[:4]) == pytest.approx(4.0, abs=0.1)


def test_a_pause_holds_every_step_and_every_flush():
    job = TrainingJob(steps=8, pauses=((3, 60.0),), seed=12)
    assert job.step_start(4) - job.step_end(3) == pytest.approx(60.0, abs=1e-3)
    for rank, found in ranges(job).items():
        assert (found[3 * 3]["host"][0] - found[2 * 3]["host"][1]) / 1e9 == pytest.approx(60.0, abs=0.01)
    assert not [f for f in job.flushes(END)]  # all written already
    quiet = TrainingJob(steps=8, pauses=((3, 60.0),), seed=12)
    walls = [f.wall for f in quiet.flushes(END)]
    assert not [w for w in walls if quiet.step_end(3) + quiet.flush_s < w < quiet.step_start(4)]


def test_a_gc_pause_stalls_the_whole_worker_and_the_step():
    job = TrainingJob(tp=4, dp=2, pp=1, steps=40, gc_every=4, gc_s=0.3, seed=13)
    paused_steps = 0
    for step in range(1, 41):
        timing = job.timings(step)
        if step % 4:
            assert not timing.paused and timing.duration < 1.1
            continue
        stalled = {job.layout.worker(r) for r in timing.paused}
        paused_steps += bool(stalled)
        for rank in range(8):
            assert (timing.forward[rank] > 0.55) == (job.layout.worker(rank) in stalled)
        assert (timing.duration > 1.15) == bool(stalled)
    assert paused_steps >= 5


def test_an_endless_job_keeps_flushing():
    job = TrainingJob(steps=None, seed=14)
    assert job.last_wall is None
    walls = [f.wall for f in job.flushes(job.start_wall + 100)]
    assert job.start_wall + 95 < walls[-1] <= job.start_wall + 100
    assert [f.wall for f in job.flushes(job.start_wall + 110)][0] > walls[-1]
