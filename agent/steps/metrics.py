"""The `training_*` metric families, rendered at scrape time from the step consumer's state (before
the first record has built the consumer, the same families without a rank)."""

from __future__ import annotations

import time
from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from agent.steps.reasons import PARSE_ERRORS, SLOW


class StepCollector:
    """`training_*` families: per rank, per job on this node, and the parser's health. Every family
    of a job carries node, namespace, job_name and job_id (see `StepMetrics.job_labels`). `steps`
    gives the consumer (agent.steps.consumer.StepMetrics), or None while it is not built."""

    def __init__(self, node: str, steps: Callable[[], object | None], clock=time.time):
        self._node = node
        self._steps = steps
        self._clock = clock

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        node, steps, now = self._node, self._steps(), self._clock()
        rank_labels = ["node", "namespace", "job_name", "job_id", "rank", "pp_stage"]
        duration = HistogramMetricFamily("training_step_duration_seconds", "Duration of each completed training step",
                                         labels=[*rank_labels, "clock"])
        phases = HistogramMetricFamily("training_phase_duration_seconds",
                                       "Per step: summed forward, dataloader and save_checkpoint ranges",
                                       labels=[*rank_labels, "phase"])
        last = GaugeMetricFamily("training_step_last_duration_seconds", "Duration of the latest step", labels=rank_labels)
        completed = GaugeMetricFamily("training_step_last_completed_timestamp_seconds",
                                      "Wall time the latest step ended (a hung rank shows as its age)", labels=rank_labels)
        total = CounterMetricFamily("training_steps_completed", "Steps seen", labels=rank_labels)
        baseline = GaugeMetricFamily("training_step_baseline_seconds",
                                     "Robust step-time baseline of the rank (median of its first 50 eligible steps)",
                                     labels=rank_labels)
        ratio = GaugeMetricFamily("training_rank_slowdown_ratio",
                                  "Median of the last 5 eligible steps over the baseline", labels=rank_labels)
        compute = GaugeMetricFamily("training_rank_compute_seconds",
                                    "Median forward time of the last 5 eligible steps", labels=rank_labels)
        slow = GaugeMetricFamily("training_rank_slow", "1 while the detector holds the rank slow, by reason",
                                 labels=[*rank_labels, "reason"])
        detections = CounterMetricFamily("training_slow_detections", "Times the rank was found slow, by reason",
                                         labels=[*rank_labels, "reason"])
        job_rank_labels = ["node", "namespace", "job_name", "job_id", "rank"]  # no pp_stage: known only once read
        records = CounterMetricFamily("training_profiling_records", "Profiling records read", labels=job_rank_labels)
        lag = GaugeMetricFamily("training_profiling_lag_seconds", "Now minus the newest host record timestamp read",
                                labels=job_rank_labels)
        info = GaugeMetricFamily("training_rank_info",
                                 "1 per rank; pod_name is the rank's pod when its job has one pod on this node, "
                                 "else empty (the records do not name the pod)",
                                 labels=[*job_rank_labels, "pod_name"])
        jobs: dict[str, tuple[str, str, str]] = {}  # job_id -> its namespace, name and id as label values
        pods: dict[str, str] = {}  # job_id -> pod_name
        for key, series in sorted(steps.ranks.items() if steps else (), key=lambda kv: (kv[0].job_id, kv[0].rank)):
            if key.job_id not in jobs:
                jobs[key.job_id] = tuple(map(_label, (*steps.job_labels(key.job_id), key.job_id)))
                pods[key.job_id] = _label(steps.pod_of(key.job_id))
            namespace, job_name, job_id = jobs[key.job_id]
            job_rank = [node, namespace, job_name, job_id, str(key.rank)]
            labels = [*job_rank, series.stage]
            info.add_metric([*job_rank, pods[key.job_id]], 1)
            for clock, histogram in sorted(series.steps.items()):
                duration.add_metric([*labels, clock], histogram.buckets(), histogram.total)
            for phase, histogram in sorted(series.phases.items()):
                phases.add_metric([*labels, phase], histogram.buckets(), histogram.total)
            if series.last_duration_s is not None:
                last.add_metric(labels, series.last_duration_s)
                completed.add_metric(labels, series.last_completed_s)
            total.add_metric(labels, series.steps_total)
            state = steps.detector.ranks.get(key)
            if state is not None:
                if state.baseline is not None:
                    baseline.add_metric(labels, state.baseline)
                if state.ratio is not None:
                    ratio.add_metric(labels, state.ratio)
                if state.compute is not None:
                    compute.add_metric(labels, state.compute)
            for reason in SLOW:
                slow.add_metric([*labels, reason], int(state is not None and state.slow[reason]))
                detections.add_metric([*labels, reason], state.detections[reason] if state is not None else 0)
            records.add_metric(job_rank, series.records)
            newest = series.assembler.newest_host_ns
            if newest:
                lag.add_metric(job_rank, max(0.0, now - newest / 1e9))
        node_slow = GaugeMetricFamily("training_node_slow", "1 while this node is slow for the job, by reason",
                                      labels=["node", "namespace", "job_name", "job_id", "reason"])
        for job, (namespace, job_name, job_id) in jobs.items():
            for reason, value in steps.detector.node_verdict(job).items():
                node_slow.add_metric([node, namespace, job_name, job_id, reason], int(value))
        # Per node only: some reasons have no job (a directory not named like a job or rank, the node-wide
        # limit), and the log line of each skip names its job and rank.
        errors = CounterMetricFamily("training_profiling_parse_errors",
                                     "Bad profiling input skipped on the node, by reason (the log names the job and "
                                     "rank)", labels=["node", "reason"])
        for reason, count in sorted(steps.parse_errors.items() if steps else dict.fromkeys(PARSE_ERRORS, 0).items()):
            errors.add_metric([node, reason], count)
        yield from (info, duration, phases, last, completed, total, baseline, ratio, compute, slow, detections,
                    node_slow, records, lag, errors)


def _label(value: str) -> str:
    """A value the exposition can encode: one str that is not UTF-8 (a lone surrogate, from a file
    name or JSON) would fail the whole scrape, so its surrogates are shown escaped."""
    return value if value.isascii() else value.encode(errors="backslashreplace").decode()
