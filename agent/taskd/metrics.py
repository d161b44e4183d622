"""Metrics of the TaskD proxy, rendered at scrape time from its state.

A job is labelled `job_id` (its MINDX_TASK_ID), never `job`: that is Prometheus's own target label,
which a scrape with honorLabels would let the agent's value overwrite."""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.taskd.proxy import TaskdProxy

DIRECTIONS = ("up", "down", "local")
RESULTS = ("delivered", "not_delivered", "no_route", "invalid", "refused", "duplicate")


class TaskdProxyCollector:
    def __init__(self, node: str, proxy: TaskdProxy):
        self._node = node
        self._proxy = proxy

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        node, proxy = self._node, self._proxy
        messages = CounterMetricFamily(
            "npu_agent_taskd_proxy_messages_total",
            "TaskNet messages through the node proxy: up (to a manager), down (from a manager), local "
            "(worker to worker); result delivered, not_delivered, no_route, invalid, refused (by the manager), "
            "duplicate (a further copy of a broadcast, dropped)",
            labels=["node", "direction", "result"])
        for direction in DIRECTIONS:
            for result in RESULTS:
                messages.add_metric([node, direction, result], proxy.messages[direction, result])
        yield messages
        refused = CounterMetricFamily("npu_agent_taskd_proxy_connections_refused_total",
                                      "Calls refused because the caller is not a process of a training job",
                                      labels=["node"])
        refused.add_metric([node], sum(proxy.refused.values()))
        yield refused
        held_bytes = GaugeMetricFamily("npu_agent_taskd_proxy_buffer_bytes",
                                       "Bytes of messages the proxy holds now (to a manager or queued for a worker)",
                                       labels=["node", "job_id"])
        overflows = CounterMetricFamily("npu_agent_taskd_proxy_overflows_total",
                                        "Messages refused with RecvBufBusy (5001): the job's or the node's buffer "
                                        "(bytes), a manager's held queue or a worker's stream queue was full",
                                        labels=["node", "job_id"])
        connected = GaugeMetricFamily("npu_agent_taskd_proxy_connected",
                                      "Processes with an open TaskNet stream, by job and role",
                                      labels=["node", "job_id", "role"])
        held = GaugeMetricFamily("npu_agent_taskd_proxy_queue_depth",
                                 "Messages held for a job's unreachable manager", labels=["node", "job_id"])
        up = GaugeMetricFamily("npu_agent_taskd_proxy_manager_up", "1 when the link to the job's TaskD manager is "
                               "established", labels=["node", "job_id"])
        reconnects = CounterMetricFamily("npu_agent_taskd_proxy_manager_connects_total",
                                         "Links established to the job's manager (registration and path replay done)",
                                         labels=["node", "job_id"])
        for job in list(proxy.jobs.values()):
            roles = {"Worker": 0, "Agent": 0}
            for pos in job.downstreams:
                roles[pos.role] = roles.get(pos.role, 0) + 1
            for role, count in roles.items():
                connected.add_metric([node, job.name, role], count)
            held.add_metric([node, job.name], len(job.link.held))
            up.add_metric([node, job.name], 1 if job.link.connected else 0)
            reconnects.add_metric([node, job.name], job.link.counters.connects)
            held_bytes.add_metric([node, job.name], proxy.budget.used[job.name])
            overflows.add_metric([node, job.name], proxy.overflows[job.name])
        yield from (connected, held, up, reconnects, held_bytes, overflows)
