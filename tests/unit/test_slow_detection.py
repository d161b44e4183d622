"""Slow-worker detection on one node, replayed on synthetic jobs (agent.steps.detect, agent.steps.evidence).

The jobs' steps go to the detector as the consumer hands them (per rank, then `settle` at the end of
a batch); the cross-node half is judged by the chart's rules in tests/integration/test_stragglers.py.
"""

from __future__ import annotations

import random
import time

import pytest

from agent.demo.synthetic import RankTiming, SyntheticJob
from agent.steps import evidence
from agent.steps.consumer import pipeline_stage, tensor_group
from agent.steps.detect import COMPUTE, IO, NODE_HOST, NODE_RANKS, TEMPORAL, SlowRankDetector
from agent.steps.pairing import StepSample
from agent.steps.records import RankKey
from testkit.training import SlowWorker, TrainingJob

JOB = "job-uid-1"


class Replay:
    """Feeds a job's steps to a detector as they would come from the records, settling every `batch` steps."""

    def __init__(self, job: SyntheticJob, detector: SlowRankDetector | None = None, pid_base: int = 1000,
                 batch: int = 1):
        self.job, self.detector, self.pid_base, self.batch = job, detector or SlowRankDetector(), pid_base, batch
        self.first_flag: dict[tuple[int, str], int] = {}
        self.wall = 1_800_000_000.0

    def run(self, first: int, last: int, timing=None) -> None:
        for number in range(first, last + 1):
            timings = self.job.step(number)
            if timing is not None:
                timings = [timing(number, t) for t in timings]
            self.wall += max(t.duration_s for t in timings)
            for t in timings:
                self.feed(number, t)
            if number % self.batch == 0 or number == last:
                self.settle(number)

    def feed(self, number: int, t: RankTiming, wall_end: float | None = None) -> None:
        end = wall_end if wall_end is not None else self.wall
        sample = StepSample(number, self.pid_base + t.rank, "device", 0, round(t.duration_s * 1e9), end,
                            t.forward_s, t.dataloader_s, t.checkpoint_s)
        self.detector.observe(RankKey(JOB, t.rank), sample, str(self.job.stage_of(t.rank)))

    def settle(self, number: int) -> None:
        self.detector.settle(JOB)
        for key, state in self.detector.ranks.items():
            for reason, slow in state.slow.items():
                if slow:
                    self.first_flag.setdefault((key.rank, reason), number)

    def flagged(self, reason: str) -> dict[int, int]:
        return {rank: step for (rank, r), step in self.first_flag.items() if r == reason}


def layout_replay(job: TrainingJob, steps: range, *, groups: bool = True, order=None,
                  detector: SlowRankDetector | None = None, settle: bool = True) -> SlowRankDetector:
    """A testkit job's true timings, every rank on one node; `order` shuffles the ranks of each step."""
    detector = detector or SlowRankDetector()
    layout = job.layout
    # Each rank's stage and tensor group, from its parallel_group.json (the same at every step).
    places = {}
    for rank in range(layout.ranks):
        group = layout.parallel_group(rank) if groups else {}
        places[rank] = (pipeline_stage(group, rank) if groups else "", tensor_group(group, rank))
    for number in steps:
        timing = job.timings(number)
        end = job.step_start(number) + timing.duration
        ranks = list(range(layout.ranks))
        if order is not None:
            order.shuffle(ranks)
        for rank in ranks:
            sample = StepSample(number, 40_000 + rank, "device", 0, round(timing.rank_duration[rank] * 1e9), end,
                                timing.forward[rank], timing.dataloader[rank], 0.0)
            detector.observe(RankKey(job.job_id, rank), sample, *places[rank])
        if settle:
            detector.settle(job.job_id)
    return detector


def compute_flags(detector: SlowRankDetector, job_id: str) -> set[int]:
    return {k.rank for k, s in detector.ranks.items() if k.job_id == job_id and s.slow[COMPUTE]}


def test_a_slow_tensor_parallel_group_is_one_slow_worker_and_no_one_else():
    # The published job: dp4 pp4 tp4, one TP group of stage 0 (ranks 4-7) 2.5x from the first step.
    # 16 of a node's... here all 64 ranks on one node: the stage has 4 workers, one slow.
    job = TrainingJob(tp=4, dp=4, pp=4, seed=1, steps=40, step_s=23.5, forward_s=7.0, slow=(SlowWorker(4, 2.5),))
    detector = layout_replay(job, range(1, 29))
    workers = detector.workers[job.job_id]
    assert sorted(int(w) for w in workers) == list(range(0, 64, 4))
    assert workers["4"].ranks == (4, 5, 6, 7) and workers["4"].stage == "0"
    assert [w.name for w in workers.values() if w.slow] == ["4"]
    assert compute_flags(detector, job.job_id) == {4, 5, 6, 7}
    proof = workers["4"].evidence
    assert proof.window == 8 and 1.4 < proof.excess < 1.6 and proof.z > 50
    # The 20 warm-up steps and a full window of 8: found at the 8th judged step, not before.
    early = layout_replay(job, range(1, 28))
    assert compute_flags(early, job.job_id) == set()


