"""Metrics of the profiling disk guard, rendered at scrape time from its state (before anything under
the root has built the guard: nothing used, aged or scanned, against the configured limit)."""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class DiskGuardCollector:
    """`guard` gives the agent.diskguard.guard.DiskGuard, or None while it is not built."""

    def __init__(self, node: str, guard: Callable[[], object | None], limit_bytes: int):
        self._node = node
        self._guard = guard
        self._limit_bytes = limit_bytes

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        node, guard = self._node, self._guard() or _NotBuilt(self._limit_bytes)
        for name, kind, help_text, value in (
            ("npu_agent_profiling_disk_usage_bytes", GaugeMetricFamily,
             "Bytes of regular files under profiling.root (the disk guard's ledger)", guard.usage_bytes),
            ("npu_agent_profiling_disk_limit_bytes", GaugeMetricFamily,
             "profiling.disk_limit_mb in bytes", guard.limit_bytes),
            ("npu_agent_profiling_files_aged_total", CounterMetricFamily,
             "Record files deleted by the disk guard to get under the limit", guard.files_aged),
            ("npu_agent_profiling_bytes_aged_total", CounterMetricFamily,
             "Bytes freed by the disk guard", guard.bytes_aged),
            ("npu_agent_profiling_scans_total", CounterMetricFamily,
             "Full scans of the profiling tree (start-up, root appearing, inotify overflow)", guard.scans),
            ("npu_agent_profiling_inotify_overflows_total", CounterMetricFamily,
             "inotify queue overflows (each one costs a full scan)", guard.overflows),
            ("npu_agent_profiling_unwatched_directories", GaugeMetricFamily,
             "Directories of profiling.root whose inotify watch could not be added (fs.inotify.max_user_watches): "
             "walked again every 30 s at most instead", guard.unwatched),
            ("npu_agent_profiling_errors_total", CounterMetricFamily,
             "Unreadable directories or files, refused rank directories and failed deletions met by the disk guard", guard.errors),
        ):
            family = kind(name, help_text, labels=["node"])
            family.add_metric([node], value)
            yield family


class _NotBuilt:
    usage_bytes = files_aged = bytes_aged = scans = overflows = unwatched = errors = 0

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
