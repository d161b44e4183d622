"""Step-latency figures per rank, fed by the record tailer; the collector renders them at scrape time.

The tailer hands complete lines of each rank's files; they are parsed (`records`), paired into steps
(`steps`), judged (`detect`), and summed into per-rank histograms. After each batch the oldest input
position a rank still needs is committed back to the tailer, so a restart reads again from there;
the steps that re-reading finds a second time are dropped by (process, step number), which is kept
in `<state_dir>/steps.json` with the detector's baselines (a restart goes on judging a rank whose
training process did not restart, instead of learning it for 70 steps). Bad input is counted by reason and logged at most once a minute per
file and reason; it never stops the rest.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent.fsutil import atomic_write
from agent.profiling.detect import SlowRankDetector
from agent.profiling.records import RankKey, parse
from agent.profiling.steps import CHECKPOINT, DATALOADER, FORWARD, RankAssembler, StepSample
from agent.profiling.tail import Position

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
SAVE_EVERY_S = 5.0


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
class RankSeries:
    """Everything the scrape shows of one rank."""

    key: RankKey
    assembler: RankAssembler = field(default_factory=RankAssembler)
    stage: str = ""
    steps: dict = field(default_factory=dict)  # clock -> Histogram
    phases: dict = field(default_factory=dict)  # phase -> Histogram
    steps_total: int = 0
    last_duration_s: float | None = None
    last_completed_s: float | None = None
    records: int = 0
    last_steps: dict = field(default_factory=dict)  # pid -> the newest step number counted
    end: tuple | None = None  # (file, offset) just after the last line read
    last_input_at: float = 0.0
    gone_at: float | None = None


class StepMetrics:
    """The tailer's consumer (see `agent.profiling.tail.TailConsumer`) and the metrics' source."""

    name = "step-metrics"

    def __init__(self, state_file: Path, *, detector: SlowRankDetector | None = None,
                 clock: Callable[[], float] = time.time, job_labels: Callable[[str], tuple[str, str]] | None = None):
        self.detector = detector or SlowRankDetector()
        self.ranks: dict[RankKey, RankSeries] = {}
        self.parse_errors: Counter = Counter()  # reason -> count
        self.commit: Callable[[RankKey, object], None] = lambda key, position: None  # set by whoever wires the tailer
        self._state_file = state_file
        self._clock = clock
        self._job_labels = job_labels or (lambda job_id: ("", ""))
        self._dirty: set[RankKey] = set()
        self._logged: dict[tuple, float] = {}
        self._saved_at = 0.0
        self._unsaved = False
        self._baselines: dict[str, dict] = {}  # job/rank -> the detector's baselines of the last run
        self._restored = self._load()

    async def start(self) -> None:
        pass  # fed by the tailer

    async def stop(self) -> None:
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
        series.assembler.feed(parsed.markers, (file, offset))
        series.end = (file, offset + len(data))
        self._dirty.add(series.key)

    def on_group(self, key, group: dict) -> None:
        series = self._series(key)
        stage = pipeline_stage(group, series.key.rank)
        if stage is None:
            self._bad(key, "parallel_group", "no pipeline group listing this rank", "parallel_group.json")
            return
        series.stage = stage

    def on_rank_gone(self, key) -> None:
        series = self.ranks.get(key)
        if series is not None:
            series.gone_at = self._clock()

    def on_bad_input(self, key, reason: str, detail: str) -> None:
        self._bad(key, reason, detail, "")

    def on_batch_end(self) -> None:
        now = self._clock()
        for rank_key in self._dirty:
            series = self.ranks.get(rank_key)
            if series is None:
                continue
            for sample in series.assembler.finalize():
                self._count(series, sample)
            for reason, count in series.assembler.errors.items():
                if count:
                    self._bad(rank_key, reason, f"{count} since the last report", series.end[0] if series.end else "")
            series.assembler.errors.clear()
            needed = series.assembler.oldest_needed() or series.end
            if needed is not None:
                self.commit(rank_key, Position(*needed))
        self._dirty.clear()
        self._expire(now)
        if self._unsaved and now - self._saved_at >= SAVE_EVERY_S:
            self.save()

    # ---- state ----------------------------------------------------------------------------------

    def _series(self, key) -> RankSeries:
        series = self.ranks.get(key)
        if series is None:
            series = self.ranks[key] = RankSeries(key, last_input_at=self._clock())
            name = f"{key.job_id}/{key.rank}"
            series.last_steps = dict(self._restored.get(name, {}))
            if name in self._baselines:
                self.detector.restore(key, self._baselines[name])
        return series

    def _count(self, series: RankSeries, sample: StepSample) -> None:
        if sample.step <= series.last_steps.get(sample.pid, -1):
            return  # read again after a restart: counted already
        series.last_steps[sample.pid] = sample.step
        self._unsaved = True
        series.steps_total += 1
        series.steps.setdefault(sample.clock, Histogram(STEP_BUCKETS)).observe(sample.duration_s)
        series.last_duration_s = sample.duration_s
        series.last_completed_s = max(series.last_completed_s or 0.0, sample.wall_end_s)
        for phase, value in ((FORWARD, sample.forward_s), (DATALOADER, sample.dataloader_s or None),
                             (CHECKPOINT, sample.checkpoint_s or None)):
            if value is not None:
                series.phases.setdefault(phase, Histogram(PHASE_BUCKETS[phase])).observe(value)
        self.detector.observe(series.key, series.stage, sample)

    def _expire(self, now: float) -> None:
        for key, series in list(self.ranks.items()):
            gone = series.gone_at is not None and now - series.gone_at > GONE_GRACE_S
            if gone or now - series.last_input_at > IDLE_GRACE_S:
                del self.ranks[key]
                self.detector.forget(key)
                log.info("training rank dropped from the metrics", extra={
                    "job_id": key.job_id, "rank": key.rank, "why": "directory removed" if gone else "no records"})

    def _bad(self, key, reason: str, detail: str, file: str) -> None:
        self.parse_errors[reason] += 1
        where = (getattr(key, "job_id", None), getattr(key, "rank", None), file, reason)
        now = self._clock()
        if now - self._logged.get(where, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[where] = now
            log.warning("bad profiling input skipped", extra={
                "job_id": where[0], "rank": where[1], "file": file, "reason": reason, "detail": detail})

    def _load(self) -> dict:
        try:
            data = json.loads(self._state_file.read_text())
            ranks = data["ranks"]
            restored = {str(k): {int(pid): int(step) for pid, step in v.items()} for k, v in ranks.items()}
            self._baselines = {str(k): _baseline(v) for k, v in data.get("baselines", {}).items()}
            return restored
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("step state unreadable; steps read again after this restart may be counted twice",
                        extra={"path": str(self._state_file), "error": str(exc)})
            return {}

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
        self._saved_at, self._unsaved = self._clock(), False

    def job_labels(self, job_id: str) -> tuple[str, str]:
        return self._job_labels(job_id)


def _baseline(saved: dict) -> dict:
    """A saved baseline, checked: a wrong type raises (and the whole state is ignored)."""
    numbers = {k: (None if saved[k] is None else float(saved[k]))
               for k in ("baseline", "sigma", "compute_baseline", "rest_baseline")}
    if numbers["baseline"] is None or numbers["sigma"] is None:
        raise ValueError("a baseline without its value")
    return {"pid": int(saved["pid"]), **numbers}


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
