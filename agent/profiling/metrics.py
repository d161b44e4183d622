"""Metrics of the profiling hostPath components, rendered at scrape time from their state."""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.profiling.datatrace_sync import DatatraceSync


class DatatraceCollector:
    def __init__(self, node: str, sync: DatatraceSync):
        self._node = node
        self._sync = sync

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        node, sync = self._node, self._sync
        in_force = GaugeMetricFamily("npu_agent_datatrace_switch_files",
                                     "Profiling switch files in force under datatrace.root", labels=["node"])
        in_force.add_metric([node], sync.last.in_force)
        yield in_force
        ops = CounterMetricFamily("npu_agent_datatrace_operations_total",
                                  "Switch files written or removed, directories removed, failures",
                                  labels=["node", "operation"])
        for operation in ("written", "removed_files", "removed_dirs", "errors"):
            ops.add_metric([node, operation], sync.counters[operation])
        yield ops
        rejected = CounterMetricFamily("npu_agent_datatrace_rejected_total",
                                       "Switches not flushed: invalid job or namespace names, invalid or oversized values",
                                       labels=["node", "reason"])
        for reason in ("name", "switch"):
            rejected.add_metric([node, reason], sync.rejected[reason])
        yield rejected
        restarts = CounterMetricFamily("npu_agent_kube_watch_restarts_total",
                                       "Kubernetes watches restarted: expired (410, relisted) or an error reason",
                                       labels=["node", "watch", "reason"])
        lists = CounterMetricFamily("npu_agent_kube_lists_total", "Kubernetes lists, by watch", labels=["node", "watch"])
        for watch, counters in sync.watch_counters.items():
            lists.add_metric([node, watch], counters["lists"])
            for key, count in sorted(counters.items()):
                if key == "relist_expired":
                    restarts.add_metric([node, watch, "expired"], count)
                elif key.startswith("error_"):
                    restarts.add_metric([node, watch, key.removeprefix("error_")], count)
        yield restarts
        yield lists


class DiskGuardCollector:
    def __init__(self, node: str, guard):
        self._node = node
        self._guard = guard

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        node, guard = self._node, self._guard
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
            ("npu_agent_profiling_errors_total", CounterMetricFamily,
             "Unreadable directories or files, refused rank directories and failed deletions met by the disk guard", guard.errors),
        ):
            family = kind(name, help_text, labels=["node"])
            family.add_metric([node], value)
            yield family
