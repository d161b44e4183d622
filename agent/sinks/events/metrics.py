"""The Kubernetes Events sink's own families (the ones every sink has are agent.sinks.metrics'), rendered
at scrape time."""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import Metric

from agent.common.families import counter, described, gauge
from agent.sinks.events.sink import KubeEventsSink

RECORDED = counter("npu_agent_kube_events_total",
                   "Kubernetes Events the agent recorded (one per object: the node and each pod holding the NPU), "
                   "by reason, before aggregation and rate limiting", "reason")
DROPPED = counter("npu_agent_kube_events_dropped_total",
                  "Kubernetes Events not sent, by cause: rate_limited (the object's token bucket, as client-go's), "
                  "failed (refused, or failing after retries), queue_full, namespace_gone (the pod's namespace is being "
                  "deleted or does not exist)", "cause")
QUEUED = gauge("npu_agent_kube_events_queued", "Kubernetes Events waiting to be sent")
FAMILIES = (RECORDED, DROPPED, QUEUED)


class KubeEventsCollector:
    def __init__(self, node: str, sink: KubeEventsSink):
        self._node = node
        self._sink = sink

    def describe(self) -> list[Metric]:
        return described(FAMILIES)

    def collect(self) -> Iterable[Metric]:
        node, sink = self._node, self._sink
        yield RECORDED.counts(node, sink.recorded)
        yield DROPPED.counts(node, sink.dropped)
        yield QUEUED.one(node, sink.queued)
