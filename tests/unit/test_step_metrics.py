"""StepMetrics, the tailer's consumer, on an injected clock: positions committed, steps counted once,
ended jobs dropped, bad input counted."""

from __future__ import annotations

import asyncio
import logging
import tracemalloc
from pathlib import Path

from prometheus_client import generate_latest

from agent.demo.job import DemoJob
from agent.metrics import make_registry
from agent.steps.metrics import StepCollector
from agent.steps.records import RankKey
from agent.steps.consumer import (ACTIVE_GRACE_S, GONE_GRACE_S, IDLE_GRACE_S, LOGGED_MAX, MAX_PROCESSES, StepMetrics,
                                  pipeline_stage, tensor_group)
from agent.steps.pairing import MAX_OPEN
from agent.steps.cursors import Position
from testkit.training.job import TrainingJob
from testkit.wait import until
from tests.support.clock import FakeClock as Clock

KEY = RankKey("job", 0)


def job_lines(steps: int) -> list[bytes]:
    job = DemoJob(Path("unused"), ranks=1, stages=1, step_s=0.5, slow_rank=0, slow_after_s=1e9, started=1.8e9)
    out = []
    for _ in range(steps):
        out.append(job.lines_until(job._step_start + 0.75)[0].encode())  # one step at a time
    return out


def marker(flag: int, ident: int, name: str = "NULL", pid: int = 7, ts: int = 1_800_000_000_000_000_000,
           source: int = 0) -> bytes:
    """One record line as TaskD writes it."""
    return (f'{{"Kind":1,"Flag":{flag},"SourceKind":{source},"Timestamp":{ts},"Id":{ident},"MsptiObjectId":{{"Pt":'
            f'{{"ProcessId":{pid},"ThreadId":1}},"Ds":{{"DeviceId":0,"StreamId":1}}}},"Name":"{name}",'
            f'"Domain":"default"}}\n').encode()


