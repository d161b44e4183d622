"""Slow-worker detection on a node's step samples (pure).

Temporal, per rank: a robust baseline B (median of the first 50 eligible steps) with S = 1.4826 MAD;
m5 = median of the last 5 eligible steps; slow when m5 >= 1.10 B and m5 >= B + 4 S on 2 evaluations
in a row, cleared when m5 < 1.05 B for 10 steps. B moves only every 500 eligible steps, to the median
of the last 200, and only while no alarm is up and by less than 5 %: a slowdown cannot creep into
the baseline (FD-OL updates its mean with every sub-threshold step). In a synchronous job every rank
waits for the slowest, so this says that the job slowed, not who: it feeds the job-level signals.

Compute, per worker (agent.steps.evidence): a worker is one tensor-parallel group, from the `tp`
group of `parallel_group.json`; without one, local ranks of a stage whose per-step compute agrees
within 0.5 % on 90 % of at least 8 common steps are taken for one (TP ranks wait for each other
inside every layer; data-parallel peers do not). The worker's compute at a step is the median of its
ranks' summed forward ranges. `settle` judges the workers of a job on this node against their stage
peers here, with no cap on how many may be slow (a whole slow node is the common case with TP = 8);
peers on other nodes are compared by the chart's Prometheus rules, over the windows this exports.
Where no pipeline stage is known (no `parallel_group.json`) a stage imbalance would look like slow
workers, so there the flagged workers must be fewer than a quarter of the job's.

Eligible steps: not in the first 20 steps of a process or after a pause of more than 60 s, no
checkpoint overlapping, dataloader at most half the step. Steps dominated by the dataloader are
`reason="io"` instead (3 of the last 5 raise it, none of the last 5 clears it).

Node verdict per job: `ranks` when at least half of its local ranks are in slow workers (compute or
io); `host` when all of them are temporally slow while none computes slower (forward m5 < 1.05 of
its own baseline) and the rest of the step (step - forward) grew by 20 % or more.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

from agent.steps import evidence
from agent.steps.evidence import Evidence, Window, median as _median
from agent.steps.pairing import StepSample
from agent.steps.reasons import COMPUTE, IO, SLOW, TEMPORAL
from agent.steps.records import RankKey

NODE_RANKS, NODE_HOST = "ranks", "host"
RECENT = 5  # m5: the last 5 eligible steps
_VERSIONS = itertools.count(1)  # unique over all ranks, so a new rank's windows never pass for an old one's
UNKNOWN_LAYOUT_SHARE = 0.25  # without stages, flagged workers must be fewer than this share of the job's


@dataclass(frozen=True)
class DetectorConfig:
    warmup_steps: int = 20
    pause_s: float = 60.0
    baseline_steps: int = 50
    raise_ratio: float = 1.10
    raise_sigmas: float = 4.0
    raise_evaluations: int = 2
    clear_ratio: float = 1.05
    clear_steps: int = 10
    rebaseline_every: int = 500
    rebaseline_window: int = 200
    rebaseline_max_change: float = 0.05
    io_share: float = 0.5
    io_raise: int = 3
    group_steps: int = 16  # the recent steps two ranks are compared on to find a TP group
    group_min_common: int = 8
    group_tolerance: float = 0.005
    group_agree: float = 0.9
    group_max_ranks: int = 64  # of a stage on this node: the pairs compared grow with its square
    node_share: float = 0.5
    host_compute_ratio: float = 1.05
    host_rest_rise: float = 1.20


@dataclass
class RankState:
    """What the detector knows of one rank; the metrics read it."""

    stage: str = ""
    tp_group: tuple[int, ...] | None = None  # global ranks of its TP group, from parallel_group.json
    pid: int | None = None
    warmup_left: int = 0
    last_end_s: float | None = None
    baseline: float | None = None  # B, seconds
    sigma: float = 0.0  # S
    compute_baseline: float | None = None
    rest_baseline: float | None = None  # step - forward
    ratio: float | None = None  # m5 / B
    compute: float | None = None  # median forward of the last 5 eligible steps
    slow: dict = field(default_factory=lambda: dict.fromkeys(SLOW, False))
    detections: Counter = field(default_factory=Counter)  # rising edges per reason
    forwards: deque = field(default_factory=lambda: deque(maxlen=evidence.SPREAD_STEPS))  # (step, forward)
    version: int = 0  # a new number whenever `forwards` changes: a worker's windows are built again only then
    _learning: list = field(default_factory=list)  # (duration, forward, rest) of the first eligible steps
    _durations: deque = field(default_factory=deque)  # the last rebaseline_window eligible steps
    _recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    _forwards: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    _rests: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    _io: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    _over: int = 0
    _under: int = 0
    _since_rebaseline: int = 0

    def _set(self, reason: str, value: bool) -> None:
        if value and not self.slow[reason]:
            self.detections[reason] += 1
        self.slow[reason] = value

    @property
    def typical_step_s(self) -> float | None:
        """Its usual step time: the baseline, else the median of its recent steps."""
        if self.baseline is not None:
            return self.baseline
        return _median(self._recent) if self._recent else None


@dataclass
class WorkerState:
    """One worker (TP group) of a job as this node sees it: its local ranks and its evidence."""

    stage: str
    name: str  # the first global rank of its TP group (inferred groups: of its local ranks)
    ranks: tuple[int, ...]
    windows: dict[int, Window] = field(default_factory=dict)
    evidence: Evidence | None = None  # against the stage's workers on this node
    slow: bool = False  # compute, judged here


class SlowRankDetector:
    def __init__(self, config: DetectorConfig = DetectorConfig()):
        self.config = config
        self.ranks: dict[RankKey, RankState] = {}
        self.workers: dict[str, dict[str, WorkerState]] = {}  # job -> worker name -> its state
        self._windows: dict[str, dict[tuple, tuple]] = {}  # job -> worker's ranks -> (their versions, windows)
        self._saved: dict[RankKey, dict] = {}  # baselines of an earlier run, until the rank's first step

    def snapshot(self, key: RankKey) -> dict | None:
        """What a restart needs to go on judging the rank without learning it again."""
        state = self.ranks.get(key)
        if state is None or state.baseline is None:
            return None
        return {"pid": state.pid, "baseline": state.baseline, "sigma": state.sigma,
                "compute_baseline": state.compute_baseline, "rest_baseline": state.rest_baseline}

    def restore(self, key: RankKey, saved: dict) -> None:
        """Use `snapshot`'s baselines if the rank's next step comes from the same process."""
        self._saved[key] = saved

    def forget(self, keys: list[RankKey]) -> None:
        """Drop ranks, and judge their jobs' workers again once (an ended job's ranks go together)."""
        for job_id in {key.job_id for key in keys if self.ranks.pop(key, None) is not None}:
            self.settle(job_id)

    def observe(self, key: RankKey, sample: StepSample, stage: str = "",
                tp_group: tuple[int, ...] | None = None) -> RankState:
        cfg = self.config
        state = self.ranks.get(key)
        start_s = sample.wall_end_s - sample.duration_s
        if state is None or state.pid != sample.pid:  # a new training process may run differently: learn again
            state = self.ranks[key] = RankState(pid=sample.pid, warmup_left=cfg.warmup_steps)
            state._durations = deque(maxlen=cfg.rebaseline_window)
            saved = self._saved.pop(key, None)
            if saved is not None and saved.get("pid") == sample.pid:  # the agent restarted, training did not
                state.baseline, state.sigma = saved["baseline"], saved["sigma"]
                state.compute_baseline, state.rest_baseline = saved["compute_baseline"], saved["rest_baseline"]
                state.warmup_left = 0
        if (stage, tp_group) != (state.stage, state.tp_group):  # parallel_group.json appeared or changed
            state.stage, state.tp_group = stage, tp_group
            state.forwards.clear()  # judged among other peers from now on
            state.version = next(_VERSIONS)
        if state.last_end_s is not None and start_s - state.last_end_s > cfg.pause_s:
            state.warmup_left = cfg.warmup_steps
        state.last_end_s = max(state.last_end_s or 0.0, sample.wall_end_s)
        if state.warmup_left > 0:
            state.warmup_left -= 1
            return state
        if sample.checkpoint or sample.duration_s <= 0:
            return state
        io_bound = sample.dataloader_s > cfg.io_share * sample.duration_s
        state._io.append(io_bound)
        if io_bound and sum(state._io) >= cfg.io_raise:
            state._set(IO, True)
        elif not any(state._io):
            state._set(IO, False)
        if io_bound:
            return state
        self._temporal(state, sample)
        if sample.forward_s is not None and sample.forward_s > 0:
            state.forwards.append((sample.step, sample.forward_s))
            state.version = next(_VERSIONS)
        return state

    def _temporal(self, state: RankState, sample: StepSample) -> None:
        cfg = self.config
        duration, forward = sample.duration_s, sample.forward_s
        rest = duration - forward if forward is not None else None
        state._durations.append(duration)
        state._recent.append(duration)
        if forward is not None:
            state._forwards.append(forward)
            state.compute = _median(state._forwards)
        if rest is not None:
            state._rests.append(rest)
        if state.baseline is None:
            state._learning.append((duration, forward, rest))
            if len(state._learning) < cfg.baseline_steps:
                return
            durations = [d for d, _, _ in state._learning]
            state.baseline, state.sigma = _median_and_sigma(durations)
            forwards = [f for _, f, _ in state._learning if f is not None]
            rests = [r for _, _, r in state._learning if r is not None]
            state.compute_baseline = _median(forwards) if forwards else None
            state.rest_baseline = _median(rests) if rests else None
            state._learning = []
            return
        if len(state._recent) < RECENT:
            return  # m5 is the median of five (only short after a restart with restored baselines)
        m5 = _median(state._recent)
        state.ratio = m5 / state.baseline
        if m5 >= cfg.raise_ratio * state.baseline and m5 >= state.baseline + cfg.raise_sigmas * state.sigma:
            state._over += 1
        else:
            state._over = 0
        state._under = state._under + 1 if m5 < cfg.clear_ratio * state.baseline else 0
        if state._over >= cfg.raise_evaluations:
            state._set(TEMPORAL, True)
        elif state.slow[TEMPORAL] and state._under >= cfg.clear_steps:
            state._set(TEMPORAL, False)
        state._since_rebaseline += 1
        if state._since_rebaseline >= cfg.rebaseline_every:
            state._since_rebaseline = 0
            window = list(state._durations)[-cfg.rebaseline_window:]
            candidate, sigma = _median_and_sigma(window)
            if not state.slow[TEMPORAL] and abs(candidate / state.baseline - 1) < cfg.rebaseline_max_change:
                state.baseline, state.sigma = candidate, sigma

    def settle(self, job_id: str) -> dict[str, WorkerState]:
        """Group the job's ranks on this node into workers, build their windows and judge each stage's
        workers against each other; the ranks' `compute` verdicts follow their worker's. After a
        batch of steps, not after each: a worker's steps come from several ranks' files."""
        members = {k: s for k, s in self.ranks.items() if k.job_id == job_id}
        workers: dict[str, WorkerState] = {}
        known, built = self._windows.get(job_id, {}), {}
        for stage, group in _by_stage(members).items():
            for ranks in self._groups(group):
                name = str(_worker_name(ranks, members))
                states = [members[k] for k in ranks]
                worker = WorkerState(stage, name, tuple(sorted(k.rank for k in ranks)))
                versions = tuple(s.version for s in states)
                cached = known.get(worker.ranks)
                if cached is None or cached[0] != versions:
                    cached = (versions, evidence.windows(_compute_series(states)))
                built[worker.ranks] = cached
                worker.windows = cached[1]
                workers[name] = worker
        for stage in {w.stage for w in workers.values()}:
            found = evidence.judge({w.name: w.windows for w in workers.values() if w.stage == stage})
            for name, proof in found.items():
                workers[name].evidence = proof
                workers[name].slow = proof.holds
        if "" in {w.stage for w in workers.values()} and \
                sum(w.slow for w in workers.values()) >= UNKNOWN_LAYOUT_SHARE * len(workers):
            for worker in workers.values():
                worker.slow = False  # as many as a stage would be: an imbalance of the layout, not stragglers
        for worker in workers.values():
            for rank in worker.ranks:
                members[RankKey(job_id, rank)]._set(COMPUTE, worker.slow)
        if workers:
            self.workers[job_id], self._windows[job_id] = workers, built
        else:
            self.workers.pop(job_id, None)
            self._windows.pop(job_id, None)
        return workers

    def _groups(self, ranks: dict[RankKey, RankState]) -> list[list[RankKey]]:
        """The ranks of one stage as workers: by their TP group where parallel_group.json gives one,
        else by agreeing per-step compute (among at most group_max_ranks)."""
        cfg = self.config
        known: dict[tuple, list[RankKey]] = {}
        loose = []
        for key, state in sorted(ranks.items(), key=lambda kv: kv[0].rank):
            if state.tp_group:
                known.setdefault(state.tp_group, []).append(key)
            else:
                loose.append(key)
        parent = {key: key for key in loose}

        def root(key):
            while parent[key] != key:
                parent[key] = parent[parent[key]]
                key = parent[key]
            return key

        # Every pair is compared, so only among as many ranks as a node has NPUs (and some): more in
        # one stage of one job on a node is no real layout, and each of them is a worker of its own.
        recent = {k: dict(list(ranks[k].forwards)[-cfg.group_steps:]) for k in loose}
        for i, a in enumerate(loose if len(loose) <= cfg.group_max_ranks else ()):
            for b in loose[i + 1:]:
                if root(a) != root(b) and _agree(recent[a], recent[b], cfg):
                    parent[root(b)] = root(a)
        inferred: dict[RankKey, list[RankKey]] = {}
        for key in loose:
            inferred.setdefault(root(key), []).append(key)
        return [*known.values(), *inferred.values()]

    def node_verdict(self, job_id: str) -> dict[str, bool]:
        """Whether this node is slow for the job, by reason."""
        cfg = self.config
        states = [s for k, s in self.ranks.items() if k.job_id == job_id]
        if not states:
            return {NODE_RANKS: False, NODE_HOST: False}
        slow = sum(s.slow[COMPUTE] or s.slow[IO] for s in states)
        host = all(
            s.slow[TEMPORAL] and s.compute is not None and s.compute_baseline and s.rest_baseline
            and s.compute < cfg.host_compute_ratio * s.compute_baseline
            and _median(s._rests) >= cfg.host_rest_rise * s.rest_baseline
            for s in states)
        return {NODE_RANKS: slow >= cfg.node_share * len(states), NODE_HOST: host}


def _by_stage(ranks: dict[RankKey, RankState]) -> dict[str, dict[RankKey, RankState]]:
    out: dict[str, dict[RankKey, RankState]] = {}
    for key, state in ranks.items():
        out.setdefault(state.stage, {})[key] = state
    return out


def _worker_name(ranks: list[RankKey], states: dict[RankKey, RankState]) -> int:
    group = states[ranks[0]].tp_group
    return min(group) if group else min(k.rank for k in ranks)


def _agree(a: dict[int, float], b: dict[int, float], cfg: DetectorConfig) -> bool:
    common = a.keys() & b.keys()
    if len(common) < cfg.group_min_common:
        return False
    close = sum(abs(a[s] - b[s]) <= cfg.group_tolerance * (a[s] + b[s]) / 2 for s in common)
    return close >= cfg.group_agree * len(common)


def _compute_series(states: list[RankState]) -> list[float]:
    """The worker's compute per eligible step, oldest first: the median over its ranks at each step."""
    if len(states) == 1:
        return [f for _, f in states[0].forwards]
    by_step: dict[int, list[float]] = {}
    for state in states:
        for step, forward in state.forwards:
            by_step.setdefault(step, []).append(forward)
    return [_median(by_step[s]) for s in sorted(by_step)[-evidence.SPREAD_STEPS:]]


def _median_and_sigma(values: list[float]) -> tuple[float, float]:
    middle = _median(values)
    return middle, 1.4826 * _median([abs(v - middle) for v in values])
