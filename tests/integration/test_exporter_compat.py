"""The families the agent shares with npu-exporter carry npu-exporter's labels and values exactly (plus `node`),
and /metrics speaks OpenMetrics and gzip when asked: the real agent on the fake libdcmi, scraped over HTTP."""

from __future__ import annotations

import gzip
import urllib.request

from prometheus_client.openmetrics.parser import text_string_to_metric_families

from testkit.fakes.kubelet.podresources import PodResourcesStandIn
from testkit.wait import wait_until
from tests.integration.conftest import CARDS, phy

MODEL = "910B3-Ascend-V1"
FREE = {"namespace": "", "pod_name": "", "container_name": ""}
ERROR_CODES = ["npu_chip_info_error_code", *(f"npu_chip_info_error_code_{n}" for n in range(1, 10))]


def card(logic: int, vdie: str, pcie: str, **pod) -> dict[str, str]:
    return {"node": "test-node", "id": str(phy(logic)), "model_name": MODEL, "vdie_id": vdie, "pcie_bus_info": pcie,
            **(pod or FREE)}


def machine(agent) -> dict[str, float]:
    return {kind: agent.metric(f"machine_{kind}npu_nums") for kind in ("", "healthy_", "unhealthy_", "unknown_")}


def test_health_status_has_npu_exporters_labels_and_values(start_agent):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, env={
        "FAKE_DCMI_VDIE": "185011D4-21104518-A0C4ED94-14CC040A-56102003,1-ABC-0-0-FFFFFFFF",
        "FAKE_DCMI_PCIE": "0000:61:00.0,0001:c1:1f.7"})
    fake.health(2, 1)  # a minor alarm: npu-exporter calls only 0 healthy
    fake.health(3, 2147483647)  # out of range: no reading
    wait_until(lambda: agent.metric("npu_chip_info_health_status", id=phy(3), model_name=MODEL) == -1, 5, "poll")
    wait_until(lambda: agent.metric("npu_chip_info_health_status", id=phy(2), model_name=MODEL) == 0, 5, "poll")
    health = agent.series("npu_chip_info_health_status")
    assert len(health) == CARDS
    assert health[str(phy(0))] == (card(0, "185011D4-21104518-A0C4ED94-14CC040A-56102003", "0000:61:00.0"), 1)
    assert health[str(phy(1))] == (card(1, "00000001-00000ABC-00000000-00000000-FFFFFFFF", "0001:C1:1F.7"), 1)
    labels, value = health[str(phy(4))]  # the fake's defaults, in the same formats
    assert value == 1 and len(labels["vdie_id"]) == 44 and labels["pcie_bus_info"] == "0000:41:00.0"
    assert machine(agent) == {"": CARDS, "healthy_": CARDS - 2, "unhealthy_": 1, "unknown_": 1}

    fake.drop(5)  # the health call answers -8012: unknown, like any failed read
    wait_until(lambda: agent.metric("npu_chip_info_health_status", id=phy(5), model_name=MODEL) == -1, 5, "drop")
    assert machine(agent) == {"": CARDS, "healthy_": CARDS - 3, "unhealthy_": 1, "unknown_": 2}


def test_identity_labels_are_empty_when_the_driver_cannot_read_them(start_agent):
    agent, fake = start_agent(env={"FAKE_DCMI_FAIL": "dcmi_get_device_die_v2=-8255,dcmi_get_device_pcie_info_v2=-8005"})
    health = agent.series("npu_chip_info_health_status")
    assert health[str(phy(0))] == (card(0, "", ""), 1)
    assert agent.metric("npu_agent_component_ready", component="devices") == 1


def test_error_code_families_show_the_first_ten_codes_in_decimal(start_agent):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1})
    fake.occur(1, 0x80E18402, severity=3)
    codes = [0x80C98000 + n for n in (5, 11, 0, 7, 3, 9, 1, 10, 4, 8, 2, 6)]  # the driver lists them as raised
    for code in codes:
        fake.occur(2, code, via="silent")

    def shown(logic: int) -> dict[str, float]:
        return {name: agent.series(name)[str(phy(logic))][1] for name in ERROR_CODES
                if str(phy(logic)) in agent.series(name)}

    wait_until(lambda: len(shown(2)) == 10 and shown(1), 5, "error codes")
    assert shown(0) == {}  # no error: no series
    assert shown(1) == {"npu_chip_info_error_code": 0x80E18402}
    assert list(shown(2).items()) == list(zip(ERROR_CODES, codes[:10]))  # the first ten, in the driver's order
    labels, _ = agent.series("npu_chip_info_error_code")[str(phy(1))]
    assert labels == agent.series("npu_chip_info_health_status")[str(phy(1))][0]  # the same card labels

    for code in codes:
        fake.recover(2, code)
    wait_until(lambda: shown(2) == {}, 5, "codes gone with the faults")


def test_a_chip_shared_by_several_containers_has_one_series(start_agent, short_dir):
    kubelet = PodResourcesStandIn(short_dir / "kubelet.sock")
    device = f"Ascend910-{phy(1)}"
    kubelet.set_pods(("team-a", "train-0", "main", "huawei.com/Ascend910", [device]),
                     ("team-a", "train-0", "sidecar", "huawei.com/Ascend910", [device]),
                     ("team-b", "infer-1", "srv", "huawei.com/Ascend910", [f"Ascend910-{phy(2)}"]))
    with kubelet:
        agent, fake = start_agent(kubernetes={"pod_resources_socket": str(kubelet.socket_path),
                                              "pod_resources_refresh_seconds": 0.5})
        shared = dict.fromkeys(("namespace", "pod_name", "container_name"), "not_displayed_for_multi_pod")
        wait_until(lambda: agent.series("npu_chip_info_health_status")[str(phy(1))][0].items() >= shared.items(),
                   5, "pod labels")
        one = {"namespace": "team-b", "pod_name": "infer-1", "container_name": "srv"}
        assert agent.series("npu_chip_info_health_status")[str(phy(2))][0].items() >= one.items()
        assert agent.series("npu_agent_device_fault_level")[str(phy(1))] == ({"node": "test-node", "id": str(phy(1)),
                                                                              **shared}, 0)
        fake.occur(1, 0x80E18402, severity=3)
        wait_until(lambda: str(phy(1)) in agent.series("npu_agent_device_fault"), 5, "the fault")
        labels, value = agent.series("npu_agent_device_fault")[str(phy(1))]
        assert value == 1 and labels.items() >= shared.items()


def scrape(agent, **headers) -> tuple[dict[str, str], bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{agent.http_port}/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=5) as response:
        return {k.lower(): v for k, v in response.headers.items()}, response.read()


def test_metrics_in_openmetrics_and_gzip_when_asked(start_agent):
    agent, fake = start_agent()
    headers, body = scrape(agent, Accept="application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert headers["content-type"].startswith("application/openmetrics-text")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert [s.value for s in families["machine_npu_nums"].samples] == [CARDS]
    assert {s.labels["id"] for s in families["npu_chip_info_health_status"].samples} == {str(phy(n)) for n in range(CARDS)}
    assert families["npu_agent_fault_events"].type == "counter"

    headers, body = scrape(agent, **{"Accept-Encoding": "gzip, deflate"})
    assert headers["content-encoding"] == "gzip" and headers["content-type"].startswith("text/plain")
    assert int(headers["content-length"]) == len(body)
    assert b"machine_npu_nums{node=\"test-node\"} 8.0" in gzip.decompress(body)

    headers, body = scrape(agent, **{"Accept-Encoding": "gzip;q=0, identity"})
    assert "content-encoding" not in headers and b"machine_npu_nums" in body
