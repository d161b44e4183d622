"""Slow-worker detection on realistic training jobs: recall, delay and false alerts, against FD-OL.

Run from the repository root:  .venv/bin/python -m bench.stragglers        # ~13 min on 2 cores

Jobs come from `testkit.training` (Megatron layouts, TaskD records, TaskD's 5 s writes). Each job
runs on nodes of its own, every node running the agent's real step pipeline (parser, pairing,
detector, collector) on a simulated clock, scraped every 10 s; the chart's Prometheus rules are
then evaluated on those scrapes every 10 s by the real `promtool test rules`, and the alerts that
fired are what is judged (testkit.training.cluster, testkit.training.promtool). Work is split
into chunks run two at a time.

Classes:
* **worker slowdowns** (`--injections` per class, default 100; the 10 % class gets that many per
  TP size): one worker (TP group) of a job computes `factor` x longer from step 1 or from a step
  after warm-up; TP 1-16, PP 1-8, DP 2-8, steps of 2.5-10 s, 1 % noise. Found = a
  TrainingWorkerStraggler alert naming that worker. Evidence = the worker's steps from its first
  judged slow step (its onset, or the first after the 20 warm-up steps) until the rules' arithmetic
  (agent.steps.evidence) holds on every worker's compute so far: the detector's delay. Read = its
  steps the agents had read when the alert fired; latency = the seconds from the end of the step
  that completed the evidence to the alert (TaskD's write, the scrape, the evaluation). An alert on
  any other worker is a false one. Apart, not
  judged against the goal: 20 % (`--injections`) and 10 % (half as many) slowdowns under
  sequence-length imbalance (tp2 dp4 pp2, 9.07 s steps).
* **sequence-length imbalance**: the published job's layout (dp32 dsp2 pp2: 128 ranks, a dsp pair
  moving together is a worker of 2), 9.07 s steps, every worker's compute multiplied per step by
  the published spread (p90 1.12x, p99 1.27x), nobody slow, for `--seq-hours` rank-hours in four
  runs: every worker alert is false; per 1,000 rank-hours.
* **stage imbalance**: dp2-4, pp 2-8, tp 1-8, the last stage 1.5-2.5x the others (the published
  job: 2.07x): every worker alert is false; the job's TrainingJobSlow{cause="stage"} should fire.
* **finished jobs**: every job above ends; no alert may begin after its last step, and the
  lag alert may never fire.
Baseline, same jobs, same run: the node-level rule of MindCluster's slow-node detection (FD-OL,
ascend-faultdiag-online in node mode, with its default knobs; its "degradation perception": per
rank, the trimmed mean of its first 20 step times, a step over 1.3x that mean is abnormal, slow
after 3 abnormal in a row ending with the latest; normal steps update the mean), run on every
rank's step times; a node is slow when one of its ranks is. It needs communication markers to say which rank
(stage B), so its verdict is the node: found = the slow worker's node flagged, false = any other
node flagged.

Prints a table per class, the ratio against FD-OL, then PASS/FAIL against the goals: recall >=
99 % for >= 10 % at every TP size with evidence within 10 steps (p99); 0 worker alerts under stage imbalance; <= 1 false alert
per 1,000 rank-hours under sequence-length imbalance; no alert from a finished job.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from agent.steps import evidence
from bench.stats import percentile
from testkit.training import SlowWorker, TrainingJob
from testkit.training.cluster import Cluster
from testkit.training.promtool import PROMTOOL, Recording, fired

WARMUP = 20  # agent.steps.detect.DetectorConfig.warmup_steps
TAIL_S = 90.0  # simulated after the last job of a chunk ends: alerts that outlive a job show
LAYOUTS = {  # tp -> (dp, pp) choices: DP >= 2 (a worker needs a peer), PP 1-8
    1: ((4, 2), (8, 1), (4, 4), (2, 8)),
    2: ((4, 1), (4, 2), (2, 4), (8, 2)),
    4: ((2, 2), (4, 1), (2, 4), (4, 2)),
    8: ((2, 1), (2, 2), (3, 1), (4, 2)),
    16: ((2, 1), (2, 2), (3, 1), (4, 1)),
}


@dataclass
class Case:
    kind: str  # "slow", "seq", "stage"
    job: dict  # TrainingJob's arguments
    factor: float = 1.0
    worker: int | None = None
    onset: int = 1


@dataclass
class Outcome:
    case: Case
    ranks: int
    rank_hours: float
    end_s: float  # the job's last step end, seconds into its run
    alerts: list = field(default_factory=list)  # (name, labels, first_s, last_s)
    found_s: float | None = None  # the first alert on the slow worker
    evidence_steps: int | None = None  # its judged steps until the evidence held
    read_steps: int | None = None  # its judged steps read by the agents when the alert fired
    latency_s: float | None = None  # from the end of the step that completed the evidence to the alert
    fdol_found_step: int | None = None  # FD-OL: steps after onset when the slow worker's node was flagged
    fdol_false_nodes: int = 0  # nodes FD-OL flagged that hold no slow worker
    fdol_nodes: int = 0


def cases(injections: int, seq_hours: float, seed: int) -> list[Case]:
    rng = random.Random(seed)
    out = []
    classes = [(1.10, None), (1.05, injections), (1.20, injections), (1.50, injections), (2.00, injections)]
    for factor, count in classes:
        tps = [1, 2, 4, 8, 16]
        total = injections * len(tps) if count is None else count
        for index in range(total):
            tp = tps[index % len(tps)]
            dp, pp = rng.choice(LAYOUTS[tp])
            step_s = rng.choice((2.5, 5.0, 10.0))
            from_start = rng.random() < 0.5
            onset = 1 if from_start else rng.randint(WARMUP + 10, WARMUP + 40)
            worker = rng.randrange(dp * pp) * tp
            steps = max(onset, WARMUP) + 30
            out.append(Case("slow", dict(tp=tp, dp=dp, pp=pp, step_s=step_s, forward_s=0.4 * step_s, steps=steps,
                                         seed=rng.randrange(1 << 30)), factor, worker, onset))
    for factor, count in ((1.20, injections), (1.10, injections // 2)):
        for index in range(count):
            from_start = rng.random() < 0.5
            onset = 1 if from_start else rng.randint(WARMUP + 10, WARMUP + 40)
            steps = max(onset, WARMUP) + (140 if factor < 1.2 else 60)
            out.append(Case("seq-slow", dict(tp=2, dp=4, pp=2, step_s=9.07, forward_s=3.0, seq_imbalance=True,
                                             steps=steps, seed=rng.randrange(1 << 30)), factor,
                            rng.randrange(8) * 2, onset))
    seq_steps = int(seq_hours * 3600 / 9.07 / 4)
    for run in range(4):
        out.append(Case("seq", dict(tp=2, dp=32, pp=2, step_s=9.07, forward_s=3.0, seq_imbalance=True,
                                    steps=seq_steps, seed=rng.randrange(1 << 30))))
    for index in range(injections // 2):
        tp = rng.choice((1, 2, 4, 8))
        dp, pp = rng.choice((2, 3, 4)), rng.choice((2, 4, 8))
        heavy = round(rng.uniform(1.5, 2.5), 2)
        out.append(Case("stage", dict(tp=tp, dp=dp, pp=pp, step_s=2.17, forward_s=0.5, steps=400,
                                      stage_factors=(1.0,) * (pp - 1) + (heavy,), seed=rng.randrange(1 << 30)),
                        factor=heavy))
    return out


def make_job(case: Case, index: int) -> TrainingJob:
    slow = (SlowWorker(case.worker, case.factor, case.onset),) if case.kind in ("slow", "seq-slow") else ()
    return TrainingJob(job_id=f"{case.kind}-{index}", slow=slow, **case.job)


def run_chunk(chunk: list[tuple[int, Case]]) -> list[Outcome]:
    """One cluster of jobs, all starting together, and one promtool run over it."""
    workdir = Path(tempfile.mkdtemp(prefix="stragglers-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        jobs = [make_job(case, index) for index, case in chunk]
        cluster = Cluster(jobs, workdir)
        recording = Recording()
        ends = [job.last_wall for job in jobs]
        cluster.run(max(ends) + TAIL_S, recording.add)
        alerts = fired(recording, workdir / "promtool")
        outcomes = []
        for (index, case), job in zip(chunk, jobs):
            mine = [(a.name, a.labels, a.first_s, a.last_s) for a in alerts if a.labels.get("job_id") == job.job_id]
            outcome = Outcome(case, job.layout.ranks, job.layout.ranks * (job.last_wall - job.start_wall) / 3600,
                              job.last_wall - cluster.start, mine)
            judge(outcome, job, cluster.start)
            fdol(outcome, job)
            outcomes.append(outcome)
        return outcomes
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def judge(outcome: Outcome, job: TrainingJob, start: float) -> None:
    case = outcome.case
    if case.kind not in ("slow", "seq-slow"):
        return
    outcome.evidence_steps = _evidence_step(job, case)
    hits = [a for a in outcome.alerts if a[0] == "TrainingWorkerStraggler" and a[1].get("worker") == str(case.worker)]
    if not hits:
        return
    found = min(a[2] for a in hits)
    outcome.found_s = found
    outcome.read_steps = _read_until(job, case.worker, start + found) - _first_judged(case) + 1
    if outcome.evidence_steps is not None:
        step = _first_judged(case) + outcome.evidence_steps - 1
        outcome.latency_s = start + found - job.step_end(step)


def _first_judged(case: Case) -> int:
    return max(case.onset, WARMUP + 1)


def _evidence_step(job: TrainingJob, case: Case) -> int | None:
    """The detector's delay, free of when the records are written, scraped and evaluated: after how
    many of the slow worker's judged steps the evidence (agent.steps.evidence, the arithmetic the
    rules apply) holds on every worker's compute of the steps so far."""
    layout, series = job.layout, {w: [] for w in job.layout.workers}
    for step in range(1, job.steps + 1):
        compute = job.timings(step).compute
        if step <= WARMUP:
            continue
        for worker in series:
            series[worker].append(compute[worker])
        stage = {str(w): evidence.windows(v) for w, v in series.items() if layout.stage(w) == layout.stage(case.worker)}
        proof = evidence.judge(stage).get(str(case.worker))
        if proof is not None and proof.holds and step >= case.onset:
            return step - _first_judged(case) + 1
    return None