def test_without_parallel_group_tp_groups_are_found_from_their_compute():
    job = TrainingJob(tp=4, dp=8, pp=1, seed=2, steps=60, slow=(SlowWorker(4, 1.2, from_step=30),))
    detector = layout_replay(job, range(1, 41), groups=False)
    workers = detector.workers[job.job_id]
    assert {w.ranks for w in workers.values()} == {tuple(range(w, w + 4)) for w in range(0, 32, 4)}
    assert [w.name for w in workers.values() if w.slow] == ["4"]
    # Data-parallel peers with 1 % noise do not move together: each rank is a worker of its own.
    alone = layout_replay(TrainingJob(tp=1, dp=8, pp=1, seed=3, steps=40), range(1, 41), groups=False)
    assert {w.ranks for w in alone.workers["job-3"].values()} == {(r,) for r in range(8)}


def test_no_cap_on_how_many_workers_of_a_node_are_slow():
    # Both workers of stage 0 on this node slow (a slow node), two healthy: the 0.25 quantile is a
    # healthy one, and both are flagged. The old rule allowed max(1, 5 %) of the peers.
    job = TrainingJob(tp=2, dp=4, pp=1, seed=4, steps=40, slow=(SlowWorker(0, 1.15), SlowWorker(2, 1.15)))
    detector = layout_replay(job, range(1, 33))
    assert compute_flags(detector, job.job_id) == {0, 1, 2, 3}


def test_stage_imbalance_is_not_a_slow_worker_when_the_stages_are_known():
    job = TrainingJob(tp=1, dp=2, pp=4, seed=5, steps=80, stage_factors=(1, 1, 1, 2.07))
    detector = layout_replay(job, range(1, 81))
    assert compute_flags(detector, job.job_id) == set()
    # Without parallel_group.json the stages are one peer set: 2 of 8 workers (a quarter) are as
    # many as a stage and stay unflagged; one slow worker in 8 is still found.
    blind = layout_replay(job, range(1, 81), groups=False)
    assert compute_flags(blind, job.job_id) == set()
    one = TrainingJob(tp=1, dp=8, pp=1, seed=6, steps=80, slow=(SlowWorker(3, 1.3),))
    assert compute_flags(layout_replay(one, range(1, 41), groups=False), one.job_id) == {3}


def test_random_sequence_length_imbalance_blames_no_one_in_any_order():
    """Slow by design (1 to 2 s a replay, and there are two): 200 steps of 64 ranks judge the 128-step
    window some 50 times (it is full only after the 20 warm-up steps and 128 more), and the second
    replay, in another order, must reach the same verdicts."""
    job = TrainingJob(tp=2, dp=16, pp=2, seed=7, steps=200, seq_imbalance=True, step_s=9.07, forward_s=3.0)
    verdicts = []
    for seed in (1, 2):
        detector = layout_replay(job, range(1, 201), order=random.Random(seed))
        assert compute_flags(detector, job.job_id) == set()
        verdicts.append({n: (w.windows, w.evidence) for n, w in detector.workers[job.job_id].items()})
    assert verdicts[0] == verdicts[1]  # the order the records came in changes nothing


def test_the_evidence_is_the_median_of_each_window_against_the_stages_lower_quartile():
    quiet = [1.0 + 0.001 * (i % 3) for i in range(128)]
    slow = quiet[:120] + [1.10] * 8
    windows = {"a": evidence.windows(quiet), "b": evidence.windows(quiet), "c": evidence.windows(slow)}
    assert set(windows["a"]) == {8, 32, 128}
    assert windows["c"][8].median == pytest.approx(1.10)
    found = evidence.judge(windows)
    assert found["c"].window == 8 and found["c"].excess == pytest.approx(0.10, abs=0.002) and found["c"].holds
    assert not found["a"].holds and not found["b"].holds
    assert evidence.windows([1.0] * 7) == {}  # a window is judged full only
    assert evidence.judge({"only": evidence.windows(quiet)}) == {}  # a worker without peers has no reference


