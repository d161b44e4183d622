"""The ClusterD stand-in with a Kubernetes API stand-in: its saved cache in ConfigMap
cluster-system/statistic-fault-info and its pod in mindx-dl, read the way the agent reads them,
through the official `kubernetes` client over HTTP."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from kubernetes.client.rest import ApiException

from agent._proto import pubfault_pb2 as pb
from testkit.fakes.clusterd import ClusterdStandIn
from testkit.fakes.clusterd.server import TOO_MANY_FAULTS
from testkit.fakes.kube import KubeStandIn
from testkit.wait import wait_until
from tests.integration.test_clusterd_standin import KEY, NOW_MS, T0, Client, fault, request
from tests.support.clock import FakeClock

NS, NAME = "cluster-system", "statistic-fault-info"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def kube():
    with KubeStandIn() as server:
        yield server


@pytest.fixture
def api(kube):
    return kube.client()


@pytest.fixture
def clusterd(clock, kube):
    with ClusterdStandIn(clock=clock, kube=kube) as standin:
        yield standin


@pytest.fixture
def client(clusterd):
    c = Client(clusterd.port)
    yield c
    c.channel.close()


def saved(api) -> dict[str, str]:
    """The ConfigMap's data as the agent reads it."""
    return api.read_namespaced_config_map(NAME, NS).data


def public_faults(api) -> dict:
    return json.loads(saved(api)["PublicFaults"])


def fault_num(api) -> int:
    return json.loads(saved(api)["FaultNum"])["publicFaultNum"]


def gone(api) -> bool:
    with pytest.raises(ApiException) as err:
        api.read_namespaced_config_map(NAME, NS)
    return err.value.status == 404


def at(offset: float) -> datetime:
    return datetime.fromtimestamp(T0 + offset, timezone.utc)


def test_the_configmap_holds_each_nodes_faults_in_clusterds_format(clusterd, client, api, clock):
    two_nodes = [pb.PubFaultInfo(nodeName="node-a", deviceIds=[3]),
                 pb.PubFaultInfo(nodeName="node-b", deviceIds=[0, 7])]
    client.send(request(fault("fault-0001", faultLocation={"codes": "80E18402"}),
                        fault("fault-0002", code="010011002", faultType="Network", influence=two_nodes)))
    cm = api.read_namespaced_config_map(NAME, NS)
    assert cm.metadata.labels == {"mc-statistic-fault": "true"} and set(cm.data) == {"PublicFaults", "FaultNum"}
    faults = json.loads(cm.data["PublicFaults"])
    assert faults == {
        "node-a": [{"resource": "npu-node-agent", "devIds": [0, 1], "faultId": "fault-0001", "type": "NPU",
                    "faultCode": "020011001", "level": "SeparateNPU", "faultTime": NOW_MS},
                   {"resource": "npu-node-agent", "devIds": [3], "faultId": "fault-0002", "type": "Network",
                    "faultCode": "010011002", "level": "PreSeparateNPU", "faultTime": NOW_MS}],
        "node-b": [{"resource": "npu-node-agent", "devIds": [0, 7], "faultId": "fault-0002", "type": "Network",
                    "faultCode": "010011002", "level": "PreSeparateNPU", "faultTime": NOW_MS}]}
    # The Go struct's field order; no assertion, location, description or add time.
    assert list(faults["node-a"][0]) == ["resource", "devIds", "faultId", "type", "faultCode", "level", "faultTime"]
    assert json.loads(cm.data["FaultNum"]) == {"publicFaultNum": 3}

    clock.at(6)  # old enough: each recover deletes at once
    client.send(request(fault("fault-0002", assertion="recover", influence=two_nodes)))
    clock.at(6.5)  # written when the writer's sleep (from the occur at T0) is long over: at once
    assert public_faults(api) == {"node-a": [faults["node-a"][0]]} and fault_num(api) == 1  # node-b is absent
    clock.at(8)
    client.send(request(fault("fault-0001", assertion="recover")))
    assert public_faults(api) == {} and fault_num(api) == 0  # an empty cache is an empty map, not no ConfigMap


def test_fields_saved_empty_are_loaded_empty_and_left_out_when_written_back(clusterd, client, kube, api, clock):
    # An operator's (or an older ClusterD's) entry without devIds, level and faultTime.
    kube.put({"kind": "ConfigMap", "metadata": {"name": NAME, "namespace": NS},
              "data": {"PublicFaults": json.dumps({"node-c": [{"resource": "CCAE", "faultId": "fault-from-ccae",
                                                               "type": "Node", "faultCode": "220001001",
                                                               "unknown": "ignored"}]})}})
    clock.at(10)
    clusterd.restart()
    stored = clusterd.active()[("node-c", "CCAE", "fault-from-ccae")]
    assert (stored.level, stored.device_ids, stored.fault.faultTime, stored.added_at) == ("", (), 0, T0 + 10)
    client.send(request(fault()), wait_for_ready=True)  # any accepted request writes the whole cache
    assert public_faults(api)["node-c"] == [{"resource": "CCAE", "faultId": "fault-from-ccae", "type": "Node",
                                             "faultCode": "220001001"}]
    assert fault_num(api) == 2
    assert api.read_namespaced_config_map(NAME, NS).metadata.labels == {"mc-statistic-fault": "true"}