def _read_until(job: TrainingJob, worker: int, at: float) -> int:
    """The newest step of the worker whose end one of its ranks had written by `at` (TaskD writes
    every 5 s); the agents count a worker's step once one of its ranks has it."""
    newest = 0
    for rank in job.layout.members(worker):
        phase = job.start_wall + job.phases[rank]
        written = phase + math.floor((at - phase) / job.flush_s) * job.flush_s
        step = newest
        while step < job.steps and job.step_start(step + 1) + job.timings(step + 1).rank_duration[rank] < written:
            step += 1
        newest = step
    return newest


def fdol(outcome: Outcome, job: TrainingJob) -> None:
    """FD-OL's node-level degradation rule over every rank's step times (§4 stage A)."""
    layout, case = job.layout, outcome.case
    nodes = math.ceil(layout.ranks / layout.ranks_per_node)
    outcome.fdol_nodes = nodes
    rules = [_FdolRank() for _ in range(layout.ranks)]
    slow_nodes = {layout.node(r) for r in layout.members(case.worker)} if case.kind in ("slow", "seq-slow") else set()
    flagged: set[int] = set()
    for step in range(1, job.steps + 1):
        durations = job.timings(step).rank_duration
        for rank, rule in enumerate(rules):
            if rule.add(durations[rank]):
                node = layout.node(rank)
                if node in slow_nodes and outcome.fdol_found_step is None and step >= case.onset:
                    outcome.fdol_found_step = step - max(case.onset, WARMUP + 1) + 1
                flagged.add(node)
    outcome.fdol_false_nodes = len(flagged - slow_nodes)


