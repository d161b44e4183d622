"""Which pod holds which NPU, end to end: the real agent asks a kubelet PodResources stand-in on a real
unix socket while pods appear, move and vanish, and the kubelet dies or hangs."""

from __future__ import annotations

from testkit.fakes.kubelet.podresources import PodResourcesStandIn
from testkit.wait import wait_until
from tests.integration.conftest import phy

MODEL = "910B3-Ascend-V1"
RESOURCE = "huawei.com/Ascend910"


def owner(namespace="", pod="", container=""):
    return {"namespace": namespace, "pod_name": pod, "container_name": container}


def health(agent, logic, **who):
    return agent.metric("npu_chip_info_health_status", id=phy(logic), model_name=MODEL, **who)


def test_device_series_and_faults_name_the_pod_holding_the_npu(start_agent, short_dir):
    kubelet = PodResourcesStandIn(short_dir / "kubelet.sock")
    kubelet.set_pods(("team-a", "train-0", "main", RESOURCE, [f"Ascend910-{phy(1)}", f"Ascend910-{phy(2)}"]))
    with kubelet:
        agent, fake = start_agent(kubernetes={"pod_resources_socket": str(kubelet.socket_path),
                                              "pod_resources_refresh_seconds": 0.5})
        train = owner("team-a", "train-0", "main")
        wait_until(lambda: health(agent, 1, **train) == 1, 5, "pod labels on NPU 1")
        assert health(agent, 2, **train) == 1
        assert health(agent, 0) == 1  # a free NPU: empty pod labels

        fake.occur(2, 0x80E18402, severity=3)
        wait_until(lambda: agent.metric("npu_agent_device_fault", id=phy(2), fault_code="80E18402",
                                        fault_level="SeparateNPU", **train) == 1, 5, "the fault labelled with its pod")
        fault = agent.fault_of(phy(2))
        assert fault["pods"] == [{"namespace": "team-a", "pod": "train-0", "container": "main"}]

        # The pod moves: NPU 2 now belongs to another job; labels follow within a refresh, none linger.
        kubelet.set_pods(("team-b", "infer-1", "srv", RESOURCE, [f"Ascend910-{phy(2)}"]))
        infer = owner("team-b", "infer-1", "srv")
        wait_until(lambda: agent.metric("npu_agent_device_fault_level", id=phy(2), **infer) == 8, 5,
                   "labels follow the move")
        samples = agent.metrics()
        assert not any(dict(labels).get("pod_name") == "train-0" for _, labels in samples)
        assert health(agent, 1) == 1
        assert agent.fault_of(phy(2))["pods"] == [{"namespace": "team-b", "pod": "infer-1", "container": "srv"}]

        # The pod ends.
        kubelet.set_pods()
        wait_until(lambda: agent.metric("npu_agent_device_fault_level", id=phy(2)) == 8, 5, "labels gone with the pod")
        assert agent.fault_of(phy(2))["pods"] == []

        # The kubelet goes away: attribution empties with one clear log line; devices and faults stay.
        kubelet.set_pods(("team-a", "train-0", "main", RESOURCE, [f"Ascend910-{phy(2)}"]))
        wait_until(lambda: agent.metric("npu_agent_device_fault_level", id=phy(2), **train) == 8, 5, "attributed again")
    line = agent.wait_for_log("pod attribution off")
    assert "no kubelet PodResources socket" in line["reason"]
    wait_until(lambda: agent.metric("npu_agent_device_fault_level", id=phy(2)) == 8, 5, "unattributed, fault intact")
    assert agent.metric("npu_agent_device_fault", id=phy(2), fault_code="80E18402", fault_level="SeparateNPU") == 1
    assert health(agent, 0) == 1

    # A kubelet that hangs past the call deadline counts as broken, not as "no pods".
    slow = PodResourcesStandIn(short_dir / "kubelet.sock")
    slow.set_pods(("team-a", "train-0", "main", RESOURCE, [f"Ascend910-{phy(2)}"]))
    slow.delay_s = 3.0
    with slow:
        wait_until(lambda: any("DEADLINE_EXCEEDED" in r.get("reason", "") for r in list(agent.logs)), 15,
                   "a log line naming the hung kubelet")
        assert agent.metric("npu_agent_device_fault_level", id=phy(2)) == 8
        slow.delay_s = 0.0
        wait_until(lambda: agent.metric("npu_agent_device_fault_level", id=phy(2), **train) == 8, 10,
                   "attribution back once the kubelet answers")
    agent.wait_for_log("pod attribution restored")


def test_the_clusterd_request_names_the_pods_within_clusterds_limits(start_agent, short_dir):
    from testkit.fakes.clusterd import ClusterdStandIn

    kubelet = PodResourcesStandIn(short_dir / "kubelet.sock")
    long_name = "w" * 253  # the longest pod name: more than a faultLocation value or, twice, a description holds
    kubelet.set_pods(("team-a", "train-0", "main", RESOURCE, [f"Ascend910-{phy(3)}"]),
                     *[("team-a", long_name[:-1] + str(i), "side", RESOURCE, [f"Ascend910-{phy(3)}"]) for i in (1, 2)])
    with kubelet, ClusterdStandIn() as clusterd:
        agent, fake = start_agent(clusterd={"enabled": True, "address": f"127.0.0.1:{clusterd.port}"},
                                  kubernetes={"pod_resources_socket": str(kubelet.socket_path)})
        shared = ["not_displayed_for_multi_pod"] * 3  # several containers on the NPU: one series, as npu-exporter
        wait_until(lambda: health(agent, 3, **owner(*shared)) == 1, 5, "pods known")
        fake.occur(3, 0x80E18402, severity=3)
        clusterd.wait_for(lambda s: s.active(), timeout=5)
        fault = next(iter(clusterd.active().values())).fault
        assert clusterd.dropped_faults() == []  # within ClusterD's rules, as its stand-in checks them
        location = dict(fault.faultLocation)
        assert (location["namespace"], location["pod"], location["container"], location["pods"]) == \
            ("team-a", "train-0", "main", "3")
        assert fault.description.startswith("npu-node-agent: NPU %d SeparateNPU (80E18402); pods: "
                                            "team-a/train-0 (container main), team-a/www" % phy(3))
        assert len(fault.description) == 512 and fault.description.endswith("...")
