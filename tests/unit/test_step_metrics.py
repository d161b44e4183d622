"""StepMetrics, the tailer's consumer, on an injected clock: positions committed, steps counted once,
ended jobs dropped, bad input counted."""

from __future__ import annotations

from pathlib import Path

from agent.demo_job import DemoJob
from agent.profiling.records import RankKey
from agent.profiling.step_metrics import GONE_GRACE_S, IDLE_GRACE_S, StepMetrics, pipeline_stage
from agent.profiling.tail import Position

KEY = RankKey("job", 0)


class Clock:
    def __init__(self):
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def job_lines(steps: int) -> list[bytes]:
    job = DemoJob(Path("unused"), ranks=1, stages=1, step_s=0.5, slow_rank=0, slow_after_s=1e9, started=1.8e9)
    out = []
    for _ in range(steps):
        out.append(job.lines_until(job._step_start + 0.75)[0].encode())  # one step at a time
    return out


def consumer(tmp_path: Path, clock: Clock) -> tuple[StepMetrics, list]:
    commits = []
    steps = StepMetrics(tmp_path / "steps.json", clock=clock)
    steps.commit = lambda key, position: commits.append((key, position))
    return steps, commits


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


def test_ranks_of_ended_jobs_leave_the_scrape_after_their_grace(tmp_path):
    clock = Clock()
    steps, _ = consumer(tmp_path, clock)
    other = RankKey("other", 3)
    for key in (KEY, other):
        steps.on_lines(key, "1800000000", 0, b"".join(job_lines(2)))
    steps.on_batch_end()
    steps.on_rank_gone(KEY)
    clock.now += GONE_GRACE_S + 1
    steps.on_batch_end()
    assert set(steps.ranks) == {other} and KEY not in steps.detector.ranks
    clock.now += IDLE_GRACE_S
    steps.on_batch_end()
    assert steps.ranks == {}


def test_bad_input_is_counted_by_reason_and_logged_once_a_minute(tmp_path, caplog):
    clock = Clock()
    steps, _ = consumer(tmp_path, clock)
    for _ in range(3):
        steps.on_lines(KEY, "1800000000", 0, b"garbage\n")
    steps.on_bad_input(KEY, "file_truncated", "1800000000 shrank")
    steps.on_group(KEY, {"g": {"group_name": "pp", "global_ranks": [4, 5]}})  # does not list rank 0
    assert steps.parse_errors == {"not_json": 3, "file_truncated": 1, "parallel_group": 1}
    assert len([r for r in caplog.records if "not_json" == getattr(r, "reason", "")]) == 1
    clock.now += 61
    steps.on_lines(KEY, "1800000000", 0, b"garbage\n")
    assert len([r for r in caplog.records if "not_json" == getattr(r, "reason", "")]) == 2


def test_a_corrupt_step_state_is_reported_and_ignored(tmp_path, caplog):
    (tmp_path / "steps.json").write_text("{not json")
    steps, _ = consumer(tmp_path, Clock())
    steps.on_lines(KEY, "1800000000", 0, b"".join(job_lines(1)))
    steps.on_batch_end()
    assert steps.ranks[KEY].steps_total == 1
    assert any("step state unreadable" in r.getMessage() for r in caplog.records)


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
