"""The ClusterD sink's own families (the ones every sink has are agent.sinks.metrics'), rendered at scrape time."""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import Metric

from agent.common.families import counter, described, gauge
from agent.sinks.clusterd.sink import ClusterdSink

HELD = gauge("npu_agent_clusterd_public_faults",
             "Public faults ClusterD holds for this node, as far as it acknowledged")
RECONCILES = counter("npu_agent_clusterd_reconciles_total",
                     "Times the agent re-sent what ClusterD should hold (and recent recovers), by reason", "reason")
UNSENT = counter("npu_agent_clusterd_unsent_occurrences_total",
                 "Public fault occurrences that began and ended while waiting to be sent, so never sent")
CHECKS = counter("npu_agent_clusterd_saved_checks_total",
                 "Reads of ClusterD's saved faults before a re-assertion, by what they found: in_step (nothing "
                 "sent), differed (only the difference sent), unknown (everything re-sent)", "result")
FAMILIES = (HELD, RECONCILES, UNSENT, CHECKS)


class ClusterdCollector:
    def __init__(self, node: str, sink: ClusterdSink):
        self._node = node
        self._sink = sink

    def describe(self) -> list[Metric]:
        return described(FAMILIES)

    def collect(self) -> Iterable[Metric]:
        node, sink = self._node, self._sink
        yield HELD.one(node, sink.held)
        yield RECONCILES.counts(node, sink.reconciles)
        yield UNSENT.one(node, sink.unsent)
        yield CHECKS.counts(node, sink.checks)
