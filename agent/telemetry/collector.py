"""Renders the telemetry the sampler holds under npu-exporter's names, labels and values (plus `node`).

Samples carry no timestamp: npu-exporter stamps each with its collection time, which keeps Prometheus
from marking a vanished series stale; here a series that is no longer collected simply ends.
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily, Metric

from agent.common.families import counter, described, gauge
from agent.model import DeviceInfo, PodsOf
from agent.telemetry.families import BY_NAME, FAMILIES
from agent.telemetry.labels import POD_LABELS, pod_labels
from agent.telemetry.sampler import TelemetrySampler

# Per-chip families npu-exporter fills only for a chip held by exactly one container: (family, from family).
CONTAINER_COPIES = (("container_npu_utilization", "npu_chip_info_utilization"),
                    ("container_npu_total_memory", "npu_chip_info_hbm_total_memory"),
                    ("container_npu_used_memory", "npu_chip_info_hbm_used_memory"))
CONTAINER_SOURCES = {source for _, source in CONTAINER_COPIES} | {"npu_chip_info_process_info"}

# The agent's own, about the sampler.
READS = counter("npu_agent_telemetry_reads_total", "Telemetry reads (one chip, one part of a group) by result: ok, "
                "timeout (no answer in time), refused (the previous read of that chip still stuck), error",
                "group", "result")
SPENT = counter("npu_agent_telemetry_collection_seconds_total", "Wall time spent collecting each telemetry group",
                "group")
UNSUPPORTED = gauge("npu_agent_telemetry_unsupported", "1 for each driver function or tool command a chip does not "
                    "support (not called again)", "id", "function")


class TelemetryCollector:
    def __init__(self, node: str, sampler: TelemetrySampler, devices: Callable[[], list[DeviceInfo]], pods: PodsOf):
        self._node = node
        self._sampler = sampler
        self._devices = devices
        self._pods = pods

    def describe(self) -> list[Metric]:
        return [self._family(family.name) for family in FAMILIES] + described((READS, SPENT, UNSUPPORTED))

    def _family(self, name: str) -> GaugeMetricFamily:
        family = BY_NAME[name]
        return GaugeMetricFamily(name, family.help, labels=["node", *family.card, *family.extra])

    def collect(self) -> Iterable[Metric]:
        node, families = self._node, {}

        def add(name: str, labels: list[str], value: float) -> None:
            if name not in families:
                families[name] = self._family(name)
            families[name].add_metric(labels, value)

        devices = self._devices()
        cards: dict[int, list[str]] = {}
        holders = {device.logic_id: self._pods(device.phy_id) for device in devices}
        for device in devices:
            owner = pod_labels(holders[device.logic_id])
            identity = [device.model_name, device.vdie_id, device.pcie_bus_info]
            card = cards[device.logic_id] = [node, str(device.phy_id), *identity, *owner]
            add("npu_chip_info_name", card, 1)  # npu-exporter's `name` label holds the model name
        kept: dict[int, dict[str, list]] = {}  # logic id -> samples the container families are made of
        for (logic, _read), samples in list(self._sampler.samples.items()):
            card = cards.get(logic)
            if card is not None:
                for name, extra, value in samples:
                    if name == "npu_chip_info_process_info" and not extra[1]:
                        # a process in no container (a host process): npu-exporter clears its pod labels
                        add(name, [*card[:-len(POD_LABELS)], *("",) * len(POD_LABELS), *extra], value)
                    else:
                        add(name, [*card, *extra], value)
                    if name in CONTAINER_SOURCES:
                        kept.setdefault(logic, {}).setdefault(name, []).append((extra, value))
        # Container families and the chip -> container table, for chips with exactly one container.
        for device in devices:
            pods = holders[device.logic_id]
            if len(pods) != 1:
                continue
            card, pod, chip = cards[device.logic_id], pods[0], kept.get(device.logic_id, {})
            for name, source in CONTAINER_COPIES:
                for _extra, value in chip.get(source, ()):
                    add(name, card, value)
            processes = chip.get("npu_chip_info_process_info", ())
            container_id = next((extra[1] for extra, _value in processes if extra[1]), "")  # (pid, container id)
            add("npu_container_info", [*card, container_id, f"{pod.namespace}_{pod.pod}_{pod.container}"], 1)
        if devices:
            add("machine_card_nums", [node], len({device.card_id for device in devices}))
        for name, extra, value in self._sampler.node_samples:
            add(name, [node, *extra], value)
        for family in FAMILIES:  # the table's order; families with no sample are left out, as npu-exporter does
            if family.name in families:
                yield families[family.name]
        yield from self._own()

    def _own(self) -> Iterable[Metric]:
        node, sampler = self._node, self._sampler
        reads = READS.empty()
        for (group, result), count in sorted(sampler.results.items()):
            reads.add_metric([node, group, result], count)
        yield reads
        yield SPENT.series(node, ((group, sampler.seconds[group]) for group in sampler.groups))
        unsupported = UNSUPPORTED.empty()
        for phy, function in sampler.unsupported():
            unsupported.add_metric([node, str(phy), function], 1)
        yield unsupported
