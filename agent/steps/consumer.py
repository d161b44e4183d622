"""Step-latency figures per rank, fed by the record tailer; the collector renders them at scrape time.

The tailer hands complete lines of each rank's files; they are parsed (`records`), paired into steps
(`steps`), judged (`detect`), and summed: per rank into a count and a sum, per job on the node into
histograms (per rank they cost Prometheus 80 series a rank: docs/metrics.md, "Series budget"). After
each batch the oldest input position a rank still needs is handed back to the tailer to commit, so a
restart reads again from there; the steps that re-reading finds a second time are dropped by (process, step number), which is kept
in `<state_dir>/steps.json` with the detector's baselines (a restart goes on judging a rank whose
training process did not restart, instead of learning it for 70 steps). Bad input is counted by reason and logged at most once a minute per
file and reason; it never stops the rest.

Every `upkeep_s`, whether records arrive or not, ranks whose directory went or that stopped writing
leave the scrape after their grace, and the state is saved when it changed. Memory is bounded per
node, not only per rank: the entries kept for ranges and steps still to complete (per rank at most
~48,000, see `steps`) are at most MAX_HELD over all ranks; above it the ranks holding the most drop
their oldest, counted as `node_limit`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent.common.fsutil import atomic_write, read_state
from agent.steps.detect import SlowRankDetector
from agent.steps import reasons
from agent.steps.records import TIMESTAMP, RankKey, parse
from agent.steps.pairing import CHECKPOINT, DATALOADER, FORWARD, RankAssembler, StepSample
from agent.steps.cursors import Position
from agent.lifecycle import Tasks

log = logging.getLogger(__name__)

STEP_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12.5, 15, 20, 25, 30, 45, 60, 90,
                120, 180, 300, 600)
PHASE_BUCKETS = {
    FORWARD: (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    DATALOADER: (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    CHECKPOINT: (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600),
}
LOG_EVERY_S = 60.0
GONE_GRACE_S = 60.0  # a rank whose directory was removed stays in the scrape this long
IDLE_GRACE_S = 600.0  # a rank with no new record for this long is dropped (its job ended)
UPKEEP_S = 5.0  # expiry and saving of the state
MAX_HELD = 131_072  # entries held for unfinished ranges and steps, over all ranks: ~46 MiB at worst (measured)
MAX_PROCESSES = 16  # per rank, the processes whose newest step is kept (a rank runs one at a time)
# A rank is training while a step of it is in progress, or ended at most ACTIVE_GRACE_S ago: TaskD
# writes every 5 s, so records arrive 5-10 s late and the next step's start may not be read yet.
# A step in progress for longer than HUNG_STEPS of its steps (and HUNG_MIN_S) is hung, not training.
# Past them the rank is finished, paused or hung: its evidence leaves the scrape.
ACTIVE_GRACE_S = 30.0
HUNG_STEPS, HUNG_MIN_S = 10, 60.0
# A job the Kubernetes pod watch does not name (the watch is off, or no pod of this node sets that
# MINDX_TASK_ID): named by its id, in this namespace. Not a DNS label, so no real namespace is taken
# for it, and never empty: an empty label is no label, and a scrape would fill in the agent's own namespace.
UNKNOWN_NAMESPACE = "_unknown"
LOGGED_MAX = 4096  # (rank, file, reason) whose last log time is kept


@dataclass
class Histogram:
    bounds: tuple
    counts: list = field(default_factory=list)  # per bucket, not cumulative
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        for index, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[index] += 1
                break
        self.total += value
        self.count += 1

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative, with +Inf, as the exposition format wants them."""
        out, running = [], 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            out.append((_bound_text(bound), running))
        out.append(("+Inf", self.count))
        return out


def _bound_text(bound: float) -> str:
    return repr(float(bound))


@dataclass
class Summary:
    """Count and sum of a rank's step durations: its mean over any range (the distribution is its job's)."""

    count: int = 0
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1


@dataclass
class JobHistograms:
    """The distributions of the steps of a job's ranks on this node. They live as long as a rank of
    the job does, so a rank that leaves takes nothing back (they only grow, as counters must)."""

    steps: dict = field(default_factory=dict)  # clock -> Histogram
    phases: dict = field(default_factory=dict)  # phase -> Histogram