def test_a_restart_reloads_what_the_configmap_holds(clusterd, client, api, clock):
    client.send(request(fault("fault-0001"), fault("fault-0002", code="010011001")))
    clock.at(0.5)
    client.send(request(fault("fault-0003")))  # waits for the writer's sleep ...
    clock.at(0.9)
    clusterd.restart()  # ... which the process does not live to end
    assert sorted(key[2] for key in clusterd.active()) == ["fault-0001", "fault-0002"]
    assert {entry["faultId"] for entry in public_faults(api)["node-a"]} == {"fault-0001", "fault-0002"}
    stored = clusterd.active()[KEY]
    assert (stored.level, stored.device_ids, stored.added_at) == ("SeparateNPU", (0, 1), T0)  # floor(T0 + 0.9)
    assert clusterd.persisted()[KEY] == {"node": "node-a", "resource": "npu-node-agent", "faultId": "fault-0001",
                                         "faultType": "NPU", "faultCode": "020011001", "level": "SeparateNPU",
                                         "faultTime": NOW_MS, "deviceIds": [0, 1]}
    clock.at(50)
    clusterd.replace_pod()  # a new pod reads the same ConfigMap
    assert sorted(key[2] for key in clusterd.active()) == ["fault-0001", "fault-0002"]


def test_the_reload_at_start_reads_the_configmap_as_it_is_then(clock, kube, api):
    with ClusterdStandIn(clock=clock, kube=kube) as clusterd:
        client = Client(clusterd.port)
        client.send(request(fault()))
        clock.at(10)
        clusterd.restart()
        api.delete_namespaced_config_map(NAME, NS)  # after the start: its reload has read it
        assert list(clusterd.active()) == [KEY]
        client.channel.close()
    clock.at(20)
    with ClusterdStandIn(clock=clock, kube=kube, reload_delay_s=3) as clusterd:
        client = Client(clusterd.port)
        clock.at(23)  # the reload: the writer starts
        client.send(request(fault()))
        assert fault_num(api) == 1
        clusterd.restart()  # reloads at T0+26
        clock.at(24)
        api.delete_namespaced_config_map(NAME, NS)  # before the reload: it finds nothing
        clock.at(26)
        assert clusterd.active() == {}
        client.channel.close()


def test_a_write_that_changes_nothing_stores_nothing(clusterd, client, api, clock):
    client.send(request(fault()))
    version = api.read_namespaced_config_map(NAME, NS).metadata.resource_version
    clock.at(2)
    client.send(request(fault()))  # a repeated occur: the cache is as it was, and so is the write
    assert api.read_namespaced_config_map(NAME, NS).metadata.resource_version == version
    clock.at(4)
    client.send(request(fault("fault-0002")))
    assert api.read_namespaced_config_map(NAME, NS).metadata.resource_version != version


@pytest.mark.parametrize("public_faults_text", [
    None,  # the key is missing
    "not json",
    "[]",
    '{"node-a": {}}',
    '{"node-a": ["fault-0001"]}',
    '{"node-a": [{"faultId": 1}]}',
    '{"node-a": [{"faultId": "fault-0001", "devIds": "0"}]}',
    '{"node-a": [{"faultId": "fault-0001", "devIds": [2147483648]}]}',
    '{"node-a": [{"faultId": "fault-0001", "faultTime": 1.5}]}',
    '{"node-a": [{"faultId": "fault-0001", "faultTime": NaN}]}',
    '{"node-a": []} {}',
    "null",  # decodes, to nothing
])
def test_a_corrupted_configmap_reloads_nothing_and_is_overwritten(clusterd, client, api, clock, public_faults_text):
    client.send(request(fault("fault-0001")))
    data = {"FaultNum": '{"publicFaultNum": 1}'}
    if public_faults_text is not None:
        data["PublicFaults"] = public_faults_text
    # As an operator would: a replace of the whole object through the API.
    cm = api.read_namespaced_config_map(NAME, NS)
    cm.data = data
    api.replace_namespaced_config_map(NAME, NS, cm)
    clock.at(10)
    clusterd.restart()
    assert clusterd.active() == {} and clusterd.persisted() == {}
    client.send(request(fault("fault-0002")), wait_for_ready=True)
    assert [entry["faultId"] for entry in public_faults(api)["node-a"]] == ["fault-0002"]


def test_a_configmap_deleted_through_the_api_reloads_nothing(clusterd, client, api, clock):
    client.send(request(fault("fault-0001")))
    api.delete_namespaced_config_map(NAME, NS)
    clock.at(10)
    clusterd.restart()
    assert clusterd.active() == {} and gone(api)


