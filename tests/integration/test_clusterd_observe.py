"""ClusterD as the API server shows it: the agent notices a ClusterD restart from ClusterD's pod and
reads what ClusterD saved (its ConfigMap) to send only the difference.

The ClusterD stand-in keeps its saved cache in the Kubernetes stand-in's ConfigMap
`cluster-system/statistic-fault-info` and its pod `mindx-dl/clusterd-*` there, as ClusterD and the
kubelet do. The agents run with `cluster_nodes` above 256: they connect to ClusterD only to send, so
nothing but the pod tells them ClusterD restarted."""

from __future__ import annotations

import json

import pytest

from testkit.fakes.clusterd import ClusterdStandIn
from testkit.fakes.kube import KubeStandIn
from testkit.wait import wait_until
from tests.integration.conftest import phy

NODE = "test-node"
HBM = 0x80E18402  # SeparateNPU: public 020011001
LARGE = {"cluster_nodes": 300, "idle_disconnect_seconds": 10}  # connect to send; checks spread over 6 s


@pytest.fixture
def cluster(tmp_path):
    """The API server and ClusterD keeping its state in it (reloading it 3 s after it serves again);
    yields them and a kubeconfig."""
    with KubeStandIn() as kube:
        with ClusterdStandIn(kube=kube, listener_cap=(1024, 512), reload_delay_s=3) as clusterd:
            yield kube, clusterd, kube.write_kubeconfig(tmp_path / "kubeconfig")


def start(start_agent, clusterd, kubeconfig, wait_ready: bool = True):
    return start_agent(devices={"poll_interval_seconds": 1}, env={"KUBECONFIG": kubeconfig}, wait_ready=wait_ready,
                       kubernetes={"enabled": True, "pod_resources_socket": ""},
                       clusterd={"enabled": True, "address": f"127.0.0.1:{clusterd.port}", **LARGE})


def held_devices(clusterd) -> set[int]:
    return {device for (node, _, _), stored in clusterd.active().items() if node == NODE
            for device in stored.fault.influence[0].deviceIds}


def sent(clusterd, since: int = 0) -> list[tuple[str, int]]:
    """(assertion, device) of every fault of this node ClusterD accepted, from request `since` on."""
    return [(f.assertion, f.influence[0].deviceIds[0]) for r in clusterd.requests[since:] if r.code == 0
            for f in r.request.faults if f.influence[0].nodeName == NODE]


def checks(agent, result: str) -> float:
    return agent.metric("npu_agent_clusterd_saved_checks_total", result=result) or 0


def faulty_and_idle(start_agent, clusterd, kubeconfig, logic: int):
    """An agent whose fault on NPU `logic` ClusterD holds, and which closed its connection since (10 s
    after its last request): from now on only the pod can tell it that ClusterD restarted."""
    agent, fake = start(start_agent, clusterd, kubeconfig)
    fake.occur(logic, HBM)
    clusterd.wait_for(lambda s: held_devices(s) == {phy(logic)}, timeout=10)
    clusterd.wait_for(lambda s: s.connections[0] == 0, timeout=20)
    return agent


def test_a_restart_that_lost_everything_is_seen_from_the_pod_and_only_what_is_missing_is_sent(start_agent, cluster):
    kube, clusterd, kubeconfig = cluster
    agent = faulty_and_idle(start_agent, clusterd, kubeconfig, 2)
    before = len(clusterd.requests)
    clusterd.restart(persisted=False)  # its ConfigMap deleted: the new process starts empty
    clusterd.wait_for(lambda s: held_devices(s) == {phy(2)}, timeout=20)
    assert sent(clusterd, before) == [("occur", phy(2))]
    wait_until(lambda: checks(agent, "differed") >= 1, 5, "the check that found the fault missing counted")
    agent.wait_for_log("a new ClusterD process is serving")
    assert clusterd.dropped_faults() == []