class _FdolRank:
    """FirstNPointsShouldBeNormal: normalNumber 20, nConsec 3, degradationPercentage 0.3."""

    def __init__(self) -> None:
        self.points: list[float] = []
        self.mean = self.var = 0.0
        self.count = 0
        self.abnormal: list[int] = []

    def add(self, value: float) -> bool:
        self.points.append(value)
        n = len(self.points)
        if n == 20:
            ordered = sorted(self.points)[3:-3]
            self.count, self.mean = len(ordered), sum(ordered) / len(ordered)
            self.var = sum((v - self.mean) ** 2 for v in ordered) / len(ordered)
            return False
        if n < 20:
            return False
        if value > self.mean * 1.3:
            self.abnormal.append(n)
        else:
            self.count += 1  # Welford-style update of the mean with every normal point
            delta = value - self.mean
            self.mean += delta / self.count
            self.var += (delta * (value - self.mean) - self.var) / self.count
        last = self.abnormal[-3:]
        return len(self.abnormal) >= 3 and self.abnormal[-1] == n and last == list(range(n - 2, n + 1))


def chunks(items: list, size_ranks: int) -> list[list]:
    """Groups of jobs of about `size_ranks` ranks in all, long jobs alone."""
    out, current, weight = [], [], 0
    for item in items:
        case = item[1]
        ranks = case.job["tp"] * case.job["dp"] * case.job["pp"]
        cost = ranks * case.job["steps"] * max(1.0, case.job["step_s"] / 10)
        if current and weight + cost > size_ranks:
            out.append(current)
            current, weight = [], 0
        current.append(item)
        weight += cost
    if current:
        out.append(current)
    return out