@dataclass
class RankSeries:
    """Everything the scrape shows of one rank."""

    key: RankKey
    assembler: RankAssembler = field(default_factory=RankAssembler)
    stage: str = ""
    tp_group: tuple[int, ...] | None = None
    steps: dict = field(default_factory=dict)  # clock -> Summary
    steps_total: int = 0
    last_duration_s: float | None = None
    last_completed_s: float | None = None
    records: int = 0
    last_steps: dict = field(default_factory=dict)  # pid -> the newest step number counted
    end: tuple | None = None  # (file, offset) just after the last line read
    last_input_at: float = 0.0
    gone_at: float | None = None
    held: int = 0  # assembler.held at the end of the last batch
    open_step_s: float | None = None  # host start of the step in progress (its end not read yet)
    open_checkpoint_s: float | None = None  # host start of a save_checkpoint in progress
    read_lag_s: float | None = None  # how old the oldest record of the last batch was when it was read
    _oldest_ns: int | None = None  # of the records read in this batch: the first of each write is its oldest


class StepMetrics:
    """The tailer's consumer (see `agent.steps.tail.TailConsumer`) and the metrics' source."""

    name = "step-metrics"

    def __init__(self, state_file: Path, *, detector: SlowRankDetector | None = None,
                 clock: Callable[[], float] = time.time, job_labels: Callable[[str], tuple[str, str]] | None = None,
                 job_pods: Callable[[str], tuple[str, ...]] | None = None,
                 upkeep_s: float = UPKEEP_S, max_held: int = MAX_HELD):
        self.detector = detector or SlowRankDetector()
        self.ranks: dict[RankKey, RankSeries] = {}
        self.jobs: dict[str, JobHistograms] = {}  # job_id -> its histograms, while it has a rank here
        self.parse_errors: Counter = Counter(dict.fromkeys(reasons.PARSE_ERRORS, 0))  # reason -> count
        self.tasks = Tasks(self.name)
        self._state_file = state_file
        self._clock = clock
        self._job_labels = job_labels or (lambda job_id: ("", ""))
        self._job_pods = job_pods or (lambda job_id: ())
        self._upkeep_s = upkeep_s
        self._max_held = max_held
        self._held = 0  # sum of the ranks' `held`
        self._dirty: set[RankKey] = set()
        self._logged: OrderedDict[tuple, float] = OrderedDict()  # (job, rank, file, reason) -> when last logged
        self._unsaved = False
        # job/rank -> (the newest step of each process, the detector's baselines) of the last run
        self._restored: dict[str, tuple[dict, dict | None]] = read_state(
            state_file, "step state", _parse_state, clock) or {}

    async def start(self) -> None:
        self.tasks.start("upkeep", self._upkeep)  # fed by the tailer; this only keeps time

    async def stop(self) -> None:
        await self.tasks.stop()
        self.save()

    def readiness(self) -> tuple[bool, str]:
        return True, ""

    # ---- TailConsumer ---------------------------------------------------------------------------

    def on_lines(self, key, file: str, offset: int, data: bytes) -> None:
        series = self._series(key)
        parsed = parse(data)
        series.records += len(parsed.markers) + parsed.other_kinds
        series.last_input_at = self._clock()
        series.gone_at = None
        for reason, line in parsed.errors:
            self._bad(key, reason, f"{file}: {line[:120]!r}", file)
        if parsed.markers:
            first = int(parsed.markers[0][TIMESTAMP])
            series._oldest_ns = first if series._oldest_ns is None else min(series._oldest_ns, first)
        series.assembler.feed(parsed.markers, (file, offset))
        series.end = (file, offset + len(data))
        self._dirty.add(series.key)

    def on_group(self, key, group: dict) -> None:
        series = self._series(key)
        stage = pipeline_stage(group, series.key.rank)
        if stage is None:
            self._bad(key, "parallel_group", "no pipeline group listing this rank", "parallel_group.json")
            return
        series.stage, series.tp_group = stage, tensor_group(group, series.key.rank)

    def on_rank_gone(self, key) -> None:
        series = self.ranks.get(key)
        if series is not None:
            series.gone_at = self._clock()

    def on_bad_input(self, key, reason: str, detail: str) -> None:
        self._bad(key, reason, detail, "" if key else detail)  # without a rank: a directory, each reported once

    def on_batch_end(self) -> dict[RankKey, Position]:
        """The end of a batch of lines: the position each rank read in it still needs (the tailer commits them)."""
        commits = {}
        now = self._clock()
        for rank_key in self._dirty:
            series = self.ranks.get(rank_key)
            if series is None:
                continue
            for sample in series.assembler.finalize():
                self._count(series, sample)
            self._in_progress(series, now)
            for reason, count in series.assembler.errors.items():
                if count:
                    self._bad(rank_key, reason, f"{count} since the last report", series.end[0] if series.end else "",
                              count)
            series.assembler.errors.clear()
            needed = series.assembler.oldest_needed() or series.end
            if needed is not None:
                commits[rank_key] = Position(*needed)
            series.assembler.compact()
            self._held += series.assembler.held - series.held
            series.held = series.assembler.held
        for job_id in {key.job_id for key in self._dirty}:
            self.detector.settle(job_id)
        self._dirty.clear()
        if self._held > self._max_held:
            self._shed()
        return commits

    async def _upkeep(self) -> None:
        while True:
            await asyncio.sleep(self._upkeep_s)
            self.upkeep()

    def upkeep(self) -> None:
        """Drop the ranks past their grace and save the state if it changed."""
        self._expire(self._clock())
        if self._unsaved:
            self.save()

    # ---- state ----------------------------------------------------------------------------------

    def _series(self, key) -> RankSeries:
        series = self.ranks.get(key)
        if series is None:
            series = self.ranks[key] = RankSeries(key, last_input_at=self._clock())
            series.last_steps, baseline = self._restored.pop(f"{key.job_id}/{key.rank}", ({}, None))
            if baseline is not None:
                self.detector.restore(key, baseline)
        return series

    def _count(self, series: RankSeries, sample: StepSample) -> None:
        if sample.step <= series.last_steps.get(sample.pid, -1):
            return  # read again after a restart: counted already
        series.last_steps.pop(sample.pid, None)  # the newest process last: the oldest is the one forgotten
        series.last_steps[sample.pid] = sample.step
        if len(series.last_steps) > MAX_PROCESSES:
            del series.last_steps[next(iter(series.last_steps))]
        self._unsaved = True
        series.steps_total += 1
        series.steps.setdefault(sample.clock, Summary()).observe(sample.duration_s)
        series.last_duration_s = sample.duration_s
        series.last_completed_s = max(series.last_completed_s or 0.0, sample.wall_end_s)
        job = self.jobs.setdefault(series.key.job_id, JobHistograms())
        job.steps.setdefault(sample.clock, Histogram(STEP_BUCKETS)).observe(sample.duration_s)
        for phase, value in ((FORWARD, sample.forward_s), (DATALOADER, sample.dataloader_s or None),
                             (CHECKPOINT, sample.checkpoint_s or None)):
            if value is not None:
                job.phases.setdefault(phase, Histogram(PHASE_BUCKETS[phase])).observe(value)
        self.detector.observe(series.key, sample, series.stage, series.tp_group)

    def _in_progress(self, series: RankSeries, now: float) -> None:
        """What the rank is in the middle of, and how late its newest record came."""
        if series._oldest_ns is not None:  # a writer that holds its records for 40 s shows 40 s
            series.read_lag_s = max(0.0, now - series._oldest_ns / 1e9)
            series._oldest_ns = None
        step, checkpoint = series.assembler.in_progress()
        series.open_step_s = None
        if step is not None:
            pid, number, start_ns = step
            if number > series.last_steps.get(pid, -1):  # else a step whose end was lost: a later one is done
                series.open_step_s = start_ns / 1e9
        series.open_checkpoint_s = None
        if checkpoint is not None and checkpoint / 1e9 >= (series.last_completed_s or 0.0):
            series.open_checkpoint_s = checkpoint / 1e9  # one begun before the newest step ended has ended

    def active(self, key: RankKey, now: float) -> bool:
        """Whether the rank is training: not saving a checkpoint, and in a step that is not hung or
        within ACTIVE_GRACE_S of the end of one."""
        series = self.ranks.get(key)
        if series is None or series.open_checkpoint_s is not None:
            return False
        if series.open_step_s is not None:
            state = self.detector.ranks.get(key)
            typical = state.typical_step_s if state is not None else None
            return now - series.open_step_s <= max(HUNG_MIN_S, HUNG_STEPS * (typical or 0.0))
        return series.last_completed_s is not None and now - series.last_completed_s <= ACTIVE_GRACE_S

    def _expire(self, now: float) -> None:
        dropped = []
        for key, series in list(self.ranks.items()):
            gone = series.gone_at is not None and now - series.gone_at > GONE_GRACE_S
            if gone or now - series.last_input_at > IDLE_GRACE_S:
                del self.ranks[key]
                self._held -= series.held
                self._unsaved = True  # and from the state
                dropped.append(key)
                log.info("training rank dropped from the metrics", extra={
                    "job_id": key.job_id, "rank": key.rank, "why": "directory removed" if gone else "no records"})
        self.detector.forget(dropped)
        if dropped:
            live = {key.job_id for key in self.ranks}
            for job_id in [job_id for job_id in self.jobs if job_id not in live]:
                del self.jobs[job_id]  # its last rank left: the job's histograms leave the scrape with it

    def _shed(self) -> None:
        """Over the node-wide bound: every rank keeps what it holds up to one level, set so the sum
        fits; those holding more drop their oldest."""
        ranks = sorted(self.ranks.values(), key=lambda series: series.held)
        left = level = self._max_held
        for index, series in enumerate(ranks):
            level = left // (len(ranks) - index)
            if series.held > level:
                break
            left -= series.held
        dropped = 0
        for series in ranks:
            dropped += series.assembler.shed(level)
            self._held += series.assembler.held - series.held
            series.held = series.assembler.held
        self._bad(None, reasons.NODE_LIMIT, f"{dropped} marker entries of the ranks holding the most dropped, to keep "
                  f"{self._max_held} over {len(ranks)} ranks", "", dropped)

    def _bad(self, key, reason: str, detail: str, file: str, count: int = 1) -> None:
        self.parse_errors[reason] += count
        where = (getattr(key, "job_id", None), getattr(key, "rank", None), file, reason)
        now = self._clock()
        if now - self._logged.get(where, -LOG_EVERY_S) < LOG_EVERY_S:
            return
        while self._logged and now - next(iter(self._logged.values())) >= LOG_EVERY_S:
            self._logged.popitem(last=False)  # logged over a minute ago: holds no log back
        if len(self._logged) >= LOGGED_MAX:
            return  # that many distinct problems within a minute: counted only
        self._logged.pop(where, None)
        self._logged[where] = now  # in the order logged
        log.warning("bad profiling input skipped", extra={
            "job_id": where[0], "rank": where[1], "file": file, "reason": reason, "detail": detail})

    def save(self) -> None:
        ranks = {f"{k.job_id}/{k.rank}": {str(pid): step for pid, step in s.last_steps.items()}
                 for k, s in self.ranks.items()}
        baselines = {f"{k.job_id}/{k.rank}": saved for k in self.ranks
                     if (saved := self.detector.snapshot(k)) is not None}
        try:
            atomic_write(self._state_file, json.dumps({"version": 1, "ranks": ranks, "baselines": baselines}).encode())
        except OSError as exc:
            log.error("cannot save the step state", extra={"path": str(self._state_file), "error": str(exc)})
            return
        self._unsaved = False

    def job_labels(self, job_id: str) -> tuple[str, str]:
        """(namespace, job name): the pod watch's, else (UNKNOWN_NAMESPACE, the job id)."""
        namespace, name = self._job_labels(job_id)
        return namespace or UNKNOWN_NAMESPACE, name or job_id

    def pod_of(self, job_id: str) -> str:
        """The pod of the job's ranks on this node: known only when the job has one pod here (the
        records name no pod, and the device they name is numbered inside the container), else ""."""
        pods = self._job_pods(job_id)
        return pods[0] if len(pods) == 1 else ""


