"""The telemetry sampler and collector: groups on their own intervals, hung and failing reads, rendering."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.common.executor import Executor
from agent.metrics import make_registry
from agent.model import DeviceInfo, PodRef
from agent.telemetry.collector import TelemetryCollector
from agent.telemetry.families import BY_NAME
from agent.telemetry.labels import MULTI_POD
from agent.telemetry.sampler import TelemetrySampler
from testkit.wait import until

DEVICES = [DeviceInfo(i, 7 - i, i // 2, i % 2, "910B3", "910B3-Ascend-V1", f"VDIE-{i}", f"0000:0{i}:00.0")
           for i in range(2)]


CONTAINER = "c0ffee" * 10 + "c0fe"  # a container id: 64 hex digits


class Source:
    """Answers every read at once, or blocks the reads named in `hold` until released, or raises for `broken`."""

    name = "test"

    def __init__(self):
        self.calls: Counter[tuple[int, str]] = Counter()
        self.hold: dict[str, threading.Event] = {}
        self.broken: set[str] = set()

    def reads(self, device):
        return ("utilization", "network_health", "sensors", "processes", "hbm", "hccs")

    def read(self, device, read):
        self.calls[(device.phy_id, read)] += 1
        if read in self.hold:
            self.hold[read].wait(10)
        if read in self.broken:
            raise ValueError("a bug")
        return {"utilization": [("npu_chip_info_utilization", (), 50.0 + device.phy_id)],
                "network_health": [("npu_chip_info_network_status", (), 1.0)],
                "sensors": [("npu_chip_info_temperature", (), 40.0), ("npu_chip_info_power", (), 185.3),
                            ("npu_chip_info_serial_number", ("SN1",), 1.0)],
                "processes": [("npu_chip_info_process_info", ("100", CONTAINER), 1024.0),  # in the chip's container
                              ("npu_chip_info_process_info", ("200", ""), 10.0),  # on the host
                              ("npu_chip_info_process_info_num", (), 2.0)],
                "hbm": [("npu_chip_info_hbm_total_memory", (), 65536.0),
                        ("npu_chip_info_hbm_used_memory", (), 1000.0)],
                "hccs": [("npu_chip_info_hccs_bandwidth_info_total_tx", (), 3.5)]}[read]

    def read_timeout(self, read, call_timeout_s):
        return call_timeout_s

    def node(self):
        return [("node_base_info", ("v", "24.1.rc3"), 1.0)]

    def unsupported(self):
        return [(7, "dcmi_get_device_voltage")]


def sampler_for(source, executor, **intervals):
    defaults = dict(utilization=1, npu=1, hbm=0, hccs=1, pcie=0, sio=0, network=0, roce=0, optical=0)
    return TelemetrySampler([source], lambda: DEVICES, lane=executor.lane("telemetry", 2, 8),
                            intervals={**defaults, **intervals}, call_timeout_s=0.3)


def scrape(sampler, pods=lambda phy: ()) -> dict:
    text = generate_latest(make_registry(TelemetryCollector("n1", sampler, lambda: DEVICES, pods))).decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def values(families, name) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in families[name].samples}


def test_groups_run_on_their_own_intervals_and_a_group_at_zero_is_off():
    async def main():
        source, executor = Source(), Executor()
        sampler = sampler_for(source, executor, utilization=0.2, npu=5)
        await sampler.start()
        try:
            await until(lambda: source.calls[(7, "utilization")] >= 3, 10, "three utilization rounds")
            assert source.calls[(7, "sensors")] == 1  # npu every 5 s: one round so far
            assert source.calls[(7, "hbm")] == 0  # hbm: 0 turns the group off
            assert "hbm" not in sampler.groups
        finally:
            await sampler.stop()

    asyncio.run(main())


def test_a_hung_read_reads_unknown_is_not_called_again_while_stuck_and_holds_up_nothing_else():
    async def main():
        source, executor = Source(), Executor()
        source.hold["network_health"] = threading.Event()
        source.hold["hccs"] = threading.Event()
        sampler = sampler_for(source, executor, utilization=0.2, npu=0.5, hccs=0.5)  # rounds sooner than 1 s apart
        await sampler.start()
        try:
            # network health: npu-exporter's failure value -1; hccs: every value -1
            await until(lambda: sampler.results[("npu", "timeout")] >= 2 and sampler.results[("hccs", "timeout")] >= 2,
                        10, "network health and hccs timed out")
            families = scrape(sampler)
            assert set(values(families, "npu_chip_info_network_status").values()) == {-1.0}
            assert set(values(families, "npu_chip_info_hccs_bandwidth_info_total_tx").values()) == {-1.0}
            # the other reads of the group and other groups go on
            assert values(families, "npu_chip_info_temperature")
            rounds = source.calls[(7, "utilization")]
            await until(lambda: source.calls[(7, "utilization")] >= rounds + 2, 10, "utilization goes on")
            # while stuck, the next read of that chip and kind is refused without a call
            await until(lambda: sampler.results[("npu", "refused")] >= 2, 10, "the stuck read refused")
            assert source.calls[(7, "network_health")] == 1
            source.hold.pop("network_health").set()
            source.hold.pop("hccs").set()
            await until(lambda: set(values(scrape(sampler), "npu_chip_info_network_status").values()) == {1.0}, 10,
                        "network health read again once the call returned")
        finally:
            for event in source.hold.values():
                event.set()
            await sampler.stop()

    asyncio.run(main())


def test_a_read_that_raises_costs_that_read_only():
    async def main():
        source, executor = Source(), Executor()
        source.broken.add("sensors")
        sampler = sampler_for(source, executor)
        await sampler.start()
        try:
            await until(lambda: sampler.results[("npu", "error")] >= 2, 10, "the broken read counted")
            families = scrape(sampler)
            assert "npu_chip_info_temperature" not in families  # omitted, as npu-exporter omits a failed reading
            assert values(families, "npu_chip_info_network_status")
            assert not sampler.tasks.problem
        finally:
            await sampler.stop()

    asyncio.run(main())


def test_rendering_card_labels_pods_container_families_and_node_families():
    async def main():
        source, executor = Source(), Executor()
        sampler = sampler_for(source, executor, hbm=1)
        pods = {7: (PodRef("ns", "train-0", "main"),), 6: (PodRef("ns", "a", "c"), PodRef("ns", "b", "c"))}
        await sampler.start()
        try:
            reads = len(DEVICES) * len(source.reads(None))  # every (chip, read) pair: a scrape before one is missing omits it
            await until(lambda: sampler.node_samples and len(sampler.samples) == reads, 10, "every read once")
            families = scrape(sampler, lambda phy: pods.get(phy, ()))
        finally:
            await sampler.stop()
        temperature = families["npu_chip_info_temperature"]
        assert temperature.type == "gauge" and temperature.documentation == BY_NAME[temperature.name].help
        one = {s.labels["id"]: s.labels for s in temperature.samples}
        assert one["7"] == {"node": "n1", "id": "7", "model_name": "910B3-Ascend-V1", "vdie_id": "VDIE-0",
                            "pcie_bus_info": "0000:00:00.0", "namespace": "ns", "pod_name": "train-0",
                            "container_name": "main"}
        assert one["6"]["pod_name"] == MULTI_POD
        assert {s.labels["serial_number"] for s in families["npu_chip_info_serial_number"].samples} == {"SN1"}
        assert {s.labels["name"] for s in families["npu_chip_info_name"].samples} == {"910B3-Ascend-V1"}
        # container families: only the chip with exactly one container
        assert [(s.labels["id"], s.value) for s in families["container_npu_utilization"].samples] == [("7", 57.0)]
        assert [s.value for s in families["container_npu_total_memory"].samples] == [65536.0]
        info = families["npu_container_info"].samples
        assert [(s.labels["npuID"], s.labels["containerName"], s.labels["containerID"]) for s in info] == [
            ("7", "ns_train-0_main", CONTAINER)]
        # A process in the chip's container has the chip's pod labels; a host process none, as in npu-exporter.
        processes = {s.labels["process_id"]: (s.labels["namespace"], s.labels["pod_name"], s.labels["container_name"])
                     for s in families["npu_chip_info_process_info"].samples if s.labels["id"] == "7"}
        assert processes == {"100": ("ns", "train-0", "main"), "200": ("", "", "")}
        assert [(s.labels["pod_name"], s.value) for s in families["npu_chip_info_process_info_num"].samples
                if s.labels["id"] == "7"] == [("train-0", 2.0)]
        assert values(families, "machine_card_nums") == {(("node", "n1"),): 1.0}
        assert [s.labels for s in families["node_base_info"].samples] == [
            {"node": "n1", "exporterVersion": "v", "driverVersion": "24.1.rc3"}]
        assert [s.labels for s in families["npu_agent_telemetry_unsupported"].samples] == [
            {"node": "n1", "id": "7", "function": "dcmi_get_device_voltage"}]

    asyncio.run(main())