@pytest.mark.parametrize("forget", [
    lambda standin: standin.restart(persisted=False),
    lambda standin: (standin.stop(), standin.start(persisted=False)),
    lambda standin: standin.forget_all(),
    lambda standin: standin.lose_persistence(),
], ids=["restart", "stop-start", "forget_all", "lose_persistence"])
def test_starting_without_the_saved_cache_deletes_the_configmap(clusterd, client, api, clock, forget):
    client.send(request(fault("fault-0001")))
    assert fault_num(api) == 1
    clock.at(3)
    forget(clusterd)
    assert gone(api)


def test_above_the_limit_only_the_count_is_written_and_the_list_goes_stale(clock, kube, api):
    with ClusterdStandIn(clock=clock, kube=kube, max_persisted_faults=2) as clusterd:
        client = Client(clusterd.port)
        client.send(request(fault("fault-0001"), fault("fault-0002")))
        listed = public_faults(api)
        clock.at(2)
        client.send(request(fault("fault-0003")))
        data = saved(api)
        assert set(data) == {"PublicFaults", "FaultNum", "Description"}
        assert json.loads(data["PublicFaults"]) == listed and fault_num(api) == 3
        assert data["Description"] == TOO_MANY_FAULTS
        assert set(clusterd.persisted()) == {KEY, ("node-a", "npu-node-agent", "fault-0002")}

        clock.at(8)
        client.send(request(fault("fault-0003", assertion="recover")))  # back at the limit: a full write
        assert set(saved(api)) == {"PublicFaults", "FaultNum"} and public_faults(api) == listed

        clock.at(10)
        client.send(request(fault("fault-0003")))
        api.delete_namespaced_config_map(NAME, NS)
        clock.at(12)
        client.send(request(fault("fault-0004")))  # a patch does not create the ConfigMap
        assert gone(api) and clusterd.persisted() == {}
        clock.at(20)
        clusterd.restart()
        assert clusterd.active() == {}
        client.channel.close()


def test_the_configmap_follows_the_clock_without_queries(clusterd, client, api, clock):
    client.send(request(fault("fault-0001")))
    clock.at(1)
    client.send(request(fault("fault-0001", assertion="recover")))  # young: deleted at T0+5.5
    assert fault_num(api) == 1
    clock.at(6)  # no call to the stand-in from here on: its ticker runs the deletion and the write
    wait_until(lambda: fault_num(api) == 0, 5, "the deletion written to the ConfigMap")
    assert public_faults(api) == {}


def clusterd_pods(api) -> list:
    return api.list_namespaced_pod("mindx-dl", label_selector="app=clusterd").items


def container(pod):
    [status] = pod.status.container_statuses
    assert status.name == "clusterd"
    return status


def ready(pod) -> str:
    return next(c.status for c in pod.status.conditions if c.type == "Ready")


def test_the_pod_shows_restarts_in_place_and_a_replacement(clock, kube, api):
    assert clusterd_pods(api) == []
    standin = ClusterdStandIn(clock=clock, kube=kube)
    with standin:
        [pod] = clusterd_pods(api)
        assert pod.metadata.name == standin.pod_name and pod.metadata.name.startswith("clusterd-")
        assert pod.status.phase == "Running" and ready(pod) == "True"
        status = container(pod)
        assert (status.ready, status.started, status.restart_count) == (True, True, 0)
        assert status.state.running.started_at == at(0) and status.last_state.terminated is None
        name, uid, first_container = pod.metadata.name, pod.metadata.uid, status.container_id

        clock.at(20)
        standin.stop()  # a crash: the container is gone, the pod stays
        [pod] = clusterd_pods(api)
        assert (pod.metadata.name, pod.metadata.uid, pod.status.phase, ready(pod)) == (name, uid, "Running", "False")
        status = container(pod)
        assert (status.ready, status.started, status.restart_count, status.state.running) == (False, False, 0, None)
        assert (status.state.terminated.started_at, status.state.terminated.finished_at) == (at(0), at(20))
        assert status.state.terminated.exit_code != 0

        clock.at(30)
        standin.start()  # the kubelet restarts the container in the same pod
        [pod] = clusterd_pods(api)
        assert (pod.metadata.name, pod.metadata.uid, ready(pod)) == (name, uid, "True")
        status = container(pod)
        assert (status.ready, status.restart_count, status.state.running.started_at) == (True, 1, at(30))
        assert status.last_state.terminated.finished_at == at(20)
        assert status.container_id != first_container and status.last_state.terminated.container_id == first_container

        clock.at(40)
        standin.forget_all()  # a restart that kept the clients' connections: one more restart
        assert container(api.read_namespaced_pod(name, "mindx-dl")).restart_count == 2

        clock.at(50)
        standin.replace_pod()  # a rollout: a new pod, counting from zero
        [pod] = clusterd_pods(api)
        assert pod.metadata.name == standin.pod_name != name and pod.metadata.uid != uid
        status = container(pod)
        assert (status.ready, status.restart_count, status.state.running.started_at) == (True, 0, at(50))
        assert pod.status.start_time == at(50) and ready(pod) == "True"
        with pytest.raises(ApiException) as err:
            api.read_namespaced_pod(name, "mindx-dl")
        assert err.value.status == 404
