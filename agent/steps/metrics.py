"""The `training_*` metric families, rendered at scrape time from the step consumer's state (before
the first record has built the consumer, the same families without a rank).

A node's training series grow with its ranks, so a rank has only what a rule, a dashboard or the
slow-rank verdicts read (15 series, 16 while it saves a checkpoint, and its worker's 9 shared by its
TP group: docs/metrics.md, "Series budget"); the distributions are per job on the node (two
histograms, at most 80 series, whatever the number of ranks)."""

from __future__ import annotations

import time
from typing import Callable, Iterable

from prometheus_client.core import Metric

from agent.common.families import counter, described, gauge, histogram, summary
from agent.steps.records import RankKey
from agent.steps.reasons import COMPUTE, IO, PARSE_ERRORS, SLOW

JOB = ("namespace", "job_name", "job_id")  # after `node`
JOB_RANK = (*JOB, "rank")  # no pp_stage: known only once read
RANK = (*JOB_RANK, "pp_stage")
WORKER = (*JOB, "pp_stage", "worker")

DURATION = summary("training_step_duration_seconds", "Duration of each completed training step: count and sum "
                   "(the distribution is training_node_step_duration_seconds)", *RANK, "clock")
NODE_DURATION = histogram("training_node_step_duration_seconds",
                          "Duration of each completed training step of the job's ranks on this node", *JOB, "clock")
NODE_PHASES = histogram("training_node_phase_duration_seconds", "Per step of the job's ranks on this node: summed "
                        "forward, dataloader and save_checkpoint ranges", *JOB, "phase")
LAST = gauge("training_step_last_duration_seconds", "Duration of the latest step", *RANK)
COMPLETED = gauge("training_step_last_completed_timestamp_seconds",
                  "Wall time the latest step ended (a hung rank shows as its age)", *RANK)
TOTAL = counter("training_steps_completed", "Steps seen", *RANK)
BASELINE = gauge("training_step_baseline_seconds",
                 "Robust step-time baseline of the rank (median of its first 50 eligible steps)", *RANK)
RATIO = gauge("training_rank_slowdown_ratio", "Median of the last 5 eligible steps over the baseline", *RANK)
RANK_SLOW = gauge("training_rank_slow", "1 while the detector holds the rank slow, by reason", *RANK, "reason")
RECORDS = counter("training_profiling_records", "Profiling records read", *JOB_RANK)
LAG = gauge("training_profiling_lag_seconds",
            "How old the oldest record of the agent's last read was (TaskD writes every 5 s)", *JOB_RANK)
ACTIVE = gauge("training_rank_active",
               "1 while the rank is training: in a step that is not hung, or within 30 s of the end of one, and not "
               "saving a checkpoint; 0 when finished, paused, saving or hung", *RANK)
OPEN_STEP = gauge("training_step_open_since_timestamp_seconds",
                  "Wall time the rank's step in progress began (absent between steps)", *RANK)
OPEN_CHECKPOINT = gauge("training_checkpoint_open_since_timestamp_seconds",
                        "Wall time the rank's save_checkpoint in progress began", *RANK)
RANK_INFO = gauge("training_rank_info", "1 per rank; pod_name is the rank's pod when its job has one pod on this "
                  "node, else empty (the records do not name the pod)", *JOB_RANK, "pod_name")
NODE_SLOW = gauge("training_node_slow", "1 while this node is slow for the job, by reason", *JOB, "reason")
WORKER_INFO = gauge("training_worker_info", "1 per worker (tensor-parallel group) of a job: its ranks on this node "
                    "and the pod holding them (empty when the job has several pods here)", *WORKER, "ranks", "pod_name")
WORKER_COMPUTE = gauge("training_worker_compute_seconds", "Median compute (summed forward) per step over the "
                       "worker's last `window` eligible steps, while it trains", *WORKER, "window")
