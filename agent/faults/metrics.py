"""The devices' fault state and the fault pipeline's own counters, rendered at scrape time.

Nothing is pushed into metric objects as things happen: a device or code that is gone is simply not
rendered any more, so no series lingers."""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import Metric

from agent.common.families import counter, described, gauge
from agent.devices.monitor import DeviceMonitor
from agent.faults.log import FaultLog
from agent.faults.service import FaultService
from agent.model import Health, PodsOf, no_pods
from agent.telemetry.labels import CARD_LABELS, POD_LABELS, pod_labels

# npu-exporter's families: its names, its label names and values, plus `node`.
HEALTH = gauge("npu_chip_info_health_status", "the npu health status", *CARD_LABELS)
ERROR_CODES = tuple(gauge(name, "the npu error code", *CARD_LABELS)
                    for name in ("npu_chip_info_error_code", *(f"npu_chip_info_error_code_{n}" for n in range(1, 10))))
# The agent's own, with the same pod labels so they join with npu-exporter's series.
FAULT = gauge("npu_agent_device_fault", "1 for each active fault code, with the code's own level",
              "id", "fault_code", "fault_level", *POD_LABELS)
LEVEL = gauge("npu_agent_device_fault_level",
              "Rank of the device's worst fault level: NormalNPU 0 .. ManuallySeparateNPU 9", "id", *POD_LABELS)
NPUS = gauge("machine_npu_nums", "Amount of npu installed on the machine.")
MACHINE_HEALTH = (
    (Health.HEALTHY, gauge("machine_healthy_npu_nums", "Amount of healthy npu on the machine.")),
    (Health.UNHEALTHY, gauge("machine_unhealthy_npu_nums", "Amount of unhealthy npu on the machine.")),
    (Health.UNKNOWN, gauge("machine_unknown_npu_nums", "Amount of the npus whose health status cannot be obtained "
                           "via DCMI interface on the machine.")),
)
EVENTS = counter("npu_agent_fault_events_total",
                 "Fault events applied, from driver events and from polls that mended lost ones", "assertion")
CLAMPED = counter("npu_agent_driver_fault_times_clamped_total",
                  "Driver fault times older than the agent's start, replaced by when it saw the fault")
RELOADS = counter("npu_agent_fault_rule_reloads_total", "Reloads of the fault-code and customization files", "result")
FAMILIES = (HEALTH, *ERROR_CODES, FAULT, LEVEL, NPUS, *(family for _, family in MACHINE_HEALTH), EVENTS, CLAMPED,
            RELOADS)

RESET = gauge("npu_agent_fault_log_reset", "1 when this start found the fault log lost or cut and began a new epoch")
REVISION = gauge("npu_agent_fault_log_revision", "Revision of the last change in the durable fault log")


class FaultCollector:
    """Each device's fault state (npu-exporter's families and the agent's), the machine's NPU counts,
    and what the fault service counted: events, clamped times, rule reloads."""

    def __init__(self, node: str, monitor: DeviceMonitor, faults: FaultService, pods: PodsOf = no_pods):
        self._node = node
        self._monitor = monitor
        self._faults = faults
        self._pods = pods

    def describe(self) -> list[Metric]:
        return described(FAMILIES)

    def collect(self) -> Iterable[Metric]:
        node = self._node
        devices = {d.phy_id: d for d in self._monitor.devices}
        states = self._faults.states()
        health, fault, level = HEALTH.empty(), FAULT.empty(), LEVEL.empty()
        errors = [family.empty() for family in ERROR_CODES]
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

        yield NPUS.one(node, len(self._monitor.devices))
        # Every listed chip counts once, so the three add up to machine_npu_nums (one not yet read is unknown).
        healths = {state.phy_id: state.health for state in states}
        counted = {value: 0 for value in Health}
        for phy_id in devices:
            counted[healths.get(phy_id, Health.UNKNOWN)] += 1
        for value, family in MACHINE_HEALTH:
            yield family.one(node, counted[value])

        events = self._faults.event_counts
        yield EVENTS.series(node, ((assertion, events[assertion]) for assertion in ("occur", "recover", "once")))
        yield CLAMPED.one(node, self._faults.clamped_times)
        yield RELOADS.series(node, self._faults.reloads.items())


class FaultLogCollector:
    """The durable fault log: its revision, and whether this start found it lost or cut."""

    def __init__(self, node: str, fault_log: FaultLog):
        self._node = node
        self._log = fault_log

    def describe(self) -> list[Metric]:
        return described((RESET, REVISION))

    def collect(self) -> Iterable[Metric]:
        yield RESET.one(self._node, 1 if self._log.resets else 0)
        yield REVISION.one(self._node, self._log.revision)