def test_clean_steps_raise_nothing_and_a_slow_rank_is_found_within_five_slow_steps():
    """Slow by design (1 to 2 s): 2,000 clean steps of 32 ranks, checkpoints among them, are the stretch
    in which nothing may be flagged before the slowdown begins."""
    # Rank 13's forward 15 % slower from step 2000 (a checkpoint step, so 2001 is the first eligible one).
    slow = Replay(SyntheticJob(ranks=32, stages=8, forward_share=0.9, checkpoint_every=500, seed=11,
                               slow_rank=13, slow_from_step=2000), batch=20)
    slow.run(1, 1999)
    assert slow.first_flag == {}
    slow.batch = 1
    slow.run(2000, 2010)
    assert list(slow.flagged(COMPUTE)) == [13] and slow.flagged(COMPUTE)[13] <= 2005
    assert set(slow.flagged(TEMPORAL)) == set(range(32))  # every rank waits for it
    assert max(slow.flagged(TEMPORAL).values()) <= 2006 and slow.flagged(IO) == {}
    state = slow.detector.ranks[RankKey(JOB, 13)]
    assert state.detections == {COMPUTE: 1, TEMPORAL: 1} and state.ratio > 1.10
    assert slow.detector.node_verdict(JOB) == {NODE_RANKS: False, NODE_HOST: False}  # 1 of 32 ranks


def test_a_slowdown_under_the_alarm_is_never_absorbed_into_the_baseline():
    # 8 % slower from step 300: no alarm, and not taken in by the re-baselining (> 5 %), so 4 % more
    # later still raises. FD-OL's running mean would have crept up to the slow speed instead.
    replay = Replay(SyntheticJob(ranks=4, stages=1, checkpoint_every=0, seed=3))

    def slower(factor, since):
        return lambda n, t: t if n < since else RankTiming(t.rank, t.duration_s * factor, t.forward_s * factor,
                                                            t.dataloader_s, 0.0)
    replay.run(1, 299)
    replay.run(300, 2000, slower(1.08, 300))
    assert replay.first_flag == {}
    assert all(abs(s.baseline - 1.0) < 0.02 for s in replay.detector.ranks.values())
    replay.run(2001, 2010, slower(1.12, 2001))
    assert set(replay.flagged(TEMPORAL)) == {0, 1, 2, 3}


def test_small_steady_changes_are_followed_by_the_baseline():
    replay = Replay(SyntheticJob(ranks=2, stages=1, checkpoint_every=0, seed=4))
    replay.run(1, 600)
    faster = lambda n, t: RankTiming(t.rank, t.duration_s * 0.97, t.forward_s * 0.97, t.dataloader_s, 0.0)  # noqa: E731
    replay.run(601, 1400, faster)
    assert all(abs(s.baseline - 0.97) < 0.01 for s in replay.detector.ranks.values())


def test_an_alarm_clears_after_ten_normal_steps_and_counts_one_detection():
    replay = Replay(SyntheticJob(ranks=2, stages=1, checkpoint_every=0, seed=5))
    replay.run(1, 100)
    replay.run(101, 110, lambda n, t: RankTiming(t.rank, t.duration_s * 1.3, t.forward_s, t.dataloader_s, 0.0))
    state = replay.detector.ranks[RankKey(JOB, 0)]
    assert state.slow[TEMPORAL] and replay.flagged(TEMPORAL)[0] == 104
    replay.run(111, 121)
    assert state.slow[TEMPORAL]  # m5 is back from step 113 (3 of 5 normal), then 10 in a row under 1.05 B
    replay.run(122, 122)
    assert not state.slow[TEMPORAL] and state.detections[TEMPORAL] == 1


def test_dataloader_bound_steps_are_io_not_temporal():
    replay = Replay(SyntheticJob(ranks=2, stages=1, checkpoint_every=0, seed=6))
    replay.run(1, 100)
    stalled = lambda n, t: RankTiming(t.rank, t.duration_s + 2.0, t.forward_s, t.dataloader_s + 2.0, 0.0)  # noqa: E731
    replay.run(101, 110, stalled)
    assert replay.flagged(IO) == {0: 103, 1: 103} and replay.flagged(TEMPORAL) == {}
    assert replay.detector.node_verdict(JOB)[NODE_RANKS]  # every rank of the node: io
    replay.run(111, 115)
    assert not any(s.slow[IO] for s in replay.detector.ranks.values())


