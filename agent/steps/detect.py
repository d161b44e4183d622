"""Slow-rank detection on a node's step samples (pure; `slownode.md` §9).

Temporal, per rank: a robust baseline B (median of the first 50 eligible steps) with S = 1.4826 MAD;
m5 = median of the last 5 eligible steps; slow when m5 >= 1.10 B and m5 >= B + 4 S on 2 evaluations
in a row, cleared when m5 < 1.05 B for 10 steps. B moves only every 500 eligible steps, to the median
of the last 200, and only while no alarm is up and by less than 5 %: a slowdown cannot creep into
the baseline (FD-OL updates its mean with every sub-threshold step).

Spatial, per rank against its peers on this node (same job and pipeline stage): x = median forward
time of the rank's last 3 eligible steps; with 4 peers or more, slow when x >= 1.10 median and the
robust z (x - median) / s >= 3.5 (s = IQR / 1.349, at least 1 % of the median) on 2 evaluations
in a row, and at most max(1, 5 % of the peers) qualify (more is a change of the stage or the
workload, not a straggler); with 2 or 3 peers, slow when the fastest peer is <= 0.90 of it. The
window of 3 and 2 evaluations flag a rank on its third slow step. Cleared after 10 evaluations that
do not qualify. Cross-node peers are compared by Prometheus rules (helm/.../prometheus-rules.yaml).

Eligible steps: not in the first 20 steps of a process or after a pause of more than 60 s, no
checkpoint overlapping, dataloader at most half the step. Steps dominated by the dataloader are
`reason="io"` instead (3 of the last 5 raise it, none of the last 5 clears it).

Node verdict per job: `ranks` when at least half of its local ranks are slow for any reason;
`host` when all of them are temporally slow while none computes slower (forward m5 < 1.05 of its
own baseline) and the rest of the step (step - forward) grew by 20 % or more.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from agent.steps.records import RankKey
from agent.steps.pairing import StepSample
from agent.steps.reasons import COMPUTE, IO, SLOW, TEMPORAL

NODE_RANKS, NODE_HOST = "ranks", "host"
RECENT = 5  # m5: the last 5 eligible steps


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
    spatial_window: int = 3
    spatial_ratio: float = 1.10
    spatial_z: float = 3.5
    spatial_evaluations: int = 2
    spatial_floor: float = 0.01
    spatial_max_share: float = 0.05
    small_peers_score: float = 0.90
    node_share: float = 0.5
    host_compute_ratio: float = 1.05
    host_rest_rise: float = 1.20


@dataclass
class RankState:
    """What the detector knows of one rank; the metrics read it."""

    stage: str = ""
    pid: int | None = None
    warmup_left: int = 0
    last_end_s: float | None = None
    baseline: float | None = None  # B, seconds
    sigma: float = 0.0  # S
    compute_baseline: float | None = None
    rest_baseline: float | None = None  # step - forward
    ratio: float | None = None  # m5 / B
    compute: float | None = None  # median forward of the last 5 eligible steps
    spatial_x: float | None = None  # median forward of the last 3 eligible steps: what peers compare
    slow: dict = field(default_factory=lambda: dict.fromkeys(SLOW, False))
    detections: Counter = field(default_factory=Counter)  # rising edges per reason
    eligible_steps: int = 0
    _learning: list = field(default_factory=list)  # (duration, forward, rest) of the first eligible steps
    _durations: deque = field(default_factory=deque)  # the last rebaseline_window eligible steps
    _recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    _forwards: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    _rests: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    _io: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    _over: int = 0
    _under: int = 0
    _since_rebaseline: int = 0
    _spatial_over: int = 0
    _spatial_under: int = 0

    def _set(self, reason: str, value: bool) -> None:
        if value and not self.slow[reason]:
            self.detections[reason] += 1
        self.slow[reason] = value


class SlowRankDetector:
    def __init__(self, config: DetectorConfig = DetectorConfig()):
        self.config = config
        self.ranks: dict[RankKey, RankState] = {}
        self._peers: dict[tuple[str, str], dict[RankKey, RankState]] = {}  # (job, stage) -> its ranks
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

    def forget(self, key: RankKey) -> None:
        state = self.ranks.pop(key, None)
        if state is not None:
            self._peers.get((key.job_id, state.stage), {}).pop(key, None)

    def observe(self, key: RankKey, stage: str, sample: StepSample) -> RankState:
        cfg = self.config
        state = self.ranks.get(key)
        start_s = sample.wall_end_s - sample.duration_s
        if state is None or state.pid != sample.pid:  # a new training process may run differently: learn again
            self.forget(key)
            state = self.ranks[key] = RankState(stage=stage, pid=sample.pid, warmup_left=cfg.warmup_steps)
            state._durations = deque(maxlen=cfg.rebaseline_window)
            saved = self._saved.pop(key, None)
            if saved is not None and saved.get("pid") == sample.pid:  # the agent restarted, training did not
                state.baseline, state.sigma = saved["baseline"], saved["sigma"]
                state.compute_baseline, state.rest_baseline = saved["compute_baseline"], saved["rest_baseline"]
                state.warmup_left = 0
            self._peers.setdefault((key.job_id, stage), {})[key] = state
        elif state.stage != stage:  # parallel_group.json appeared or changed
            self._peers.get((key.job_id, state.stage), {}).pop(key, None)
            state.stage = stage
            self._peers.setdefault((key.job_id, stage), {})[key] = state
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
        self._spatial(key, state)
        return state

    def _temporal(self, state: RankState, sample: StepSample) -> None:
        cfg = self.config
        duration, forward = sample.duration_s, sample.forward_s
        rest = duration - forward if forward is not None else None
        state.eligible_steps += 1
        state._durations.append(duration)
        state._recent.append(duration)
        if forward is not None:
            state._forwards.append(forward)
            state.compute = _median(state._forwards)
            if len(state._forwards) >= cfg.spatial_window:
                state.spatial_x = _median(list(state._forwards)[-cfg.spatial_window:])
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

    def _spatial(self, key: RankKey, state: RankState) -> None:
        cfg = self.config
        if state.spatial_x is None:
            return
        peers = {k: s.spatial_x for k, s in self._peers[(key.job_id, state.stage)].items() if s.spatial_x is not None}
        if len(peers) < 2:
            return
        if len(peers) >= 4:
            values = sorted(peers.values())
            middle = _median(values, presorted=True)
            q25, q75 = _quantile(values, 0.25), _quantile(values, 0.75)
            spread = max((q75 - q25) / 1.349, cfg.spatial_floor * middle)
            floor = max(cfg.spatial_ratio * middle, middle + cfg.spatial_z * spread)
            qualifying = {k for k, x in peers.items() if x >= floor}
            allowed = max(1, int(cfg.spatial_max_share * len(peers)))
        else:
            fastest = min(peers.values())
            qualifying = {k for k, x in peers.items() if x > 0 and fastest / x <= cfg.small_peers_score}
            allowed = 1
        if key in qualifying and len(qualifying) <= allowed:
            state._spatial_over += 1
            state._spatial_under = 0
        else:
            state._spatial_over = 0
            state._spatial_under += 1
        if state._spatial_over >= cfg.spatial_evaluations:
            state._set(COMPUTE, True)
        elif state.slow[COMPUTE] and state._spatial_under >= cfg.clear_steps:
            state._set(COMPUTE, False)

    def node_verdict(self, job_id: str) -> dict[str, bool]:
        """Whether this node is slow for the job, by reason."""
        cfg = self.config
        states = [s for k, s in self.ranks.items() if k.job_id == job_id]
        if not states:
            return {NODE_RANKS: False, NODE_HOST: False}
        slow = sum(any(s.slow.values()) for s in states)
        host = all(
            s.slow[TEMPORAL] and s.compute is not None and s.compute_baseline and s.rest_baseline
            and s.compute < cfg.host_compute_ratio * s.compute_baseline
            and _median(s._rests) >= cfg.host_rest_rise * s.rest_baseline
            for s in states)
        return {NODE_RANKS: slow >= cfg.node_share * len(states), NODE_HOST: host}


def _median(values, presorted: bool = False) -> float:
    ordered = values if presorted else sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default, `quantiles(method="inclusive")`)."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _median_and_sigma(values: list[float]) -> tuple[float, float]:
    middle = _median(values)
    return middle, 1.4826 * _median([abs(v - middle) for v in values])