class Consumer(StepMetrics):
    """StepMetrics with a record of the positions its batches handed back."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.commits = []

    def on_batch_end(self):
        handed = super().on_batch_end()
        self.commits += handed.items()
        return handed


def consumer(tmp_path: Path, clock: Clock, **kwargs) -> tuple[StepMetrics, list]:
    steps = Consumer(tmp_path / "steps.json", clock=clock, **kwargs)
    return steps, steps.commits


def test_steps_are_counted_and_the_end_of_what_was_read_is_committed(tmp_path):
    steps, commits = consumer(tmp_path, Clock())
    data = b"".join(job_lines(3))
    steps.on_lines(KEY, "1800000000", 100, data)
    steps.on_batch_end()
    series = steps.ranks[KEY]
    assert series.steps_total == 3 and series.steps["device"].count == 3
    assert commits == [(KEY, Position("1800000000", 100 + len(data)))]


def test_a_step_in_flight_holds_the_commit_at_the_read_that_began_it(tmp_path):
    steps, commits = consumer(tmp_path, Clock())
    first, second = job_lines(2)
    cut = len(first) // 2
    steps.on_lines(KEY, "1800000000", 0, first[:first.rindex(b"\n", 0, cut) + 1])
    steps.on_batch_end()
    assert commits[-1] == (KEY, Position("1800000000", 0)) and steps.ranks[KEY].steps_total == 0
    rest = first[first.rindex(b"\n", 0, cut) + 1:] + second
    steps.on_lines(KEY, "1800000000", cut, rest)
    steps.on_batch_end()
    assert steps.ranks[KEY].steps_total == 2


def test_steps_read_again_after_a_restart_are_not_counted_twice(tmp_path):
    clock = Clock()
    data = b"".join(job_lines(4))
    steps, _ = consumer(tmp_path, clock)
    steps.on_lines(KEY, "1800000000", 0, data)
    steps.on_batch_end()
    steps.save()
    again, _ = consumer(tmp_path, clock)  # a new run reads the same bytes from an older position
    again.on_lines(KEY, "1800000000", 0, data + b"".join(job_lines(5)[4:]))
    again.on_batch_end()
    assert again.ranks[KEY].steps_total == 1


def test_ranks_of_ended_jobs_leave_the_scrape_after_their_grace_with_no_record_arriving(tmp_path):
    clock = Clock()
    steps, _ = consumer(tmp_path, clock, upkeep_s=0.01)
    scrape = make_registry(StepCollector("node", lambda: steps, clock))
    other = RankKey("other", 3)

    def scraped_jobs() -> set[str]:
        text = generate_latest(scrape).decode()
        return {job for job in ("job", "other") if f'job_id="{job}"' in text}

    async def scenario():
        await steps.start()
        for key in (KEY, other):
            steps.on_lines(key, "1800000000", 0, b"".join(job_lines(2)))
        steps.on_batch_end()
        steps.on_rank_gone(KEY)
        clock.now += GONE_GRACE_S + 1  # and nothing more arrives: the node is idle
        await until(lambda: scraped_jobs() == {"other"}, 10, "the removed rank leaving the scrape")
        assert KEY not in steps.detector.ranks
        clock.now += IDLE_GRACE_S
        await until(lambda: not scraped_jobs(), 10, "the idle rank leaving the scrape")
        await steps.stop()

    asyncio.run(scenario())
    assert StepMetrics(tmp_path / "steps.json")._restored == {}  # and the state


def test_bad_input_is_counted_by_reason_and_logged_once_a_minute(tmp_path, caplog):
    clock = Clock()
    steps, _ = consumer(tmp_path, clock)
    for _ in range(3):
        steps.on_lines(KEY, "1800000000", 0, b"garbage\n")
    steps.on_bad_input(KEY, "file_truncated", "1800000000 shrank")
    steps.on_group(KEY, {"g": {"group_name": "pp", "global_ranks": [4, 5]}})  # does not list rank 0
    assert +steps.parse_errors == {"not_json": 3, "file_truncated": 1, "parallel_group": 1}
    assert len([r for r in caplog.records if "not_json" == getattr(r, "reason", "")]) == 1
    clock.now += 61
    steps.on_lines(KEY, "1800000000", 0, b"garbage\n")
    assert len([r for r in caplog.records if "not_json" == getattr(r, "reason", "")]) == 2


def test_a_corrupt_step_state_is_moved_aside_and_ignored(tmp_path, caplog):
    clock = Clock()
    (tmp_path / "steps.json").write_text('{"version": 1, "ranks": {"job/0": {"41000": 1.5}}}')
    steps, _ = consumer(tmp_path, clock)
    steps.on_lines(KEY, "1800000000", 0, b"".join(job_lines(1)))
    steps.on_batch_end()
    assert steps.ranks[KEY].steps_total == 1
    assert any(r.getMessage() == "step state of the wrong shape; moved aside, starting without it"
               for r in caplog.records)
    assert (tmp_path / f"steps.json.corrupt-{int(clock.now)}").exists() and not (tmp_path / "steps.json").exists()


def test_one_bad_marker_line_in_a_write_loses_none_of_the_others(tmp_path):
    # Escapes JSON refuses, or that give no text, must not pass the fast parser and fail later.
    for bad in ("\\x41", "\\ud800", "\\uZZZZ"):
        steps, _ = consumer(tmp_path, Clock())
        lines = job_lines(10)
        bad_range = marker(2, 999_999, f"mark {bad}") + marker(4, 999_999)
        steps.on_lines(KEY, "1800000000", 0, b"".join(lines[:5]) + bad_range + b"".join(lines[5:]))
        steps.on_batch_end()
        assert steps.ranks[KEY].steps_total == 10, bad
        assert sum(steps.parse_errors.values()) == 1, (bad, steps.parse_errors)


def test_every_dropped_marker_is_counted(tmp_path):
    steps, _ = consumer(tmp_path, Clock())
    steps.on_lines(KEY, "1800000000", 0, b"".join(marker(2, i, f"op {i}") for i in range(MAX_OPEN + 10)))
    steps.on_batch_end()
    assert +steps.parse_errors == {"unpaired": 10}


def test_what_ranks_hold_for_unfinished_ranges_is_bounded_per_node(tmp_path, caplog):
    clock = Clock()
    steps, _ = consumer(tmp_path, clock, max_held=10_000)
    flood = b"".join(marker(16, i, f"op {i}") + marker(16, i, f"op {i}", source=1) for i in range(3000))
    healthy = job_lines(3)
    first, second = healthy[0], healthy[1]
    cut = first.rindex(b"\n", 0, len(first) // 2) + 1  # a step in flight on a healthy rank
    steps.on_lines(KEY, "1800000000", 0, first[:cut])
    steps.on_batch_end()
    for rank in range(1, 9):  # 8 ranks, each holding 9,000 entries: 72,000 without the bound
        steps.on_lines(RankKey("flood", rank), "1800000000", 0, flood)
        steps.on_batch_end()
        held = [s.assembler.held for s in steps.ranks.values()]
        assert sum(held) <= 10_000, held
    held = sum(s.assembler.held for s in steps.ranks.values())
    assert 9_900 < held and steps.parse_errors["node_limit"] == 8 * 9000 + steps.ranks[KEY].held - held
    steps.on_lines(KEY, "1800000000", cut, first[cut:] + second)
    steps.on_batch_end()
    assert steps.ranks[KEY].steps_total == 2  # the rank holding little kept what it held
    assert len([r for r in caplog.records if getattr(r, "reason", "") == "node_limit"]) == 1


def test_a_rank_keeps_the_newest_step_of_a_bounded_number_of_processes(tmp_path):
    steps, _ = consumer(tmp_path, Clock())
    for pid in range(100, 100 + 3 * MAX_PROCESSES):  # one step of each of many processes
        ts = 1_800_000_000_000_000_000 + pid * 10**9
        steps.on_lines(KEY, "1800000000", 0, marker(2, pid, "step 1", pid, ts) + marker(4, pid, pid=pid, ts=ts + 10**8))
        steps.on_batch_end()
    series = steps.ranks[KEY]
    assert series.steps_total == 3 * MAX_PROCESSES
    assert list(series.last_steps) == list(range(100 + 2 * MAX_PROCESSES, 100 + 3 * MAX_PROCESSES))


def test_logging_bad_input_keeps_a_bounded_memory_of_what_it_logged(tmp_path, caplog):
    clock = Clock()
    steps, _ = consumer(tmp_path, clock)
    caplog.set_level(logging.WARNING)
    for file in range(LOGGED_MAX + 10):  # as many files, each with a bad line, within a minute
        steps.on_lines(KEY, f"{1800000000 + file}", 0, b"garbage\n")
    assert +steps.parse_errors == {"not_json": LOGGED_MAX + 10}
    assert len(caplog.records) == LOGGED_MAX  # the rest only counted
    clock.now += 61
    steps.on_lines(KEY, "1900000000", 0, b"garbage\n")
    assert len(caplog.records) == LOGGED_MAX + 1 and len(steps._logged) == 1


def test_the_pipeline_stage_is_the_rank_s_index_in_its_pp_group():
    group = {"a": {"group_name": "tp", "global_ranks": [0, 1]}, "b": {"group_name": "pp", "global_ranks": [1, 9, 17]}}
    assert pipeline_stage(group, 9) == "1"
    assert pipeline_stage({"a": {"group_name": "dp", "global_ranks": [0, 1]}}, 0) == ""  # no pipeline: one stage
    assert pipeline_stage(group, 4) is None and pipeline_stage([], 0) is None


def test_the_baselines_survive_a_restart_in_the_step_state(tmp_path):
    clock = Clock()
    lines = job_lines(80)
    steps, _ = consumer(tmp_path, clock)
    steps.on_lines(KEY, "1800000000", 0, b"".join(lines[:75]))
    steps.on_batch_end()
    baseline = steps.detector.ranks[KEY].baseline
    assert baseline is not None
    steps.save()
    again, _ = consumer(tmp_path, clock)
    again.on_lines(KEY, "1800000000", 0, b"".join(lines))
    again.on_batch_end()
    state = again.detector.ranks[KEY]
    assert again.ranks[KEY].steps_total == 5 and state.baseline == baseline and state.warmup_left == 0


def test_a_rank_gives_back_the_memory_of_a_burst_once_it_is_paired(tmp_path):
    steps, _ = consumer(tmp_path, Clock())
    # 2000 pairs: the dicts grow well past the size _compact gives back, and the burst read with
    # every allocation traced (five times slower) still takes only about a second for the 10 ranks.
    burst = b"".join(marker(2, i, f"op {i}") for i in range(2000)) + b"".join(marker(4, i) for i in range(2000))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for rank in range(10):
            steps.on_lines(RankKey("job", rank), "1800000000", 0, burst)
            steps.on_batch_end()
        per_rank = (tracemalloc.get_traced_memory()[0] - before) / 10
    finally:
        tracemalloc.stop()
    assert sum(s.assembler.held for s in steps.ranks.values()) == 0
    assert per_rank < 64 << 10, per_rank  # ~34 KiB; it kept ~164 KiB: a dict keeps the size it grew to


def test_the_tensor_group_is_the_tp_group_listing_the_rank():
    group = {"a": {"group_name": "tp", "global_ranks": [5, 4, 6, 7]}, "b": {"group_name": "pp", "global_ranks": [4, 20]}}
    assert tensor_group(group, 6) == (4, 5, 6, 7)
    assert tensor_group(group, 20) is None  # listed in no tp group: its worker is found from the records
    assert tensor_group({"a": {"group_name": "tp", "global_ranks": [0, "1"]}}, 0) is None  # malformed: ignored


def scrape(steps: StepMetrics, clock: Clock) -> dict[str, float]:
    """name{labels} -> value of the step families, through the registry as /metrics renders them."""
    out = {}
    registry = make_registry()
    registry.register(StepCollector("n1", lambda: steps, clock))
    for family in registry.collect():
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in
                              ("node", "namespace", "job_name", "job_id"))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def test_a_rank_in_a_step_is_training_and_a_rank_whose_steps_stopped_is_not(tmp_path):
    # step 1 complete at t = 0..1 s, then step 2 begins at 1 s and its end is not written.
    clock = Clock(1_800_000_010.0)
    steps, _ = consumer(tmp_path, clock)
    base = 1_800_000_000_000_000_000
    lines = (marker(2, 1, "step 1", ts=base) + marker(4, 1, ts=base + 10**9) + marker(2, 2, "step 2", ts=base + 10**9))
    steps.on_lines(KEY, "1800000000", 0, lines)
    steps.on_batch_end()
    series = steps.ranks[KEY]
    assert series.open_step_s == 1_800_000_001.0 and series.read_lag_s == 10.0  # its oldest record
    assert steps.active(KEY, clock())
    metrics = scrape(steps, clock)
    assert metrics["training_step_open_since_timestamp_seconds{pp_stage=,rank=0}"] == 1_800_000_001.0
    assert metrics["training_rank_active{pp_stage=,rank=0}"] == 1
    assert metrics["training_profiling_lag_seconds{rank=0}"] == 10.0
    # Hung: in one step for longer than 60 s (no baseline yet): no longer training; the lag stays
    # what it was when the records were read (nothing new is late).
    clock.advance(60)
    assert not steps.active(KEY, clock())
    assert scrape(steps, clock)["training_profiling_lag_seconds{rank=0}"] == 10.0
    # Step 2 ends and nothing follows: finished. Training until ACTIVE_GRACE_S after that end.
    steps.on_lines(KEY, "1800000000", len(lines), marker(4, 2, ts=base + 75 * 10**9))
    steps.on_batch_end()
    assert series.open_step_s is None and steps.active(KEY, 1_800_000_075.0 + ACTIVE_GRACE_S)
    assert not steps.active(KEY, 1_800_000_075.0 + ACTIVE_GRACE_S + 1)
    assert "training_step_open_since_timestamp_seconds{pp_stage=,rank=0}" not in scrape(steps, clock)


def test_a_rank_saving_a_checkpoint_is_not_training_and_a_lost_end_does_not_hold_it(tmp_path):
    clock = Clock(1_800_000_005.0)
    steps, _ = consumer(tmp_path, clock)
    base = 1_800_000_000_000_000_000
    lines = marker(2, 1, "step 1", ts=base) + marker(2, 2, "save_checkpoint", ts=base + 10**9)
    steps.on_lines(KEY, "1800000000", 0, lines)
    steps.on_batch_end()
    assert steps.ranks[KEY].open_checkpoint_s == 1_800_000_001.0 and not steps.active(KEY, clock())
    assert scrape(steps, clock)["training_checkpoint_open_since_timestamp_seconds{pp_stage=,rank=0}"] == 1_800_000_001.0
    # The step ends later, the checkpoint's end was lost: it began before the step ended, so it ended.
    more = marker(4, 1, ts=base + 3 * 10**9) + marker(2, 3, "step 2", ts=base + 3 * 10**9)
    steps.on_lines(KEY, "1800000000", len(lines), more)
    steps.on_batch_end()
    assert steps.ranks[KEY].open_checkpoint_s is None and steps.active(KEY, clock())
    # A step whose end was lost is not in progress once a later step of the process is done.
    later = marker(2, 4, "step 3", ts=base + 4 * 10**9) + marker(4, 4, ts=base + 5 * 10**9)
    steps.on_lines(KEY, "1800000000", len(lines) + len(more), later)
    steps.on_batch_end()
    assert steps.ranks[KEY].open_step_s is None


def test_worker_families_are_exported_while_the_worker_trains(tmp_path):
    clock = Clock(1.8e9)
    steps, _ = consumer(tmp_path, clock)
    job = DemoJob(Path("unused"), ranks=4, stages=1, step_s=0.5, slow_rank=0, slow_after_s=1e9, started=1.8e9)
    for rank in range(4):
        steps.on_group(RankKey("job", rank), {"tp": {"group_name": "tp", "global_ranks": [rank - rank % 2, rank - rank % 2 + 1]}})
    text = job.lines_until(1.8e9 + 0.5 * 40)
    for rank in range(4):
        steps.on_lines(RankKey("job", rank), "1800000000", 0, text[rank].encode())
    clock.at(20.5)
    steps.on_batch_end()
    metrics = scrape(steps, clock)
    assert metrics["training_worker_info{pod_name=,pp_stage=,ranks=0-1,worker=0}"] == 1
    assert metrics["training_worker_info{pod_name=,pp_stage=,ranks=2-3,worker=2}"] == 1
    assert {k for k in metrics if k.startswith("training_worker_compute_seconds")} == {
        f"training_worker_compute_seconds{{pp_stage=,window={n},worker={w}}}" for n in (8,) for w in (0, 2)}
    assert metrics["training_worker_slow{pp_stage=,reason=compute,worker=0}"] == 0
    clock.advance(ACTIVE_GRACE_S + 1)  # the job stopped: its evidence leaves the scrape, its info stays
    metrics = scrape(steps, clock)
    assert not [k for k in metrics if k.startswith(("training_worker_compute", "training_worker_slow"))]
    assert metrics["training_worker_info{pod_name=,pp_stage=,ranks=0-1,worker=0}"] == 1


def test_a_rank_has_the_count_and_sum_of_its_steps_and_its_job_the_histograms_which_never_go_back(tmp_path):
    clock = Clock()
    steps, _ = consumer(tmp_path, clock)
    lines = job_lines(5)  # steps of 0.5 s
    other = RankKey("job", 1)
    for key in (KEY, other):
        steps.on_lines(key, "1800000000", 0, b"".join(lines[:3]))
    steps.on_batch_end()
    metrics = scrape(steps, clock)
    assert metrics["training_step_duration_seconds_count{clock=device,pp_stage=,rank=0}"] == 3
    total = metrics["training_step_duration_seconds_sum{clock=device,pp_stage=,rank=0}"]
    assert 3 * 0.5 * 0.95 < total < 3 * 0.5 * 1.05
    assert not [k for k in metrics if k.startswith("training_step_duration_seconds_bucket")]  # no bucket per rank
    assert metrics["training_node_step_duration_seconds_count{clock=device}"] == 6  # both ranks' steps
    assert metrics["training_node_step_duration_seconds_bucket{clock=device,le=0.25}"] == 0
    assert metrics["training_node_step_duration_seconds_bucket{clock=device,le=1.0}"] == 6
    assert metrics["training_node_phase_duration_seconds_count{phase=forward}"] == 6
    assert metrics["training_node_phase_duration_seconds_count{phase=dataloader}"] == 6
    assert not [k for k in metrics if "phase=save_checkpoint" in k]  # no checkpoint saved yet
    # A rank that leaves takes none of its steps out of the job's histograms (they are counters).
    steps.on_rank_gone(KEY)
    clock.advance(GONE_GRACE_S + 1)
    steps.on_lines(other, "1800000000", len(b"".join(lines[:3])), b"".join(lines[3:]))
    steps.on_batch_end()
    steps.upkeep()
    metrics = scrape(steps, clock)
    assert "training_step_duration_seconds_count{clock=device,pp_stage=,rank=0}" not in metrics
    assert metrics["training_node_step_duration_seconds_count{clock=device}"] == 8
    # The last rank of the job leaves: so do its histograms, from the scrape and from memory.
    clock.advance(IDLE_GRACE_S + 1)
    steps.upkeep()
    assert not [k for k in scrape(steps, clock) if k.startswith("training_node_")] and steps.jobs == {}


def node_scrape(ranks: int, tmp_path: Path) -> tuple[int, dict[str, int]]:
    """(series of the step families, series by where they grow) of a node holding `ranks` ranks of
    one job at TP 1 (a worker per rank: the most series a rank can bring), every rank training with
    every worker window filled."""
    job = TrainingJob(tp=1, dp=ranks // 4, pp=4, ranks_per_node=ranks, job_id="job", steps=None,
                      start_wall=1_800_000_000.0)
    clock = Clock(job.start_wall)
    steps, _ = consumer(tmp_path / str(ranks), clock)
    for rank in range(ranks):
        steps.on_group(RankKey("job", rank), job.parallel_group(rank))
    offsets = [0] * ranks
    for flush in job.flushes(job.start_wall + 170.5):  # 20 warm-up steps and the longest window of 128
        steps.on_lines(RankKey("job", flush.rank), "1800000000", offsets[flush.rank], flush.data)
        offsets[flush.rank] += len(flush.data)
        clock.now = flush.wall
        steps.on_batch_end()
    where = {"rank": 0, "worker": 0, "job": 0}
    for family in make_registry(StepCollector("n1", lambda: steps, clock)).collect():
        for sample in family.samples:
            unit = next((u for u, label in (("rank", "rank"), ("worker", "worker"), ("job", "job_id"))
                         if label in sample.labels), None)
            if unit:
                where[unit] += 1
    return sum(where.values()), where


def test_a_training_rank_costs_at_most_30_series_its_workers_included(tmp_path):
    """The series budget (docs/metrics.md): what a node exports grows by at most 30 series per rank,
    counted as Prometheus would, from two nodes of 8 and 16 ranks."""
    small, _ = node_scrape(8, tmp_path)
    large, where = node_scrape(16, tmp_path)
    assert where["worker"] == 16 * 9  # info, compute and its stderr in 3 windows, 2 verdicts: all read by the rules
    # + 1: training_checkpoint_open_since_timestamp_seconds, while a rank saves a checkpoint (not here).
    assert (large - small) / 8 + 1 <= 30
    assert where["rank"] / 16 + 9 + 1 <= 30
    assert where["job"] < 100  # the job's histograms and verdicts, whatever its ranks
