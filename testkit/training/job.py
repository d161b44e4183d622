"""A synchronous distributed-training job, seeded and pure: its step timings and the TaskD records
its ranks write.

Timing. Every rank starts step s at the same wall time T_s and the step lasts about as long on every
rank (± 0.2 %): the collectives make the job move in lock step. Per worker (one TP group, see
`layout`) the forward's compute is

    c_w(s) = forward_s * stage_factor[stage] * (1 + noise * N(0,1)) * seq_factor * slow_factor

and the step lasts D_s = step_s * (1 + compute_share * (max_w c_w(s)/nominal_w - 1)) * (1 + noise/2 *
N(0,1)), nominal_w = forward_s * stage_factor[stage]: the slowest worker sets every rank's pace, but
only its own forward is longer, which is what tells it apart. compute_share is the part of the step
that waits on compute; 0.65 reproduces a published 64-rank job whose slow worker's forward was 2.50x
and whose step went from 23.5 s to 46.3 s. The ranks of a worker get the same forward within 0.05 %
(they synchronise inside every layer). `stage_factors` model pipeline imbalance (in the published
dp2 pp4 tp1 job the last stage's forward was 2.07x the others', the ranks of a stage within 0.5 %).

Sequence-length imbalance (`seq_imbalance`) multiplies each worker's compute, per step, by
exp(0.0801 * T) with T Student-t with 7 degrees of freedom: heavy-tailed and not persistent, it
reproduces the forward / stage-median spread of a real 128-rank job (dp32 dsp2 pp2): p90 1.12,
p99 1.27, max about 1.69 over about 10k samples, every rank's median within 0.94-1.02.

Events. Slow workers (`SlowWorker`) multiply a worker's compute over a range of steps. Every
gc_every-th step each rank stalls gc_s with probability gc_share inside its forward; its TP group
waits for it, so its whole worker's forward grows by gc_s (once, however many of its ranks stalled)
and the step by gc_s * compute_share. Every checkpoint_every-th step ends with a host-only
`save_checkpoint` range of checkpoint_s (± 1 %) on every rank, and the step grows by that much.
`pauses` hold the job between two steps (an evaluation). After `steps` steps the job stops.

Every draw comes from a generator seeded by (seed, step) (step 0: the job's own draws), so a
step's timings do not depend on which steps were asked for before, nor in which order.

Records. Per rank and step, TaskD's lines for a `step N` range on a stream (host and device
records, the device's 40 µs after the host's), a host `dataloader` range at its start, a `forward`
range on the stream after it and, when saving, a host `save_checkpoint` range at its end; the
process is 40000 + rank and the device rank % ranks_per_node. Each rank's step range lasts D_s
± 0.2 % but never less than its marked ranges need, and the next step starts 0.1 ms after the
last rank ended this one (plus any pause), so a rank's ranges never overlap from step to step.

TaskD writes a rank's buffered records every flush_s, at its own phase: `flushes` replays those
writes in wall-time order, generating steps only as they are needed and forgetting them once
written, so an endless job of 1,024 ranks runs in bounded memory (but for 8 bytes per step, each
step's start).
"""

from __future__ import annotations

import math
import random
from array import array
from bisect import bisect_right
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Iterator

from testkit.training.layout import Layout

DEVICE_LAG_NS = 40_000  # device timestamps trail the host's
STEP_GAP_NS = 100_000  # the host loop between steps: a step's last device record precedes the next step's first record
TAIL_S = 0.001  # the least unmarked time a rank spends in a step after its last marked range
TP_JITTER = 0.0005  # forwards inside one TP group
RANK_JITTER = 0.002  # step durations across ranks
CHECKPOINT_JITTER = 0.01
SEQ_SCALE, SEQ_DOF = 0.0801, 7
PID_BASE = 40_000
CACHED_STEPS = 4  # drawn steps kept: rendering asks for the same step twice in a row, tests for a few
SEED_STRIDE = 1_000_003  # (seed, step) -> one integer seed, without hash(), so runs replay across processes