def test_a_restart_that_kept_everything_costs_no_request_and_a_resurrected_fault_is_recovered_alone(
        start_agent, cluster):
    kube, clusterd, kubeconfig = cluster
    agent = faulty_and_idle(start_agent, clusterd, kubeconfig, 1)
    before = len(clusterd.requests)
    clusterd.restart()  # its ConfigMap kept: the node reads it and finds its fault there
    wait_until(lambda: checks(agent, "in_step") >= 1, 15, "the check after the restart")
    assert sent(clusterd, before) == [] and checks(agent, "differed") == 0
    clusterd.stop()
    # What a lost deletion leaves: a fault of this node, recovered before the crash, still saved.
    saved = kube.get("ConfigMap", "cluster-system", "statistic-fault-info")
    faults = json.loads(saved["data"]["PublicFaults"])
    [mine] = faults[NODE]
    ghost = {**mine, "faultId": "f" * 64, "devIds": [phy(5)]}
    faults[NODE].append(ghost)
    saved["data"].update(PublicFaults=json.dumps(faults), FaultNum=json.dumps({"publicFaultNum": 2}))
    kube.put(saved)
    before = len(clusterd.requests)
    clusterd.start()
    clusterd.wait_for(lambda s: held_devices(s) == {phy(1), phy(5)}, timeout=10)  # reloaded, the ghost too
    clusterd.wait_for(lambda s: held_devices(s) == {phy(1)}, timeout=30)  # recovered (and deleted 5 s on)
    assert sent(clusterd, before) == [("recover", phy(5))]  # the held fault was not sent again
    [recover] = [f for r in clusterd.requests[before:] for f in r.request.faults]
    assert recover.faultId == "f" * 64
    assert checks(agent, "differed") >= 1
    assert clusterd.dropped_faults() == []


def test_without_a_grant_to_read_the_saved_faults_everything_is_re_sent(start_agent, tmp_path):
    with KubeStandIn(rbac=True) as kube:
        agent_user = "system:serviceaccount:npu:agent"
        kube.add_token("agent-token", agent_user)
        kube.allow(user=agent_user, verbs=("list", "watch"), resources=("pods",))  # the ConfigMap is not granted
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", token="agent-token")
        with ClusterdStandIn(kube=kube, listener_cap=(1024, 512)) as clusterd:
            agent = faulty_and_idle(start_agent, clusterd, kubeconfig, 3)
            before = len(clusterd.requests)
            clusterd.restart(persisted=False)
            clusterd.wait_for(lambda s: held_devices(s) == {phy(3)}, timeout=20)
            assert ("occur", phy(3)) in sent(clusterd, before)
            wait_until(lambda: checks(agent, "unknown") >= 1, 5, "the unknown check counted")
            agent.wait_for_log("ClusterD's saved faults are not known; re-sending every fault instead")
            assert agent.http("/readyz")[0] == 200  # ClusterD has everything: nothing for operators to fix


def test_without_a_grant_to_watch_clusterd_s_pods_readyz_names_it(start_agent, tmp_path):
    with KubeStandIn(rbac=True) as kube:
        kube.add_token("bare-token", "system:serviceaccount:npu:bare")
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", token="bare-token")
        with ClusterdStandIn(kube=kube) as clusterd:
            agent, _ = start(start_agent, clusterd, kubeconfig, wait_ready=False)
            wait_until(lambda: "no grant to list and watch pods in mindx-dl" in agent.http("/readyz")[1], 20,
                       "/readyz naming the missing grant")
            assert agent.http("/readyz")[0] == 503


def test_a_key_clusterd_holds_for_the_node_that_the_node_does_not_know_is_recovered_at_start(
        start_agent, cluster):
    """A lost state_dir loses the keys the node raised; ClusterD keeps them until told. A node with no
    fault of its own still reads what ClusterD saved for it, once it started (and periodically)."""
    kube, clusterd, kubeconfig = cluster
    clusterd.stop()
    orphan = {"resource": "npu-node-agent", "devIds": [phy(4)], "faultId": "e" * 64, "type": "NPU",
              "faultCode": "020011001", "level": "SeparateNPU", "faultTime": 1_780_000_000_000}
    other = {**orphan, "resource": "CCAE", "faultId": "d" * 64}  # another sender's: not the agent's to recover
    kube.put({"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": "statistic-fault-info", "namespace": "cluster-system",
                           "labels": {"mc-statistic-fault": "true"}},
              "data": {"PublicFaults": json.dumps({NODE: [orphan, other]}),
                       "FaultNum": json.dumps({"publicFaultNum": 2})}})
    clusterd.start()
    clusterd.wait_for(lambda s: len(s.active()) == 2, timeout=10)
    agent, _ = start_agent(devices={"poll_interval_seconds": 1}, env={"KUBECONFIG": kubeconfig},
                           kubernetes={"enabled": True, "pod_resources_socket": ""},
                           clusterd={"enabled": True, "address": f"127.0.0.1:{clusterd.port}", "cluster_nodes": 1})
    clusterd.wait_for(lambda s: [key[1] for key in s.active()] == ["CCAE"], timeout=20)  # within 3 s, then 5 s
    assert sent(clusterd) == [("recover", phy(4))]
    assert checks(agent, "differed") == 1
    assert clusterd.dropped_faults() == []