def _parse_state(doc: dict) -> dict[str, tuple[dict, dict | None]]:
    """`steps.json` as `save` writes it, checked: anything else raises (and the file is moved aside)."""
    if doc.get("version") != 1:
        raise ValueError("not a version 1 step state")
    baselines = {name: _baseline(saved) for name, saved in doc.get("baselines", {}).items()}
    return {name: ({int(pid): _int(step) for pid, step in steps.items()}, baselines.get(name))
            for name, steps in doc["ranks"].items()}


def _baseline(saved: dict) -> dict:
    numbers = {k: (None if saved[k] is None else _number(saved[k]))
               for k in ("baseline", "sigma", "compute_baseline", "rest_baseline")}
    if numbers["baseline"] is None or numbers["sigma"] is None:
        raise ValueError("a baseline without its value")
    return {"pid": _int(saved["pid"]), **numbers}


def _int(value) -> int:
    if type(value) is not int:
        raise TypeError(f"not an integer: {value!r:.40}")
    return value


def _number(value) -> float:
    if type(value) not in (int, float):
        raise TypeError(f"not a number: {value!r:.40}")
    return float(value)  # strict JSON has no NaN or infinity; an int too large for a float raises


def tensor_group(group: dict, rank: int) -> tuple[int, ...] | None:
    """The global ranks of the `tp` group of `parallel_group.json` that lists the rank; None when none does."""
    for entry in group.values():
        if isinstance(entry, dict) and entry.get("group_name") == "tp":
            members = entry.get("global_ranks")
            if isinstance(members, list) and rank in members and all(type(m) is int for m in members):
                return tuple(sorted(members))
    return None


def pipeline_stage(group: dict, rank: int) -> str | None:
    """The rank's index in its `pp` group of `parallel_group.json` (TaskD's dump format); "" when the
    file lists no pipeline group (no pipeline parallelism: one stage); None when it is malformed or
    no pipeline group lists the rank."""
    if not isinstance(group, dict):
        return None
    pipelines = [e for e in group.values() if isinstance(e, dict) and e.get("group_name") == "pp"]
    for entry in pipelines:
        members = entry.get("global_ranks")
        if isinstance(members, list) and rank in members:
            return str(members.index(rank))
    return None if pipelines else ""
