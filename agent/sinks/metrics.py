"""What every way out of the fault log reports, rendered at scrape time: the agent's own stream (the
hub's fan-out to subscribers) and each agent.model.Sink, whatever it is. A sink's own families are
its package's (agent.sinks.clusterd.metrics)."""

from __future__ import annotations

from typing import Iterable, Sequence

from prometheus_client.core import Metric

from agent.common.families import counter, described, gauge
from agent.faults.hub import FaultHub
from agent.model import Sink

REPORTS = counter("npu_agent_fault_reports_total", "Fault changes handed to each sink, by result", "sink", "result")
PENDING = gauge("npu_agent_outbox_pending",
                "Fault changes in the durable log not yet acknowledged by every sink's peer")
SUCCESS = gauge("npu_agent_sink_last_success_timestamp_seconds", "When the sink's peer last acknowledged a request",
                "sink")
SUBSCRIBERS = gauge("npu_agent_fault_stream_subscribers", "Open fault stream subscriptions")
FAMILIES = (REPORTS, PENDING, SUCCESS, SUBSCRIBERS)


class SinkCollector:
    """`stream`: the hub whose subscribers are the fault stream's."""

    def __init__(self, node: str, stream: FaultHub, sinks: Sequence[Sink]):
        self._node = node
        self._stream = stream
        self._sinks = tuple(sinks)

    def describe(self) -> list[Metric]:
        return described(FAMILIES)

    def collect(self) -> Iterable[Metric]:
        node, sinks = self._node, self._sinks
        reports = REPORTS.empty()
        for result in ("delivered", "resynced"):
            reports.add_metric([node, "stream", result], self._stream.counters[result])
        for sink in sinks:
            for result, count in sorted(sink.counters.items()):
                reports.add_metric([node, sink.name, result], count)
        yield reports
        if sinks:  # with no sink, nothing waits and nothing succeeds
            yield PENDING.one(node, max(sink.pending for sink in sinks))
            yield SUCCESS.series(node, ((sink.name, sink.last_success) for sink in sinks))
        yield SUBSCRIBERS.one(node, self._stream.subscribers)
