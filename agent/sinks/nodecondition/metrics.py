"""The node condition's own family (the ones every sink has are agent.sinks.metrics'), rendered at scrape time."""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import Metric

from agent.common.families import described, gauge
from agent.sinks.nodecondition.sink import NodeConditionSink

STATUS = gauge("npu_agent_node_condition",
               "1 for the status of the node's NPUProblem condition the agent last wrote (True: a fault interrupts the "
               "workload on an NPU), 0 for the others; all 0 before its first write", "status")
FAMILIES = (STATUS,)


class NodeConditionCollector:
    def __init__(self, node: str, sink: NodeConditionSink):
        self._node = node
        self._sink = sink

    def describe(self) -> list[Metric]:
        return described(FAMILIES)

    def collect(self) -> Iterable[Metric]:
        written = self._sink.written
        status = written.status if written else ""
        yield STATUS.series(self._node, ((value, float(value == status)) for value in ("True", "False", "Unknown")))
