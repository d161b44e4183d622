"""Metrics of the TaskD proxy, rendered at scrape time from its state.

A job is labelled `job_id` (its MINDX_TASK_ID), never `job`: that is Prometheus's own target label,
which a scrape with honorLabels would let the agent's value overwrite."""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import Metric

from agent.common.families import counter, described, gauge
from agent.taskd.proxy import TaskdProxy

DIRECTIONS = ("up", "down", "local")
RESULTS = ("delivered", "not_delivered", "no_route", "invalid", "refused", "duplicate")

MESSAGES = counter("npu_agent_taskd_proxy_messages_total",
                   "TaskNet messages through the node proxy: up (to a manager), down (from a manager), local "
                   "(worker to worker); result delivered, not_delivered, no_route, invalid, refused (by the manager), "
                   "duplicate (a further copy of a broadcast, dropped)", "direction", "result")
REFUSED = counter("npu_agent_taskd_proxy_connections_refused_total",
                  "Calls refused because the caller is not a process of a training job")
BUFFER_BYTES = gauge("npu_agent_taskd_proxy_buffer_bytes",
                     "Bytes of messages the proxy holds now (to a manager or queued for a worker)", "job_id")
OVERFLOWS = counter("npu_agent_taskd_proxy_overflows_total",
                    "Messages refused with RecvBufBusy (5001): the job's or the node's buffer (bytes), a manager's "
                    "held queue or a worker's stream queue was full", "job_id")
CONNECTED = gauge("npu_agent_taskd_proxy_connected", "Processes with an open TaskNet stream, by job and role",
                  "job_id", "role")
QUEUE_DEPTH = gauge("npu_agent_taskd_proxy_queue_depth", "Messages held for a job's unreachable manager", "job_id")
MANAGER_UP = gauge("npu_agent_taskd_proxy_manager_up", "1 when the link to the job's TaskD manager is established",
                   "job_id")
CONNECTS = counter("npu_agent_taskd_proxy_manager_connects_total",
                   "Links established to the job's manager (registration and path replay done)", "job_id")
FAMILIES = (MESSAGES, REFUSED, CONNECTED, QUEUE_DEPTH, MANAGER_UP, CONNECTS, BUFFER_BYTES, OVERFLOWS)


class TaskdProxyCollector:
    def __init__(self, node: str, proxy: TaskdProxy):
        self._node = node
        self._proxy = proxy

    def describe(self) -> list[Metric]:
        return described(FAMILIES)

    def collect(self) -> Iterable[Metric]:
        node, proxy = self._node, self._proxy
        messages = MESSAGES.empty()
        for direction in DIRECTIONS:
            for result in RESULTS:
                messages.add_metric([node, direction, result], proxy.messages[direction, result])
        yield messages
        yield REFUSED.one(node, sum(proxy.refused.values()))
        connected, held, up, reconnects, held_bytes, overflows = (
            family.empty() for family in (CONNECTED, QUEUE_DEPTH, MANAGER_UP, CONNECTS, BUFFER_BYTES, OVERFLOWS))
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