@dataclass(frozen=True, slots=True)
class SlowWorker:
    worker: int  # its first rank
    factor: float  # 1.10: its compute takes 10 % longer
    from_step: int = 1
    until_step: int | None = None  # inclusive; None: to the end

    def applies(self, step: int) -> bool:
        return self.from_step <= step and (self.until_step is None or step <= self.until_step)


@dataclass(frozen=True, slots=True)
class Flush:
    """One write of a rank's buffered records."""
    wall: float
    rank: int
    data: bytes


@dataclass(frozen=True, slots=True)
class StepTimings:
    """The truth about one step, in seconds from its start (the same instant on every rank)."""
    step: int
    duration: float  # D_s, what every rank's step lasts within ± 0.2 %
    compute: dict[int, float]  # per worker (its first rank): c_w(s), with its GC pause
    forward: tuple[float, ...]  # per rank
    rank_duration: tuple[float, ...]  # per rank: its `step N` range
    dataloader: tuple[float, ...]  # per rank
    checkpoint: tuple[float, ...]  # per rank; () when the step saves none
    paused: frozenset[int]  # the ranks that stalled for garbage collection

    @property
    def span(self) -> float:
        """Until the step ended on its last rank."""
        return max(self.rank_duration)


@dataclass
class TrainingJob:
    tp: int = 1
    dp: int = 2
    pp: int = 4
    ranks_per_node: int = 8
    seed: int = 0
    job_id: str | None = None  # None: "job-<seed>"
    steps: int | None = 200  # None: endless
    start_wall: float = 1_700_000_000.0  # T_1; a fixed default so that a seed gives the same bytes
    step_s: float = 1.0
    forward_s: float = 0.3
    compute_share: float = 0.65
    dataloader_s: float | None = None  # None: 2 % of step_s
    noise: float = 0.01
    stage_factors: tuple[float, ...] = ()  # per stage; (): all 1
    seq_imbalance: bool = False
    slow: tuple[SlowWorker, ...] = ()
    gc_every: int = 0  # 0: never
    gc_s: float = 0.3
    gc_share: float = 0.25
    checkpoint_every: int = 0  # 0: never
    checkpoint_s: float = 5.0
    pauses: tuple[tuple[int, float], ...] = ()  # (after step, seconds)
    flush_s: float = 5.0
    layout: Layout = field(init=False)
    phases: tuple[float, ...] = field(init=False, repr=False)  # per rank: its first flush, in seconds after start_wall

    def __post_init__(self) -> None:
        self.layout = Layout(self.tp, self.dp, self.pp, self.ranks_per_node)
        ranks = self.layout.ranks
        if self.job_id is None:
            self.job_id = f"job-{self.seed}"
        if self.dataloader_s is None:
            self.dataloader_s = 0.02 * self.step_s
        self.stage_factors = self.stage_factors or (1.0,) * self.pp
        if len(self.stage_factors) != self.pp:
            raise ValueError(f"{len(self.stage_factors)} stage factors for {self.pp} stages")
        for slow in self.slow:
            if slow.worker not in self.layout.workers:
                raise ValueError(f"{slow.worker} is not a worker (the first rank of a TP group of {self.tp})")
        if self.steps is not None and self.steps < 1:
            raise ValueError("a job runs at least one step")
        self._nominal = {w: self.forward_s * self.stage_factors[self.layout.stage(w)] for w in self.layout.workers}
        self._pauses: dict[int, int] = {}
        for after, seconds in self.pauses:
            self._pauses[after] = self._pauses.get(after, 0) + _ns(seconds)
        draw = random.Random(self.seed * SEED_STRIDE).random
        self._flush_ns = _ns(self.flush_s)
        self._phase_ns = [int(draw() * self._flush_ns) for _ in range(ranks)]
        self.phases = tuple(p / 1e9 for p in self._phase_ns)
        self._order = sorted(range(ranks), key=lambda r: (self._phase_ns[r], r))  # the flushes of one cycle
        # The object-id union as TaskD prints it twice: the process on host records, the device on device ones.
        self._objects = [(_object(PID_BASE + r), _object(r % self.ranks_per_node)) for r in range(ranks)]
        self._starts = array("q", [_ns(self.start_wall)])  # T_1, T_2, ... as far as known
        self._cache: dict[int, StepTimings] = {}
        self._ids = [1] * ranks  # the next range id of each process
        self._stamps: list[list[int]] = [[] for _ in range(ranks)]  # per rank, written at the next flushes
        self._lines: list[list[str]] = [[] for _ in range(ranks)]
        self._pending = 0
        self._rendered = 0  # the last step turned into records
        self._cycle = self._slot = 0  # the next flush: self._order[slot] in cycle k

    def parallel_group(self, rank: int) -> dict:
        return self.layout.parallel_group(rank)

    @property
    def last_wall(self) -> float | None:
        """When the last step ended on its last rank; None for an endless job."""
        return None if self.steps is None else self.step_end(self.steps)

    def step_start(self, step: int) -> float:
        return self._start_ns(step) / 1e9

    def step_end(self, step: int) -> float:
        """When the step ended on its last rank."""
        return (self._start_ns(step) + _ns(self.timings(step).span)) / 1e9

    def timings(self, step: int) -> StepTimings:
        self._check(step)
        found = self._cache.get(step)
        if found is None:
            found = self._cache[step] = self._draw(step)
            if len(self._cache) > CACHED_STEPS:
                del self._cache[next(iter(self._cache))]
        return found

    def flushes(self, until: float) -> Iterator[Flush]:
        """Every write whose time is <= until, in wall-time order, from where the last call stopped.
        A flush with nothing to write writes nothing and is not reported; once the job has ended and
        every rank has written all it had, there are no more."""
        ranks = len(self._order)
        while not (self._rendered == self.steps and self._pending == 0):
            rank = self._order[self._slot]
            at = self._starts[0] + self._phase_ns[rank] + self._cycle * self._flush_ns
            if at / 1e9 > until:
                return
            self._render_until(at)
            self._slot += 1
            if self._slot == ranks:
                self._cycle, self._slot = self._cycle + 1, 0
            stamps, lines = self._stamps[rank], self._lines[rank]
            cut = bisect_right(stamps, at)
            if cut:
                data = "".join(lines[:cut]).encode()
                del stamps[:cut], lines[:cut]
                self._pending -= cut
                yield Flush(at / 1e9, rank, data)  # the state is past this flush already: stopping here loses none

    def _check(self, step: int) -> None:
        if step < 1 or self.steps is not None and step > self.steps:
            raise ValueError(f"no step {step} in a job of {self.steps} steps")

    def _start_ns(self, step: int) -> int:
        self._check(step)
        starts = self._starts
        while len(starts) < step:
            done = len(starts)
            starts.append(starts[-1] + _ns(self.timings(done).span) + STEP_GAP_NS + self._pauses.get(done, 0))
        return starts[step - 1]

    def _draw(self, step: int) -> StepTimings:
        rng = random.Random(self.seed * SEED_STRIDE + step)
        gauss, noise, tp, ranks = rng.gauss, self.noise, self.tp, self.layout.ranks
        compute, worst = {}, 0.0
        for worker, nominal in self._nominal.items():
            c = nominal * (1 + noise * gauss(0, 1))
            if self.seq_imbalance:
                c *= math.exp(SEQ_SCALE * _student_t(gauss))
            for slow in self.slow:
                if slow.worker == worker and slow.applies(step):
                    c *= slow.factor
            compute[worker] = c
            worst = max(worst, c / nominal)
        duration = self.step_s * (1 + self.compute_share * (worst - 1)) * (1 + 0.5 * noise * gauss(0, 1))
        paused = frozenset()
        if self.gc_every and step % self.gc_every == 0:
            paused = frozenset(r for r in range(ranks) if rng.random() < self.gc_share)
            for worker in {r - r % tp for r in paused}:
                compute[worker] += self.gc_s
            if paused:
                duration += self.gc_s * self.compute_share
        forward = tuple(compute[r - r % tp] * (1 + TP_JITTER * gauss(0, 1)) for r in range(ranks))
        dataloader = tuple(max(0.0, self.dataloader_s * (1 + noise * gauss(0, 1))) for _ in range(ranks))
        checkpoint = ()
        if self.checkpoint_every and step % self.checkpoint_every == 0:
            checkpoint = tuple(self.checkpoint_s * (1 + CHECKPOINT_JITTER * gauss(0, 1)) for _ in range(ranks))
            duration += self.checkpoint_s
        # A step holds its ranks' marked ranges, whatever the formula says (a GC pause of several
        # steps' length, say): the busiest rank then sets everyone's pace, as the collectives would.
        busy = [dataloader[r] + forward[r] + (checkpoint[r] if checkpoint else 0.0) + TAIL_S for r in range(ranks)]
        duration = max(duration, max(busy))
        rank_duration = tuple(max(duration * (1 + RANK_JITTER * gauss(0, 1)), busy[r]) for r in range(ranks))
        return StepTimings(step, duration, compute, forward, rank_duration, dataloader, checkpoint, paused)

    def _render_until(self, at: int) -> None:
        """Turn into records every step that starts by `at` (each record is written once complete)."""
        while self._rendered != self.steps and self._start_ns(self._rendered + 1) <= at:
            self._rendered += 1
            self._render(self._rendered)

    def _render(self, step: int) -> None:
        timing, start = self.timings(step), self._start_ns(step)
        name, tail = f"step {step}", _ns(TAIL_S)
        for rank in range(len(self._ids)):
            host, device = self._objects[rank]
            ident = self._ids[rank]
            end = start + _ns(timing.rank_duration[rank])
            loaded = start + _ns(timing.dataloader[rank])
            computed = loaded + _ns(timing.forward[rank])
            out = [*_range(ident, name, start, end, host, device),
                   *_range(ident + 1, "dataloader", start, loaded, host),
                   *_range(ident + 2, "forward", loaded, computed, host, device)]
            if timing.checkpoint:
                saved = end - tail
                out += _range(ident + 3, "save_checkpoint", saved - _ns(timing.checkpoint[rank]), saved, host)
            self._ids[rank] = ident + (4 if timing.checkpoint else 3)
            out.sort(key=itemgetter(0))  # by time, the calls' order on a tie (a stable sort), as MSPTI buffers them
            self._stamps[rank] += [stamp for stamp, _ in out]
            self._lines[rank] += [line for _, line in out]
            self._pending += len(out)