def test_warm_up_after_a_new_process_and_after_a_pause():
    job = SyntheticJob(ranks=2, stages=1, checkpoint_every=0, seed=7)
    replay = Replay(job)
    replay.run(1, 100)
    # The job restarts (new pids) 40 % slower: a different process is learnt again, no alarm.
    replay.pid_base = 5000
    slower = lambda n, t: RankTiming(t.rank, t.duration_s * 1.4, t.forward_s * 1.4, t.dataloader_s, 0.0)  # noqa: E731
    replay.run(1, 100, slower)
    assert replay.first_flag == {}
    state = replay.detector.ranks[RankKey(JOB, 0)]
    assert abs(state.baseline - 1.4) < 0.03
    # After a pause of more than 60 s the first 20 steps are warm-up, however slow.
    replay.wall += 120
    replay.run(101, 120, lambda n, t: RankTiming(t.rank, t.duration_s * 2, t.forward_s, t.dataloader_s, 0.0))
    assert replay.first_flag == {}


def test_checkpoint_steps_are_not_eligible():
    replay = Replay(SyntheticJob(ranks=2, stages=1, checkpoint_every=3, checkpoint_s=30.0, seed=8))
    replay.run(1, 300)
    assert replay.first_flag == {}


def test_with_two_workers_the_slower_is_judged_against_the_faster():
    replay = Replay(SyntheticJob(ranks=2, stages=1, checkpoint_every=0, slow_rank=1, slow_from_step=100,
                                 slow_factor=1.2, seed=9))
    replay.run(1, 110)
    assert replay.flagged(COMPUTE) == {1: 103}  # 4 slow steps of 8: the median is halfway, 7.5 % over the quartile


def test_the_node_is_host_slow_when_every_rank_slows_outside_its_forward():
    replay = Replay(SyntheticJob(ranks=4, stages=1, checkpoint_every=0, seed=12))
    replay.run(1, 100)
    host = lambda n, t: RankTiming(t.rank, t.duration_s + 0.25, t.forward_s, t.dataloader_s, 0.0)  # noqa: E731
    replay.run(101, 110, host)
    assert replay.detector.node_verdict(JOB) == {NODE_RANKS: False, NODE_HOST: True}
    assert replay.flagged(COMPUTE) == {}
    assert replay.detector.node_verdict("another-job") == {NODE_RANKS: False, NODE_HOST: False}


def test_restored_baselines_judge_at_once_for_the_same_process_only():
    replay = Replay(SyntheticJob(ranks=2, stages=1, checkpoint_every=0, seed=13))
    replay.run(1, 100)
    saved = {key: replay.detector.snapshot(key) for key in replay.detector.ranks}
    assert all(s is not None and abs(s["baseline"] - 1.0) < 0.02 for s in saved.values())

    # The agent restarts; training goes on, 30 % slower: no warm-up, no learning; flagged once m5 has
    # its five steps and two evaluations agree (FD-OL would learn the slow speed as its baseline).
    after = Replay(replay.job, SlowRankDetector())
    for key, snapshot in saved.items():
        after.detector.restore(key, snapshot)
    after.run(101, 106, lambda n, t: RankTiming(t.rank, t.duration_s * 1.3, t.forward_s, t.dataloader_s, 0.0))
    assert after.flagged(TEMPORAL) == {0: 106, 1: 106}

    # A new training process (other pids) does not inherit them: it warms up and learns again.
    fresh = Replay(replay.job, SlowRankDetector(), pid_base=9000)
    for key, snapshot in saved.items():
        fresh.detector.restore(key, snapshot)
    fresh.run(101, 110, lambda n, t: RankTiming(t.rank, t.duration_s * 1.3, t.forward_s, t.dataloader_s, 0.0))
    assert fresh.first_flag == {} and all(s.baseline is None for s in fresh.detector.ranks.values())


def test_tp_groups_are_found_among_as_many_ranks_as_a_node_holds_and_no_more():
    # 64 ranks of one stage on a node (more than any node's NPUs): TP groups found. 1,024 rank
    # directories (a broken or hostile job): comparing every pair would take a minute of the
    # event loop at each batch; each rank is a worker of its own instead.
    job = TrainingJob(tp=4, dp=16, pp=1, seed=8, steps=40)
    workers = layout_replay(job, range(1, 37), groups=False).workers[job.job_id]
    assert len(workers) == 16 and all(len(w.ranks) == 4 for w in workers.values())
    crowd = TrainingJob(tp=4, dp=256, pp=1, seed=8, steps=40)
    detector = layout_replay(crowd, range(1, 37), groups=False, settle=False)
    started = time.process_time()
    workers = detector.settle(crowd.job_id)
    assert time.process_time() - started < 2.0
    assert len(workers) == 1024
