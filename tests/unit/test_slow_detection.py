"""Slow-rank detection replayed on synthetic jobs (`slownode.md` §9, targets 1 and 4 in the agent)."""

from __future__ import annotations

from agent.steps.detect import COMPUTE, IO, NODE_HOST, NODE_RANKS, TEMPORAL, SlowRankDetector
from agent.steps.records import RankKey
from agent.steps.pairing import StepSample
from agent.demo.synthetic import RankTiming, SyntheticJob

JOB = "job-uid-1"


class Replay:
    """Feeds a job's steps to a detector as they would come from the records, one wall second apart."""

    def __init__(self, job: SyntheticJob, detector: SlowRankDetector | None = None, pid_base: int = 1000):
        self.job, self.detector, self.pid_base = job, detector or SlowRankDetector(), pid_base
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

    def feed(self, number: int, t: RankTiming, wall_end: float | None = None) -> None:
        end = wall_end if wall_end is not None else self.wall
        sample = StepSample(number, self.pid_base + t.rank, "device", 0, round(t.duration_s * 1e9), end,
                            t.forward_s, t.dataloader_s, t.checkpoint_s)
        state = self.detector.observe(RankKey(JOB, t.rank), str(self.job.stage_of(t.rank)), sample)
        for reason, slow in state.slow.items():
            if slow:
                self.first_flag.setdefault((t.rank, reason), number)

    def flagged(self, reason: str) -> dict[int, int]:
        return {rank: step for (rank, r), step in self.first_flag.items() if r == reason}


def test_ten_thousand_clean_steps_of_64_ranks_raise_nothing_and_one_slow_rank_is_found_by_step_2003():
    clean = Replay(SyntheticJob(ranks=64, stages=8, forward_share=0.9, checkpoint_every=500, seed=11))
    clean.run(1, 10_000)
    assert clean.first_flag == {}
    baselines = {s.baseline for s in clean.detector.ranks.values()}
    assert all(0.95 < b < 1.1 for b in baselines)

    # Rank 13's forward 15 % slower from step 2000 (a checkpoint step, so 2001 is the first eligible one).
    slow = Replay(SyntheticJob(ranks=64, stages=8, forward_share=0.9, checkpoint_every=500, seed=11,
                               slow_rank=13, slow_from_step=2000))
    slow.run(1, 2010)
    assert slow.flagged(COMPUTE) == {13: slow.flagged(COMPUTE)[13]} and slow.flagged(COMPUTE)[13] <= 2003
    assert set(slow.flagged(TEMPORAL)) == set(range(64))  # every rank waits for it
    assert max(slow.flagged(TEMPORAL).values()) <= 2006
    assert min(slow.flagged(TEMPORAL).values()) >= 2001 and slow.flagged(IO) == {}
    state = slow.detector.ranks[RankKey(JOB, 13)]
    assert state.detections == {COMPUTE: 1, TEMPORAL: 1} and state.ratio > 1.10
    assert slow.detector.node_verdict(JOB) == {NODE_RANKS: True, NODE_HOST: False}


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


def test_two_or_three_peers_use_the_ratio_to_the_fastest():
    replay = Replay(SyntheticJob(ranks=3, stages=1, checkpoint_every=0, slow_rank=1, slow_from_step=100,
                                 slow_factor=1.2, seed=9))
    replay.run(1, 110)
    assert replay.flagged(COMPUTE) == {1: 102}


def test_a_whole_stage_slowing_is_not_a_straggler():
    # Two of eight peers slower: more than max(1, 5 %) qualify, a change of workload, not one rank.
    job = SyntheticJob(ranks=8, stages=1, checkpoint_every=0, seed=10)
    replay = Replay(job)
    two = lambda n, t: t if t.rank not in (2, 6) or n < 100 else RankTiming(  # noqa: E731
        t.rank, t.duration_s, t.forward_s * 1.3, t.dataloader_s, 0.0)
    replay.run(1, 150, two)
    assert replay.flagged(COMPUTE) == {}


def test_the_node_is_host_slow_when_every_rank_slows_outside_its_forward():
    replay = Replay(SyntheticJob(ranks=4, stages=1, checkpoint_every=0, seed=12))
    replay.run(1, 100)
    host = lambda n, t: RankTiming(t.rank, t.duration_s + 0.25, t.forward_s, t.dataloader_s, 0.0)  # noqa: E731
    replay.run(101, 110, host)
    assert replay.detector.node_verdict(JOB) == {NODE_RANKS: True, NODE_HOST: True}
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