def slow_table(rows_of: list[Outcome], goal: bool) -> bool:
    """Recall, delays and false alerts per class and TP size, FD-OL beside; whether the goal holds."""
    ok = True
    print(f"{'factor':>6} {'tp':>3} {'n':>4} {'recall':>7} {'evidence p50/p99/max':>21} {'read p99':>8} "
          f"{'latency p50/p99':>15} {'false':>5} | {'FD-OL recall':>12} {'delay p50':>9} {'innocent nodes':>14}")
    for factor in sorted({o.case.factor for o in rows_of}):
        group = [o for o in rows_of if o.case.factor == factor]
        for tp in [*sorted({o.case.job["tp"] for o in group}), None]:
            rows = [o for o in group if tp is None or o.case.job["tp"] == tp]
            if tp is None and len({o.case.job["tp"] for o in group}) == 1:
                continue
            found = [o for o in rows if o.found_s is not None]
            delays = [o.evidence_steps for o in found if o.evidence_steps is not None]
            false = sum(1 for o in rows for a in o.alerts
                        if a[0] == "TrainingWorkerStraggler" and a[1].get("worker") != str(o.case.worker))
            fd = [o for o in rows if o.fdol_found_step is not None]
            recall = len(found) / len(rows)
            print(f"{factor - 1:>6.0%} {'all' if tp is None else tp:>3} {len(rows):>4} {recall:>7.1%} "
                  f"{_triple(delays):>21} {_one([o.read_steps for o in found], 99):>8} "
                  f"{_pair([o.latency_s for o in found if o.latency_s is not None]):>15} {false:>5} | "
                  f"{len(fd) / len(rows):>12.1%} {_one([o.fdol_found_step for o in fd]):>9} "
                  f"{sum(o.fdol_false_nodes for o in rows):>6}/{sum(o.fdol_nodes for o in rows):<7}")
            if goal and factor >= 1.10 and tp is not None:  # every TP size, every class from 10 %
                ok &= recall >= 0.99 and bool(delays) and percentile(delays, 99) <= 10 and false == 0
    early = sum(1 for o in rows_of if o.read_steps is not None and o.evidence_steps is not None
                and o.read_steps < o.evidence_steps)
    print(f"(alerts before the evidence held by this arithmetic on the true compute: {early}; the agents' compute "
          f"is each TP group's median rank, and a node may have read a step more or less than its peers)")
    return ok


