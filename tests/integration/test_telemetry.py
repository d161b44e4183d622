"""npu-exporter's telemetry families from the real agent on the fake libdcmi.so and the fake hccn_tool: names,
types, labels and values for set inputs (scaled as npu-exporter scales them), npu-exporter's failure values, hung
calls that leave fault detection alone, functions a chip does not support, and pods on the series."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.telemetry.families import FAMILIES, GROUPS
from testkit.fakes.hccn import FakeHccn
from testkit.fakes.kubelet.podresources import PodResourcesStandIn
from testkit.wait import wait_until
from tests.integration.conftest import CARDS, phy

EVERY_SECOND = {group.name: 1 for group in GROUPS}
A3_ONLY = {"npu_chip_info_sio_crc_tx_err_cnt", "npu_chip_info_sio_crc_rx_err_cnt"}
A2_ONLY = {f.name for f in FAMILIES if f.group == "pcie"}
HCCS_LINK = {x: {f.name for f in FAMILIES if f.group == "hccs" and f.name.endswith(f"_{x}")} for x in range(8)}
MIB = 1 << 20


def scrape(agent) -> dict[str, tuple[str, list[tuple[dict, float]]]]:
    """{family: (type, [(labels, value), ...])} of one scrape."""
    status, text = agent.http("/metrics")
    assert status == 200
    return {family.name: (family.type, [(dict(s.labels), s.value) for s in family.samples])
            for family in text_string_to_metric_families(text)}


def of_chip(scraped, name: str, logic: int) -> dict[tuple, float]:
    """{extra label values: value} of one family for one chip (extra = labels beyond node and the card labels)."""
    card = {"node", "id", "model_name", "name", "vdie_id", "pcie_bus_info", "namespace", "pod_name", "container_name"}
    return {tuple(v for k, v in sorted(labels.items()) if k not in card): value
            for labels, value in scraped.get(name, ("", []))[1] if labels.get("id") == str(phy(logic))}


def value(scraped, name: str, logic: int) -> float | None:
    return of_chip(scraped, name, logic).get(())


@pytest.fixture
def telemetry_agent(start_agent, tmp_path):
    hccn = FakeHccn(tmp_path / "hccn", chips=CARDS)

    def start(**kwargs):
        telemetry = {"enabled": True, "hccn_tool": str(hccn.path), "intervals": EVERY_SECOND}
        agent, fake = start_agent(devices={"poll_interval_seconds": 1, "call_timeout_seconds": 1,
                                           **kwargs.pop("devices", {})}, telemetry=telemetry, **kwargs)
        return agent, fake, hccn

    return start


def test_every_default_family_with_npu_exporters_names_labels_and_scaled_values(telemetry_agent, short_dir):
    kubelet = PodResourcesStandIn(short_dir / "kubelet.sock")
    kubelet.set_pods(("team-a", "train-0", "main", "huawei.com/Ascend910", [f"Ascend910-{phy(0)}"]))
    with kubelet:
        agent, fake, hccn = telemetry_agent(kubernetes={"pod_resources_socket": str(kubelet.socket_path),
                                                        "pod_resources_refresh_seconds": 0.5})
        for field, raw in (("temperature", 52), ("power", 1853), ("voltage", 88), ("aicore_freq", 1750),
                           ("util.aicore", 61), ("util.vector", 32), ("util.cube", 58), ("util.overall", 64),
                           ("util.hbm", 23), ("hbm.total", 65536), ("hbm.used", 40960), ("hbm.temp", 41), ("hbm.bw", 17),
                           ("ecc.single_bit_error_cnt", 3), ("ecc.total_double_bit_error_cnt", 1),
                           ("hccs.tx.1", 5_000_000_000), ("hccs.crc.7", 2), ("hccs_bw.tx.1", 1.5), ("hccs_bw.rx.7", 3.25),
                           ("pcie.rx_p_bw.0", 11), ("pcie.rx_p_bw.1", 33), ("pcie.rx_p_bw.2", 22)):
            fake.tele(0, field, raw)
        fake.procs(0, [(4242, 3 * MIB), (4243, 512 * MIB)])
        fake.serial(0, "102400001234")
        hccn.set_stat(phy(0), roce_rx_all_pkt_num=7, mac_rx_fcs_err_pkt_num=2)

        def complete():
            scraped = scrape(agent)
            return scraped if value(scraped, "npu_chip_info_temperature", 0) == 52 and all(
                f.name in scraped for f in FAMILIES if f.name not in A3_ONLY | HCCS_LINK[0]) and value(
                scraped, "npu_chip_info_hccs_bandwidth_info_tx_1", 0) == 1.5 else None

        scraped = wait_until(complete, 15, "every family with the values set")

    # An A2 board: HCCS links 1-7, as npu-exporter exports them there.
    assert {f.name for f in FAMILIES if f.name in scraped} == {f.name for f in FAMILIES} - A3_ONLY - HCCS_LINK[0]
    assert all(scraped[f.name][0] == "gauge" for f in FAMILIES if f.name in scraped)  # npu-exporter: gauges only
    labels, _ = next(s for s in scraped["npu_chip_info_temperature"][1] if s[0]["id"] == str(phy(0)))
    assert set(labels) == {"node", "id", "model_name", "vdie_id", "pcie_bus_info", "namespace", "pod_name",
                           "container_name"}
    assert (labels["namespace"], labels["pod_name"], labels["container_name"]) == ("team-a", "train-0", "main")
    expected = {
        "npu_chip_info_temperature": 52,
        "npu_chip_info_aicore_current_freq": 1750, "npu_chip_info_network_status": 1,
        "npu_chip_info_utilization": 61, "npu_chip_info_vector_utilization": 32,
        "npu_chip_info_cube_utilization": 58, "npu_chip_info_overall_utilization": 64,
        "container_npu_utilization": 61, "npu_chip_info_hbm_utilization": 23,
        "npu_chip_info_hbm_total_memory": 65536, "npu_chip_info_hbm_used_memory": 40960,
        "container_npu_total_memory": 65536, "container_npu_used_memory": 40960,
        "npu_chip_info_hbm_temperature": 41, "npu_chip_info_hbm_bandwidth_utilization": 17,
        "npu_chip_info_hbm_ecc_enable_flag": 1, "npu_chip_info_hbm_ecc_single_bit_error_cnt": 3,
        "npu_chip_info_hbm_ecc_total_double_bit_error_cnt": 1, "npu_chip_info_hbm_ecc_double_bit_error_cnt": 0,
        "npu_chip_info_hccs_statistic_info_tx_cnt_1": 5_000_000_000,  # the u64 sub-command: no wrap at 2^32
        "npu_chip_info_hccs_statistic_info_crc_err_cnt_7": 2,
        "npu_chip_info_hccs_bandwidth_info_tx_1": 1.5, "npu_chip_info_hccs_bandwidth_info_rx_7": 3.25,
        "npu_chip_info_hccs_bandwidth_info_profiling_time": 200,
        "npu_chip_info_link_status": 1, "npu_chip_roce_rx_all_pkt_num": 7, "npu_chip_info_rx_fcs_num": 2,
    }
    assert {name: value(scraped, name, 0) for name in expected} == pytest.approx(expected)
    # Power and voltage exactly as npu-exporter serves them: scaled in float32, widened to float64.
    assert (value(scraped, "npu_chip_info_power", 0), value(scraped, "npu_chip_info_voltage", 0)) == \
        (185.3000030517578, 0.8799999952316284)
    assert value(scraped, "npu_chip_info_process_info_num", 0) == 2
    # the HCCS totals: the driver adds every link into them, so a struct not zeroed per call would grow
    total = value(scraped, "npu_chip_info_hccs_bandwidth_info_total_tx", 0)
    assert total == value(scrape(agent), "npu_chip_info_hccs_bandwidth_info_total_tx", 0) and total < 30
    assert of_chip(scraped, "npu_chip_info_pcie_rx_p_bw", 0) == {("minPcieBw",): 11, ("maxPcieBw",): 33,
                                                                  ("avgPcieBw",): 22}
    assert of_chip(scraped, "npu_chip_info_process_info", 0) == {("", "4242"): 3.0, ("", "4243"): 512.0}
    # the fake's processes are in no container: their series have no pod labels, as npu-exporter clears them
    assert {(labels["namespace"], labels["pod_name"], labels["container_name"])
            for labels, _ in scraped["npu_chip_info_process_info"][1] if labels["id"] == str(phy(0))} == {("", "", "")}
    assert of_chip(scraped, "npu_chip_info_serial_number", 0) == {("102400001234",): 1}
    names = [labels for labels, _ in scraped["npu_chip_info_name"][1] if labels["id"] == str(phy(0))]
    assert names[0]["name"] == "910B3-Ascend-V1" and "model_name" not in names[0]
    info = scraped["npu_container_info"][1]
    assert [(labels["npuID"], labels["containerName"]) for labels, _ in info] == [(str(phy(0)), "team-a_train-0_main")]
    assert "container_npu_utilization" in scraped and len(scraped["container_npu_utilization"][1]) == 1
    node_base = scraped["node_base_info"][1]
    assert [labels["driverVersion"] for labels, _ in node_base] == ["24.1.rc3"]
    assert scraped["machine_card_nums"][1][0][1] == CARDS


PROFILING_TIME = "npu_chip_info_hccs_bandwidth_info_profiling_time"


@pytest.mark.parametrize("chip,board,mainboard,a3,links", [
    ("910_9391", None, None, True, range(1, 8)),  # the fake's A3 default: Atlas 900 A3 SuperPoD (0xb0, 0x18)
    ("910_9391", None, "0x1c", True, range(2, 8)),  # Atlas 9000 A3 SuperPoD
    ("910_9391", None, "0x64", True, range(0, 8)),  # an A3 main board npu-exporter does not know
    ("910B3", "0xb3", "0x14", True, range(1, 8)),  # Atlas 800I A3: the board id decides, not the chip name
    ("910_9391", "0x21", None, False, range(1, 8)),  # an A2 board
])
def test_the_board_decides_a3_and_the_hccs_links(telemetry_agent, chip, board, mainboard, a3, links):
    env = {"FAKE_DCMI_CHIP_NAME": chip, **({"FAKE_DCMI_BOARD_ID": board} if board else {}),
           **({"FAKE_DCMI_MAINBOARD_ID": mainboard} if mainboard else {})}
    agent, fake, _ = telemetry_agent(env=env)
    wanted = ("npu_chip_info_sio_crc_tx_err_cnt" if a3 else "npu_chip_info_pcie_rx_p_bw", PROFILING_TIME)
    scraped = wait_until(lambda: (s := scrape(agent)) and all(of_chip(s, name, 2) for name in wanted) and s,
                         15, "the board's groups")
    exported = {x for x in range(8) if value(scraped, f"npu_chip_info_hccs_statistic_info_tx_cnt_{x}", 2) is not None}
    assert exported == set(links)
    assert {x for x in range(8) if value(scraped, f"npu_chip_info_hccs_bandwidth_info_rx_{x}", 2) is not None} == set(links)
    assert bool(A3_ONLY & set(scraped)) == a3 and bool(A2_ONLY & set(scraped)) == (not a3)


def test_a3_chips_have_sio_and_no_pcie(telemetry_agent):
    agent, fake, _ = telemetry_agent(env={"FAKE_DCMI_CHIP_NAME": "910_9391"})
    fake.tele(2, "sio.tx", 9)
    scraped = wait_until(lambda: (s := scrape(agent)) and value(s, "npu_chip_info_sio_crc_tx_err_cnt", 2) == 9 and s,
                         15, "SIO counters")
    assert value(scraped, "npu_chip_info_sio_crc_rx_err_cnt", 2) == 0
    assert not A2_ONLY & set(scraped)


def test_failed_and_out_of_range_readings_give_npu_exporters_failure_values(telemetry_agent):
    agent, fake, hccn = telemetry_agent()
    fake.fail("dcmi_get_device_network_health", -8005, logic=1)
    fake.fail("dcmi_get_device_temperature", -8005, logic=1)
    fake.fail("dcmi_get_device_info", -8005, logic=1)  # the HCCS counters
    fake.fail("dcmi_get_hccs_link_bandwidth_info", -8005, logic=1)
    fake.fail("dcmi_get_device_ecc_info", -8005, logic=1)
    fake.tele(2, "temperature", -300)
    fake.tele(2, "power", -5)
    fake.tele(2, "voltage", 4294967295)
    fake.tele(2, "util.aicore", 101)
    fake.tele(2, "hbm.temp", -1)  # a negative HBM temperature fails the whole HBM reading
    hccn.set(phy(3), "link", "garbage\n")
    hccn.fail(phy(4), "link", rc=1)
    hccn.fail(phy(4), "stat", rc=1)

    def settled():
        s = scrape(agent)
        return s if (value(s, "npu_chip_info_network_status", 1) == -1 and value(s, "npu_chip_info_link_status", 4) == -1
                     and value(s, "npu_chip_info_voltage", 0) is not None
                     and value(s, "npu_chip_info_power", 1) is not None  # chip 1's sensors read, all but one call
                     and value(s, "npu_chip_info_hccs_bandwidth_info_total_tx", 1) == -1
                     and value(s, "npu_chip_info_utilization", 2) is None
                     and value(s, "npu_chip_info_hbm_total_memory", 2) is None) else None

    scraped = wait_until(settled, 15, "the failure values")
    assert value(scraped, "npu_chip_info_temperature", 1) is None  # omitted; only the failed call's family goes
    hccs = {f.name for f in FAMILIES if f.group == "hccs"} - HCCS_LINK[0] - {PROFILING_TIME}
    assert {value(scraped, name, 1) for name in hccs} == {-1.0}  # npu-exporter's buildFailedHccs*: every value -1
    assert value(scraped, PROFILING_TIME, 1) == 200  # ... but the sampling interval it asked for
    assert value(scraped, "npu_chip_info_hbm_ecc_enable_flag", 1) is None
    assert value(scraped, "npu_chip_info_hbm_total_memory", 1) == 65536
    for name in ("npu_chip_info_temperature", "npu_chip_info_power", "npu_chip_info_voltage",
                 "npu_chip_info_utilization", "npu_chip_info_hbm_used_memory", "npu_chip_info_hbm_temperature",
                 "container_npu_utilization"):
        assert value(scraped, name, 2) is None, name
    assert value(scraped, "npu_chip_info_vector_utilization", 2) == 30  # the other fields of the same call stay
    assert value(scraped, "npu_chip_info_hbm_utilization", 2) == 20
    assert value(scraped, "npu_chip_info_link_status", 3) == -1  # output that says nothing: unknown
    assert value(scraped, "npu_chip_roce_rx_all_pkt_num", 4) is None


def test_a_hung_telemetry_call_leaves_fault_detection_alone(telemetry_agent):
    agent, fake, _ = telemetry_agent()
    wait_until(lambda: value(scrape(agent), "npu_chip_info_temperature", 0) is not None, 15, "telemetry")
    for function in ("dcmi_get_device_temperature", "dcmi_get_device_hbm_info", "dcmi_get_device_network_health",
                     "dcmi_get_device_multi_utilization_rate_period"):
        fake.hang(function, 60)
    try:
        wait_until(lambda: (agent.metric("npu_agent_telemetry_reads_total", group="npu", result="timeout") or 0) > 0
                   and (agent.metric("npu_agent_telemetry_reads_total", group="utilization", result="refused") or 0)
                   > 0, 15, "telemetry reads timing out, then refused while stuck")
        scraped = scrape(agent)
        assert value(scraped, "npu_chip_info_network_status", 0) == -1  # the hung part reads unknown
        assert value(scraped, "npu_chip_info_temperature", 0) is None
        # a fault the driver reports by event, and one only a poll finds, arrive as fast as without telemetry
        started = time.monotonic()
        fake.occur(2, 0x80E18402, severity=3)
        wait_until(lambda: agent.metric("npu_agent_device_fault", id=phy(2), fault_code="80E18402",
                                        fault_level="SeparateNPU") == 1, 5, "the event's fault")
        event_s = time.monotonic() - started
        started = time.monotonic()
        fake.occur(3, 0x80E18402, severity=3, via="silent")
        wait_until(lambda: agent.metric("npu_agent_device_fault", id=phy(3), fault_code="80E18402",
                                        fault_level="SeparateNPU") == 1, 5, "the polled fault")
        poll_s = time.monotonic() - started
        assert event_s < 1.0 and poll_s < 1 + 1.5, (event_s, poll_s)  # poll interval 1 s; telemetry waits 1 s a call
        assert agent.http("/readyz")[0] == 200
    finally:
        for function in ("dcmi_get_device_temperature", "dcmi_get_device_hbm_info",
                         "dcmi_get_device_network_health", "dcmi_get_device_multi_utilization_rate_period"):
            fake.hang(function, 0)
    wait_until(lambda: value(scrape(agent), "npu_chip_info_temperature", 0) is not None, 15, "telemetry back")


def test_a_function_a_chip_does_not_support_is_logged_once_and_not_called_again(telemetry_agent):
    agent, fake, _ = telemetry_agent()
    fake.unsupported(4, "dcmi_get_device_voltage")
    wait_until(lambda: agent.metric("npu_agent_telemetry_unsupported", id=phy(4),
                                    function="dcmi_get_device_voltage") == 1, 15, "the unsupported call noted")
    calls = fake.stats()["calls"]["dcmi_get_device_voltage"]
    rounds = agent.metric("npu_agent_telemetry_reads_total", group="npu", result="ok")
    wait_until(lambda: agent.metric("npu_agent_telemetry_reads_total", group="npu", result="ok") >= rounds + 3 * CARDS,
               15, "more rounds")
    more = fake.stats()["calls"]["dcmi_get_device_voltage"] - calls
    assert more % (CARDS - 1) == 0 and more > 0  # every chip but the one that does not support it
    said = [line for line in agent.logs if "does not support" in line.get("msg", line.get("message", ""))]
    assert len(said) == 1 and said[0]["device"] == phy(4) and said[0]["function"] == "dcmi_get_device_voltage"
    assert value(scrape(agent), "npu_chip_info_voltage", 4) is None
    assert value(scrape(agent), "npu_chip_info_voltage", 5) == 0.8799999952316284  # 88 x 0.01 in float32


def test_a_driver_without_the_period_call_reads_utilization_with_the_next_one(telemetry_agent):
    agent, fake, _ = telemetry_agent(variant="no_period")
    fake.tele(1, "util.aicore", 77)
    wait_until(lambda: value(scrape(agent), "npu_chip_info_utilization", 1) == 77, 15, "utilization")
    missing = [line for line in agent.logs if line.get("function") == "dcmi_get_device_multi_utilization_rate_period"]
    assert len(missing) == 1  # the library lacks it: said once
