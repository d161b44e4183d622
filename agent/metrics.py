"""Prometheus metrics, rendered at scrape time from the components' own state (a custom collector).

Nothing is pushed into metric objects as things happen: a device or code that is gone is simply not
rendered any more, so no series lingers.
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent import __version__, lifecycle as tasks
from agent.common import fsutil
from agent.devices.monitor import DeviceMonitor
from agent.faults.hub import FaultHub
from agent.faults.log import FaultLog
from agent.faults.service import FaultService
from agent.common.executor import Executor
from agent.model import Health, PodsOf, no_pods
from agent.telemetry.labels import CARD_LABELS, POD_LABELS, pod_labels

ERROR_CODE_FAMILIES = ("npu_chip_info_error_code", *(f"npu_chip_info_error_code_{n}" for n in range(1, 10)))
MACHINE_HEALTH = (
    (Health.HEALTHY, "machine_healthy_npu_nums", "Amount of healthy npu on the machine."),
    (Health.UNHEALTHY, "machine_unhealthy_npu_nums", "Amount of unhealthy npu on the machine."),
    (Health.UNKNOWN, "machine_unknown_npu_nums",
     "Amount of the npus whose health status cannot be obtained via DCMI interface on the machine."),
)


def _counts(name: str, documentation: str, node: str, label: str, counts: dict[str, int]) -> CounterMetricFamily:
    """A counter family with one series per key of `counts`."""
    family = CounterMetricFamily(name, documentation, labels=["node", label])
    for key, count in sorted(counts.items()):
        family.add_metric([node, key], count)
    return family


class AgentCollector:
    def __init__(self, node: str, monitor: DeviceMonitor, faults: FaultService, hub: FaultHub, fault_log: FaultLog,
                 sinks: list, components: Callable[[], list[tuple[str, bool]]],
                 pods: PodsOf = no_pods):
        self._node = node
        self._pods = pods
        self._log = fault_log
        self._sinks = sinks
        self._monitor = monitor
        self._faults = faults
        self._hub = hub
        self._components = components

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration time

    def collect(self) -> Iterable[Metric]:
        node = self._node
        devices = {d.phy_id: d for d in self._monitor.devices}
        states = self._faults.engine.states()

        # npu-exporter's families: its names, its label names and values, plus `node`.
        health = GaugeMetricFamily("npu_chip_info_health_status", "the npu health status",
                                   labels=["node", *CARD_LABELS])
        errors = [GaugeMetricFamily(name, "the npu error code", labels=["node", *CARD_LABELS])
                  for name in ERROR_CODE_FAMILIES]
        # The agent's own, with the same pod labels so they join with npu-exporter's series.
        fault = GaugeMetricFamily("npu_agent_device_fault", "1 for each active fault code, with the code's own level",
                                  labels=["node", "id", "fault_code", "fault_level", *POD_LABELS])
        level = GaugeMetricFamily("npu_agent_device_fault_level",
                                  "Rank of the device's worst fault level: NormalNPU 0 .. ManuallySeparateNPU 9",
                                  labels=["node", "id", *POD_LABELS])
        for state in states:
            device, info = str(state.phy_id), devices.get(state.phy_id)
            owner = pod_labels(self._pods(state.phy_id))
            identity = (info.model_name, info.vdie_id, info.pcie_bus_info) if info else ("", "", "")
            card = [node, device, *identity, *owner]
            health.add_metric(card, int(state.health))
            # npu-exporter shows the first ten, in the driver's order; codes the last poll did not list (an
            # event's since, or an escalation held after the code cleared) follow, by code.
            listed = {code: i for i, code in enumerate(self._monitor.code_order.get(state.phy_id, ()))}
            ordered = sorted(state.codes, key=lambda c: (listed.get(c.code, len(listed)), c.code))
            for family, code in zip(errors, ordered):
                family.add_metric(card, code.code)
            level.add_metric([node, device, *owner], int(state.level))
            for code in state.codes:
                fault.add_metric([node, device, code.text, code.level.name, *owner], 1)
        yield health
        yield from errors
        yield fault
        yield level

        npus = GaugeMetricFamily("machine_npu_nums", "Amount of npu installed on the machine.", labels=["node"])
        npus.add_metric([node], len(self._monitor.devices))
        yield npus
        # Every listed chip counts once, so the three add up to machine_npu_nums (one not yet read is unknown).
        healths = {state.phy_id: state.health for state in states}
        counted = {value: 0 for value in Health}
        for phy_id in devices:
            counted[healths.get(phy_id, Health.UNKNOWN)] += 1
        for value, name, documentation in MACHINE_HEALTH:
            family = GaugeMetricFamily(name, documentation, labels=["node"])
            family.add_metric([node], counted[value])
            yield family

        events = CounterMetricFamily("npu_agent_fault_events_total",
                                     "Fault events applied, from driver events and from polls that mended lost ones",
                                     labels=["node", "assertion"])
        for assertion in ("occur", "recover", "once"):
            events.add_metric([node, assertion], self._faults.engine.event_counts[assertion])
        yield events

        reports = CounterMetricFamily("npu_agent_fault_reports_total", "Fault changes handed to each sink, by result",
                                      labels=["node", "sink", "result"])
        reports.add_metric([node, "stream", "delivered"], self._hub.counters["delivered"])
        reports.add_metric([node, "stream", "resynced"], self._hub.counters["resynced"])
        for sink in self._sinks:
            for result, count in sorted(sink.counters.items()):
                reports.add_metric([node, sink.name, result], count)
        yield reports
        clusterd = [sink for sink in self._sinks if hasattr(sink, "reconciles")]
        if clusterd:
            held = GaugeMetricFamily("npu_agent_clusterd_public_faults",
                                     "Public faults ClusterD holds for this node, as far as it acknowledged",
                                     labels=["node"])
            held.add_metric([node], clusterd[0].held)
            reconciles = _counts("npu_agent_clusterd_reconciles_total",
                                 "Times the agent re-sent what ClusterD should hold (and recent recovers), by reason",
                                 node, "reason", clusterd[0].reconciles)
            unsent = CounterMetricFamily(
                "npu_agent_clusterd_unsent_occurrences_total",
                "Public fault occurrences that began and ended while waiting to be sent, so never sent",
                labels=["node"])
            unsent.add_metric([node], clusterd[0].unsent)
            yield held
            yield reconciles
            yield unsent
        yield _counts("npu_agent_task_restarts_total",
                      "Background tasks restarted after an unexpected error, by component/task",
                      node, "task", tasks.restarts)
        writes = CounterMetricFamily("npu_agent_state_write_failures_total",
                                     "Failed writes of state the agent keeps on disk (retried with backoff)",
                                     labels=["node", "file"])
        for write in [*self._faults.writes, *(sink.writes for sink in self._sinks if hasattr(sink, "writes"))]:
            writes.add_metric([node, write.what], write.failures)
        yield writes
        yield _counts("npu_agent_state_files_moved_aside_total",
                      "State files of the wrong shape moved aside at start (that part started fresh)",
                      node, "file", fsutil.moved_aside)
        clamped = CounterMetricFamily("npu_agent_driver_fault_times_clamped_total",
                                      "Driver fault times older than the agent's start, replaced by when it saw the fault",
                                      labels=["node"])
        clamped.add_metric([node], self._faults.clamped_times)
        yield clamped
        resets = GaugeMetricFamily("npu_agent_fault_log_reset",
                                   "1 when this start found the fault log lost or cut and began a new epoch",
                                   labels=["node"])
        resets.add_metric([node], 1 if self._log.resets else 0)
        yield resets

        revision = GaugeMetricFamily("npu_agent_fault_log_revision", "Revision of the last change in the durable fault log",
                                     labels=["node"])
        revision.add_metric([node], self._log.revision)
        yield revision
        if self._sinks:
            pending = GaugeMetricFamily("npu_agent_outbox_pending",
                                        "Fault changes in the durable log not yet acknowledged by every sink's peer",
                                        labels=["node"])
            pending.add_metric([node], max(sink.pending for sink in self._sinks))
            success = GaugeMetricFamily("npu_agent_sink_last_success_timestamp_seconds",
                                        "When the sink's peer last acknowledged a request", labels=["node", "sink"])
            for sink in self._sinks:
                success.add_metric([node, sink.name], sink.last_success)
            yield pending
            yield success

        subscribers = GaugeMetricFamily("npu_agent_fault_stream_subscribers", "Open fault stream subscriptions",
                                        labels=["node"])
        subscribers.add_metric([node], self._hub.subscribers)
        yield subscribers

        counters = self._monitor.counters
        driver = CounterMetricFamily("npu_agent_driver_events_total",
                                     "Driver fault events received; rate_limited ones were mended by a poll, skipped "
                                     "ones named an unknown device or assertion", labels=["node", "result"])
        driver.add_metric([node, "accepted"], counters["events"] - counters["events_dropped"])
        driver.add_metric([node, "rate_limited"], counters["events_dropped"])
        driver.add_metric([node, "skipped"], counters["events_skipped"])
        yield driver
        polls = CounterMetricFamily("npu_agent_device_polls_total", "Device polls (health and error codes)",
                                    labels=["node"])
        polls.add_metric([node], counters["polls"])
        yield polls
        timeouts = CounterMetricFamily("npu_agent_driver_call_timeouts_total",
                                       "Driver calls that did not return within devices.call_timeout_seconds",
                                       labels=["node"])
        timeouts.add_metric([node], counters["call_timeouts"])
        yield timeouts
        fault_events_ok = GaugeMetricFamily("npu_agent_driver_events_subscribed",
                                            "1 when the driver delivers fault events, 0 when only polling works",
                                            labels=["node"])
        fault_events_ok.add_metric([node], 0 if (self._monitor.events_error or not self._monitor.devices) else 1)
        yield fault_events_ok

        reloads = CounterMetricFamily("npu_agent_fault_rule_reloads_total",
                                      "Reloads of the fault-code and customization files", labels=["node", "result"])
        for result, count in self._faults.reloads.items():
            reloads.add_metric([node, result], count)
        yield reloads

        ready = GaugeMetricFamily("npu_agent_component_ready", "1 when the component is ready", labels=["node", "component"])
        for name, ok in self._components():
            ready.add_metric([node, name], 1 if ok else 0)
        yield ready

        info = GaugeMetricFamily("npu_agent_build_info", "Version of the running agent", labels=["node", "version"])
        info.add_metric([node, __version__], 1)
        yield info


def make_registry(*collectors) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return registry


class ExecutorCollector:
    """The executor for blocking calls (agent.common.executor): its threads and each lane's calls."""

    def __init__(self, node: str, executor: Executor):
        self._node = node
        self._executor = executor

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        node, lanes = self._node, self._executor.lanes
        threads = GaugeMetricFamily("npu_agent_executor_threads", "Threads running blocking calls (driver, files, "
                                    "Kubernetes client); started on demand, ended after a minute idle", labels=["node"])
        threads.add_metric([node], self._executor.threads)
        yield threads
        calls = GaugeMetricFamily("npu_agent_executor_calls", "Blocking calls by lane and state: running, waiting for "
                                  "their turn, stuck (given up on by their caller, still holding a thread)",
                                  labels=["node", "lane", "state"])
        for lane in lanes:
            for state, count in (("running", lane.running), ("waiting", len(lane.waiting)), ("stuck", lane.stuck)):
                calls.add_metric([node, lane.purpose, state], count)
        yield calls
        yield _counts("npu_agent_executor_call_timeouts", "Blocking calls whose caller's time-out passed (dropped "
                      "if not started, else left stuck)", node, "lane",
                      {lane.purpose: lane.counters["timeouts"] for lane in lanes})
        yield _counts("npu_agent_executor_calls_refused", "Blocking calls refused at once because an earlier call "
                      "with the same key (a device, a watch) is still stuck", node, "lane",
                      {lane.purpose: lane.counters["refused"] for lane in lanes})