def report(outcomes: list[Outcome], elapsed: float) -> bool:
    print(f"\n{len(outcomes)} jobs, {sum(o.rank_hours for o in outcomes):,.0f} rank-hours simulated in {elapsed:.0f} s")
    print("evidence: the worker's judged steps until the rules' arithmetic held; read: its steps the agents had "
          "read when TrainingWorkerStraggler fired; latency: seconds from the end of the step that completed the "
          "evidence to the alert (TaskD's write, the scrape, the evaluation); FD-OL: its node rule, found = the "
          "slow worker's node flagged, innocent = other nodes flagged")
    print("\nworker slowdowns, 1 % noise (the goal):")
    slow = [o for o in outcomes if o.case.kind == "slow"]
    ok = slow_table(slow, goal=True)
    print("\nworker slowdowns under sequence-length imbalance (no goal: the noise sets how many steps it takes):")
    slow_table([o for o in outcomes if o.case.kind == "seq-slow"], goal=False)
    seq = [o for o in outcomes if o.case.kind == "seq"]
    hours = sum(o.rank_hours for o in seq)
    seq_false = sum(1 for o in seq for a in o.alerts if a[0] == "TrainingWorkerStraggler")
    seq_other = sorted({a[0] for o in seq for a in o.alerts})
    rate = seq_false / hours * 1000
    print(f"\nsequence-length imbalance, nobody slow: {hours:,.0f} rank-hours, {seq_false} worker alerts "
          f"({rate:.2f} per 1,000 rank-hours; target <= 1); other alerts: {', '.join(seq_other) or 'none'}; "
          f"FD-OL: {sum(o.fdol_false_nodes for o in seq)} node flags")
    ok &= rate <= 1
    stage = [o for o in outcomes if o.case.kind == "stage"]
    stage_false = sum(1 for o in stage for a in o.alerts if a[0] == "TrainingWorkerStraggler")
    quiet = [o for o in stage if not any(a[0] == "TrainingJobSlow" and a[1].get("cause") == "stage" for a in o.alerts)]
    print(f"stage imbalance: {len(stage)} jobs, {sum(o.rank_hours for o in stage):,.1f} rank-hours, "
          f"{stage_false} worker alerts (target 0); TrainingJobSlow{{cause=\"stage\"}} on "
          f"{len(stage) - len(quiet)}/{len(stage)} (not on: imbalance "
          f"{', '.join(f'{_imbalance(o):.2f}' for o in quiet) or '-'}, under its 1.25); "
          f"FD-OL: {sum(o.fdol_false_nodes for o in stage)} node flags")
    ok &= stage_false == 0
    late = [(o.case.kind, a[0]) for o in outcomes for a in o.alerts if a[2] > o.end_s]
    lag = sum(1 for o in outcomes for a in o.alerts if a[0] == "TrainingProfilingLagHigh")
    outlive = [a[3] - o.end_s for o in outcomes for a in o.alerts if a[3] > o.end_s]
    print(f"finished jobs: {len(outcomes)}; alerts begun after the job's last step: {len(late)} {late[:5]}; "
          f"lag alerts: {lag}; firing alerts resolved <= {max(outlive, default=0):.0f} s after the last step")
    ok &= not late and lag == 0
    ours = [o for o in slow if o.case.factor >= 1.10]
    found, fdol = sum(o.found_s is not None for o in ours), sum(o.fdol_found_step is not None for o in ours)
    innocent = sum(o.fdol_false_nodes for o in ours) / max(1, sum(o.fdol_nodes for o in ours))
    print(f"\nagainst FD-OL's node rule, same injections (>= 10 %): found {found}/{len(ours)} vs {fdol}/{len(ours)} "
          f"(ratio {found / max(1, fdol):.1f}x); innocent nodes flagged 0 vs {innocent:.0%}; "
          f"at 10 %: {sum(o.found_s is not None for o in ours if o.case.factor == 1.10)} vs "
          f"{sum(o.fdol_found_step is not None for o in ours if o.case.factor == 1.10)}")
    print(f"\n{'PASS' if ok else 'FAIL'}: recall >= 99 % with evidence within 10 steps for >= 10 % at every TP size, "
          f"0 worker alerts under stage imbalance, <= 1 false alert per 1,000 rank-hours under sequence-length "
          f"imbalance, no alert from a finished job")
    return ok


def _imbalance(outcome: Outcome) -> float:
    factors = outcome.case.job["stage_factors"]
    return max(factors) / (sum(factors) / len(factors))


def _triple(values: list) -> str:
    return "-" if not values else f"{percentile(values, 50)}/{percentile(values, 99)}/{max(values)}"


def _pair(values: list) -> str:
    return "-" if not values else f"{percentile(values, 50):.0f}/{percentile(values, 99):.0f}"


def _one(values: list, q: float = 50) -> str:
    return "-" if not values else f"{percentile(values, q)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.stragglers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--injections", type=int, default=100, help="injections per class (the 10 %% class: per TP size)")
    parser.add_argument("--seq-hours", type=float, default=1100.0, help="rank-hours of sequence-length imbalance")
    parser.add_argument("--seed", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--chunk", type=float, default=60_000, help="rank-steps of work per promtool run")
    args = parser.parse_args(argv)
    if PROMTOOL is None:
        print("promtool is not installed: apt-get install --no-install-recommends prometheus", file=sys.stderr)
        return 2
    started = time.monotonic()
    todo = list(enumerate(cases(args.injections, args.seq_hours / 128, args.seed)))
    work = chunks(todo, args.chunk)
    print(f"{len(todo)} jobs in {len(work)} chunks on {args.workers} processes", flush=True)
    outcomes: list[Outcome] = []
    with ProcessPoolExecutor(args.workers) as pool:
        for done, result in enumerate(pool.map(run_chunk, work), 1):
            outcomes += result
            print(f"  chunk {done}/{len(work)} done at {time.monotonic() - started:.0f} s", flush=True)
    report(outcomes, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
