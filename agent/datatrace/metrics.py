"""Metrics of the datatrace component (and of its Kubernetes watches), rendered at scrape time."""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import Metric

from agent.common.families import counter, described, gauge

SWITCH_FILES = gauge("npu_agent_datatrace_switch_files", "Profiling switch files in force under datatrace.root")
OPERATIONS = counter("npu_agent_datatrace_operations_total",
                     "Switch files written or removed, directories removed, failures", "operation")
REJECTED = counter("npu_agent_datatrace_rejected_total",
                   "Switches not flushed: invalid job or namespace names, invalid or oversized values", "reason")
WATCH_RESTARTS = counter("npu_agent_kube_watch_restarts_total",
                         "Kubernetes watches restarted: expired (410, relisted) or an error reason", "watch", "reason")
LISTS = counter("npu_agent_kube_lists_total", "Kubernetes lists, by watch", "watch")
FAMILIES = (SWITCH_FILES, OPERATIONS, REJECTED, WATCH_RESTARTS, LISTS)


class DatatraceCollector:
    def __init__(self, node: str, sync):
        self._node = node
        self._sync = sync

    def describe(self) -> list[Metric]:
        return described(FAMILIES)

    def collect(self) -> Iterable[Metric]:
        node, sync = self._node, self._sync
        yield SWITCH_FILES.one(node, sync.last.in_force)
        yield OPERATIONS.series(node, ((operation, sync.counters[operation])
                                       for operation in ("written", "removed_files", "removed_dirs", "errors")))
        yield REJECTED.series(node, ((reason, sync.rejected[reason]) for reason in ("name", "switch")))
        restarts, lists = WATCH_RESTARTS.empty(), LISTS.empty()
        for watch, counters in sync.watch_counters.items():
            lists.add_metric([node, watch], counters["lists"])
            for key, count in sorted(counters.items()):
                if key == "relist_expired":
                    restarts.add_metric([node, watch, "expired"], count)
                elif key.startswith("error_"):
                    restarts.add_metric([node, watch, key.removeprefix("error_")], count)
        yield restarts
        yield lists