def _range(ident: int, name: str, start: int, end: int, host: str, device: str | None = None) -> list[tuple[int, str]]:
    """A range's records: host-only (flags 2/4) or on a stream (16/32, with the device's pair)."""
    if device is None:
        return [(start, _marker(2, 0, start, ident, host, name)), (end, _marker(4, 0, end, ident, host, "NULL"))]
    device_start, device_end = start + DEVICE_LAG_NS, end + DEVICE_LAG_NS
    return [(start, _marker(16, 0, start, ident, host, name)),
            (device_start, _marker(16, 1, device_start, ident, device, name)),
            (end, _marker(32, 0, end, ident, host, "NULL")),
            (device_end, _marker(32, 1, device_end, ident, device, "NULL"))]


def _marker(flag: int, source: int, timestamp: int, ident: int, objects: str, name: str) -> str:
    """One record as TaskD's writer prints it: Go field order, compact; an end record has no name."""
    domain = "NULL" if name == "NULL" else "default"
    return (f'{{"Kind":1,"Flag":{flag},"SourceKind":{source},"Timestamp":{timestamp},"Id":{ident},'
            f'{objects}"Name":"{name}","Domain":"{domain}"}}\n')


def _object(value: int) -> str:
    return (f'"MsptiObjectId":{{"Pt":{{"ProcessId":{value},"ThreadId":{value}}},'
            f'"Ds":{{"DeviceId":{value},"StreamId":{value}}}}},')


def _student_t(gauss) -> float:
    """Student's t with SEQ_DOF degrees of freedom, from normals only (the standard library has no chi-squared)."""
    z = gauss(0, 1)
    return z / math.sqrt(sum(gauss(0, 1) ** 2 for _ in range(SEQ_DOF)) / SEQ_DOF)


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)