WORKER_STDERR = gauge("training_worker_compute_stderr_seconds", "Standard error of training_worker_compute_seconds, "
                      "from the worker's robust per-step spread", *WORKER, "window")
WORKER_SLOW = gauge("training_worker_slow", "1 while the worker is slow as judged on this node, by reason: compute "
                    "(against its stage peers here), io (its dataloader dominates its steps)", *WORKER, "reason")
# Per node only: some reasons have no job (a directory not named like a job or rank, the node-wide
# limit), and the log line of each skip names its job and rank.
PARSE_ERRORS_FAMILY = counter("training_profiling_parse_errors", "Bad profiling input skipped on the node, by reason "
                              "(the log names the job and rank)", "reason")
# In the order of a scrape.
JOB_FAMILIES = (RANK_INFO, DURATION, LAST, COMPLETED, TOTAL, BASELINE, RATIO, RANK_SLOW, ACTIVE, OPEN_STEP,
                OPEN_CHECKPOINT, NODE_SLOW, NODE_DURATION, NODE_PHASES)
WORKER_FAMILIES = (WORKER_INFO, WORKER_COMPUTE, WORKER_STDERR, WORKER_SLOW)
FAMILIES = (*JOB_FAMILIES, *WORKER_FAMILIES, RECORDS, LAG, PARSE_ERRORS_FAMILY)


class StepCollector:
    """`training_*` families: per rank, per job on this node, and the parser's health. Every family
    of a job carries node, namespace, job_name and job_id (see `StepMetrics.job_labels`). `steps`
    gives the consumer (agent.steps.consumer.StepMetrics), or None while it is not built."""

    def __init__(self, node: str, steps: Callable[[], object | None], clock=time.time, histograms: bool = True):
        self._node = node
        self._steps = steps
        self._clock = clock
        self._histograms = histograms  # False: the two histogram families stay empty (what the rules never read)

    def describe(self) -> list[Metric]:
        return described(FAMILIES)

    def collect(self) -> Iterable[Metric]:
        node, steps, now = self._node, self._steps(), self._clock()
        (info, duration, last, completed, total, baseline, ratio, slow, active, open_step, open_checkpoint, node_slow,
         node_duration, node_phases) = (family.empty() for family in JOB_FAMILIES)
        records, lag = RECORDS.empty(), LAG.empty()
        jobs: dict[str, tuple[str, str, str]] = {}  # job_id -> its namespace, name and id as label values
        pods: dict[str, str] = {}  # job_id -> pod_name
        active_ranks: set = set()
        for key, series in sorted(steps.ranks.items() if steps else (), key=lambda kv: (kv[0].job_id, kv[0].rank)):
            if key.job_id not in jobs:
                jobs[key.job_id] = tuple(map(_label, (*steps.job_labels(key.job_id), key.job_id)))
                pods[key.job_id] = _label(steps.pod_of(key.job_id))
            namespace, job_name, job_id = jobs[key.job_id]
            job_rank = [node, namespace, job_name, job_id, str(key.rank)]
            labels = [*job_rank, series.stage]
            info.add_metric([*job_rank, pods[key.job_id]], 1)
            is_active = steps.active(key, now)
            if is_active:
                active_ranks.add(key)
            for clock, steps_of in sorted(series.steps.items()):
                duration.add_metric([*labels, clock], steps_of.count, steps_of.total)
            if series.last_duration_s is not None:
                last.add_metric(labels, series.last_duration_s)
                completed.add_metric(labels, series.last_completed_s)
            total.add_metric(labels, series.steps_total)
            state = steps.detector.ranks.get(key)
            if state is not None:
                if state.baseline is not None:
                    baseline.add_metric(labels, state.baseline)
                if state.ratio is not None and is_active:  # a stopped job's frozen ratio says nothing
                    ratio.add_metric(labels, state.ratio)
            for reason in SLOW:
                slow.add_metric([*labels, reason], int(state is not None and state.slow[reason]))
            records.add_metric(job_rank, series.records)
            if series.read_lag_s is not None:
                lag.add_metric(job_rank, series.read_lag_s)
            active.add_metric(labels, int(is_active))
            if series.open_step_s is not None:
                open_step.add_metric(labels, series.open_step_s)
            if series.open_checkpoint_s is not None:
                open_checkpoint.add_metric(labels, series.open_checkpoint_s)
        worker_families = _WorkerFamilies()
        active_jobs = {key.job_id for key in active_ranks}
        for job, (namespace, job_name, job_id) in jobs.items():
            if job not in active_jobs:
                continue  # finished, paused or saving here: no verdict on this node
            for reason, value in steps.detector.node_verdict(job).items():
                node_slow.add_metric([node, namespace, job_name, job_id, reason], int(value))
        for job, (namespace, job_name, job_id) in jobs.items() if self._histograms else ():
            histograms = steps.jobs.get(job)
            for clock, hist in sorted(histograms.steps.items()) if histograms else ():
                node_duration.add_metric([node, namespace, job_name, job_id, clock], hist.buckets(), hist.total)
            for phase, hist in sorted(histograms.phases.items()) if histograms else ():
                node_phases.add_metric([node, namespace, job_name, job_id, phase], hist.buckets(), hist.total)
        for job, workers in sorted(steps.detector.workers.items() if steps else ()):
            if job not in jobs:
                continue
            namespace, job_name, job_id = jobs[job]
            for worker in sorted(workers.values(), key=lambda w: int(w.name)):
                keys = [RankKey(job, rank) for rank in worker.ranks]
                labels = [node, namespace, job_name, job_id, worker.stage, worker.name]
                worker_families.add(labels, worker, _ranges(worker.ranks), pods[job],
                                    any(k in active_ranks for k in keys),
                                    any(steps.detector.ranks[k].slow[IO] for k in keys if k in steps.detector.ranks))
        errors = PARSE_ERRORS_FAMILY.empty()
        for reason, count in sorted(steps.parse_errors.items() if steps else dict.fromkeys(PARSE_ERRORS, 0).items()):
            errors.add_metric([node, reason], count)
        yield from (info, duration, last, completed, total, baseline, ratio, slow, active, open_step, open_checkpoint,
                    node_slow, node_duration, node_phases, *worker_families.families(), records, lag, errors)


