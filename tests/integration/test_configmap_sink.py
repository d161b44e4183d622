"""The device-info ConfigMap written by the real agent through the official client to a Kubernetes API stand-in."""

from __future__ import annotations

import json


from agent.common.gojson import check_code
from testkit.fakes.kube import KubeStandIn
from testkit.wait import wait_until
from tests.integration.conftest import phy

NAME = "mindx-dl-deviceinfo-test-node"


def device_list(standin: KubeStandIn) -> dict | None:
    cm = standin.get("ConfigMap", "kube-system", NAME)
    if cm is None:
        return None
    config = json.loads(cm["data"]["DeviceInfoCfg"])
    assert config["CheckCode"] == check_code(config["DeviceInfo"])  # what ClusterD verifies
    assert cm["metadata"]["labels"] == {"mx-consumer-cim": "true"}
    return config["DeviceInfo"]["DeviceList"]


def test_configmap_follows_faults(start_agent, kube):
    standin, kubeconfig = kube
    standin.fail_next("PUT", NAME, 500)  # the first write fails: the sink retries
    agent, fake = start_agent(devices={"poll_interval_seconds": 1},
                              kubernetes={"enabled": True, "device_info_configmap": True},
                              env={"KUBECONFIG": kubeconfig})
    wait_until(lambda: device_list(standin), 10, "ConfigMap created")
    assert device_list(standin)["huawei.com/Ascend910-Unhealthy"] == ""
    fake.occur(2, 0x80E18402)
    wait_until(lambda: device_list(standin)["huawei.com/Ascend910-Unhealthy"] == f"Ascend910-{phy(2)}", 3,
               "unhealthy device listed")
    faults = json.loads(device_list(standin)["huawei.com/Ascend910-Fault"])
    assert faults[0]["fault_code"] == "80E18402" and faults[0]["fault_handling"] == "SeparateNPU"
    fake.recover(2, 0x80E18402)
    wait_until(lambda: device_list(standin)["huawei.com/Ascend910-Unhealthy"] == "", 4, "device healthy again")
    writes = [r for r in standin.requests if r[0] in ("PUT", "POST")]
    assert any(m == "POST" for m, _ in writes)  # update first, then create when it did not exist
    # The stand-in holds a write before the agent has its answer and counts it: wait for the count.
    wait_until(lambda: (agent.metric("npu_agent_fault_reports_total", sink="configmap", result="written") or 0) >= 3,
               5, "the three writes counted")


def test_an_api_server_that_is_down_is_retried_and_the_configmap_catches_up(start_agent, kube):
    """Connection refused is an error of the client library (urllib3), not of Kubernetes: the sink
    says so, shows it on /readyz and writes the current state once the API server is back."""
    standin, kubeconfig = kube
    agent, fake = start_agent(devices={"poll_interval_seconds": 1},
                              kubernetes={"enabled": True, "device_info_configmap": True},
                              env={"KUBECONFIG": kubeconfig})
    wait_until(lambda: device_list(standin), 10, "ConfigMap created")
    standin.stop()
    fake.occur(2, 0x80E18402)
    agent.wait_for_log("cannot write the device-info ConfigMap; retrying", timeout=20)
    wait_until(lambda: agent.http("/readyz")[0] == 503 and "configmap" in agent.http("/readyz")[1], 10,
               "/readyz names the sink")
    standin.start()
    wait_until(lambda: device_list(standin)["huawei.com/Ascend910-Unhealthy"] == f"Ascend910-{phy(2)}", 30,
               "the fault written once the API server is back")
    agent.wait_for_log("device-info ConfigMap written again", timeout=5)
    wait_until(lambda: agent.http("/readyz")[0] == 200, 10, "ready again")
