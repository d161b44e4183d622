"""Metrics of the datatrace component (and of its Kubernetes watches), rendered at scrape time."""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class DatatraceCollector:
    def __init__(self, node: str, sync):
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