class _WorkerFamilies:
    """The per-worker families: what the cross-node rules compare. The windows and verdicts are there
    only while the worker trains (a finished or paused job adds no evidence); its info always."""

    def __init__(self) -> None:
        self.info, self.compute, self.stderr, self.slow = (family.empty() for family in WORKER_FAMILIES)

    def add(self, labels: list[str], worker, ranks: str, pod: str, active: bool, io: bool) -> None:
        self.info.add_metric([*labels, ranks, pod], 1)
        if not active:
            return
        for n, window in sorted(worker.windows.items()):
            self.compute.add_metric([*labels, str(n)], window.median)
            self.stderr.add_metric([*labels, str(n)], window.stderr)
        self.slow.add_metric([*labels, COMPUTE], int(worker.slow))
        self.slow.add_metric([*labels, IO], int(io))

    def families(self) -> tuple[Metric, ...]:
        return self.info, self.compute, self.stderr, self.slow


def _ranges(ranks: tuple[int, ...]) -> str:
    """`0-3,8-11`: a worker's ranks, short."""
    parts, start = [], None
    for index, rank in enumerate(ranks):
        if start is None:
            start = rank
        if index + 1 == len(ranks) or ranks[index + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(parts)


def _label(value: str) -> str:
    """A value the exposition can encode: one str that is not UTF-8 (a lone surrogate, from a file
    name or JSON) would fail the whole scrape, so its surrogates are shown escaped."""
    return value if value.isascii() else value.encode(errors="backslashreplace").decode()
