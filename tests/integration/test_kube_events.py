"""Kubernetes Events for NPU faults, end to end: the real agent posts them to the API stand-in over a
real socket, on the Node and on the pod holding the NPU, aggregated and rate-limited by client-go's
rules, so that a flapping NPU cannot flood the API server."""

from __future__ import annotations

import json

from testkit.fakes.kubelet.podresources import PodResourcesStandIn
from testkit.wait import wait_until
from tests.integration.conftest import phy

NODE = "test-node"
RESOURCE = "huawei.com/Ascend910"
SOURCE = {"component": "npu-node-agent", "host": NODE}


def events(standin, namespace: str, **fields) -> list[dict]:
    """The events in `namespace` about the object `fields` name (kind=, name=), oldest first."""
    found = [event for event in standin.list("Event", namespace)
             if all(event["involvedObject"].get(key) == value for key, value in fields.items())]
    return sorted(found, key=lambda event: event["metadata"]["resourceVersion"].zfill(12))


def by_reason(found: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for event in found:
        grouped.setdefault(event["reason"], []).append(event)
    return grouped


def event_writes(standin, namespace: str) -> int:
    return sum(1 for method, path in standin.requests
               if method in ("POST", "PATCH") and path.startswith(f"/api/v1/namespaces/{namespace}/events"))


def attributed(agent, logic: int) -> bool:
    return agent.metric("npu_agent_device_fault_level", id=phy(logic), namespace="team-a", pod_name="train-0",
                        container_name="main") == 0


def agent_with_pod(start_agent, kube, short_dir, tmp_path, logic: int, faults: dict | None = None):
    standin, kubeconfig = kube
    pod = standin.put({"kind": "Pod", "metadata": {"name": "train-0", "namespace": "team-a"},
                       "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": "train"}]},
                       "status": {"phase": "Running"}})
    kubelet = PodResourcesStandIn(short_dir / "kubelet.sock")
    kubelet.set_pods(("team-a", "train-0", "main", RESOURCE, [f"Ascend910-{phy(logic)}"]))
    kubelet.__enter__()
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, faults=faults or {}, env={"KUBECONFIG": kubeconfig},
                              kubernetes={"enabled": True, "events": True,
                                          "pod_resources_socket": str(kubelet.socket_path),
                                          "pod_resources_refresh_seconds": 0.5})
    return standin, agent, fake, pod["metadata"]["uid"], kubelet


def test_occurrence_escalation_and_recovery_are_events_on_the_node_and_the_pod(start_agent, kube, short_dir, tmp_path):
    custom = tmp_path / "custom.json"  # 81078603 (NotHandleFault) held 1 s -> PreSeparateNPU
    custom.write_text(json.dumps({"FaultDuration": [{"EventId": ["81078603"], "FaultTimeout": 1, "RecoverTimeout": 0,
                                                     "FaultHandling": "PreSeparateNPU"}]}))
    standin, agent, fake, uid, kubelet = agent_with_pod(start_agent, kube, short_dir, tmp_path, 3,
                                                        faults={"customization_file": str(custom)})
    try:
        npu = f"NPU{phy(3)}"
        wait_until(lambda: attributed(agent, 3), 10, "the NPU attributed to its pod")
        standin.fail_next("POST", "/namespaces/default/events", 503)  # the first post fails: retried
        fake.occur(3, 0x81078603, severity=1)
        wait_until(lambda: "NPUFaultEscalated" in by_reason(events(standin, "team-a")), 10, "the escalation event")
        fake.recover(3, 0x81078603)
        wait_until(lambda: "NPUFaultRecovered" in by_reason(events(standin, "team-a")), 10, "the recovery on the pod")
        wait_until(lambda: "NPUFaultRecovered" in by_reason(events(standin, "default")), 10, "the recovery on the node")

        on_node = by_reason(events(standin, "default", kind="Node", name=NODE))
        held = " (pod team-a/train-0)"
        assert [(e["type"], e["message"]) for reason in ("NPUFaultOccurred", "NPUFaultEscalated", "NPUFaultRecovered")
                for e in on_node[reason]] == [
            ("Warning", f"{npu}: fault 81078603 occurred (NotHandleFault){held}"),
            ("Warning",
             f"{npu}: fault 81078603 escalated from NotHandleFault to PreSeparateNPU by FaultDuration{held}"),
            ("Normal", f"{npu}: fault 81078603 recovered (was PreSeparateNPU){held}")]
        first = on_node["NPUFaultOccurred"][0]
        # As the kubelet writes a node's events: in `default`, the node's name as its uid (kubectl describe
        # node asks for exactly that).
        assert first["involvedObject"] == {"kind": "Node", "name": NODE, "uid": NODE}
        assert first["metadata"]["name"].startswith(f"{NODE}.") and first["count"] == 1
        assert first["source"] == SOURCE and first["reportingComponent"] == "npu-node-agent"
        assert first["reportingInstance"] == NODE and first["firstTimestamp"] == first["lastTimestamp"]

        # On the pod: in its namespace, with its uid, so `kubectl describe pod` lists them.
        described = standin.client().list_namespaced_event("team-a", field_selector=(
            f"involvedObject.kind=Pod,involvedObject.name=train-0,involvedObject.namespace=team-a,"
            f"involvedObject.uid={uid}"))
        assert sorted((e.type, e.reason, e.message) for e in described.items) == sorted([
            ("Warning", "NPUFaultOccurred", f"{npu}: fault 81078603 occurred (NotHandleFault)"),
            ("Warning", "NPUFaultEscalated",
             f"{npu}: fault 81078603 escalated from NotHandleFault to PreSeparateNPU by FaultDuration"),
            ("Normal", "NPUFaultRecovered", f"{npu}: fault 81078603 recovered (was PreSeparateNPU)")])
        assert {e.involved_object.api_version for e in described.items} == {"v1"}

        # The 503 was retried; the uid was read once.
        wait_until(lambda: agent.metric("npu_agent_fault_reports_total", sink="kube-events", result="created") == 6,
                   5, "the six creations counted (the stand-in stores one before the agent has its answer)")
        assert agent.metric("npu_agent_kube_events_dropped_total", cause="failed") == 0
        assert agent.metric("npu_agent_kube_events_total", reason="NPUFaultEscalated") == 2  # node and pod
        pod_reads = [path for method, path in standin.requests
                     if method == "GET" and path.startswith("/api/v1/namespaces/team-a/pods/")]
        assert pod_reads == ["/api/v1/namespaces/team-a/pods/train-0"]
    finally:
        kubelet.__exit__(None, None, None)


def test_a_flapping_npu_cannot_flood_the_api_server(start_agent, kube, short_dir, tmp_path):
    """The agent confirms a recovery by a poll a second later (as the device plugin does), so an NPU
    flaps at most once a second per code: 25 codes flapping 4 times are 200 changes, 400 events with
    the pod's. The API server sees 25 writes per object (the token bucket's burst), nothing more."""
    standin, agent, fake, _, kubelet = agent_with_pod(start_agent, kube, short_dir, tmp_path, 1)
    try:
        wait_until(lambda: attributed(agent, 1), 10, "the NPU attributed to its pod")
        codes = [int(code, 16) for code in (
            "80BB8003", "80BB8009", "80BB800A", "80BD8003", "80BD8009", "80C98002", "80C98003", "80C98009", "80C9800A",
            "80CB8000", "80CB8002", "80CB8009", "80CB800A", "80CF8003", "80D58000", "80D58009", "80DB8000", "80DB800A",
            "80DD8000", "80DD8003", "8107800D", "8131800A", "81AB8003", "81AB8008", "81AB800D")]
        cycles = 4

        def recovered() -> float:
            return agent.metric("npu_agent_kube_events_total", reason="NPUFaultRecovered") or 0

        for cycle in range(1, cycles + 1):
            for code in codes:
                fake.occur(1, code, severity=1)
            for code in codes:
                fake.recover(1, code)
            wait_until(lambda: recovered() == 2 * len(codes) * cycle, 10, f"cycle {cycle} recovered (node and pod)")
        wait_until(lambda: agent.metric("npu_agent_kube_events_queued") == 0 and sum(
            agent.metric("npu_agent_fault_reports_total", sink="kube-events", result=result) or 0
            for result in ("created", "patched")) == 50, 10, "the queue drained and every request answered")

        recorded = sum(agent.metric("npu_agent_kube_events_total", reason=reason)
                       for reason in ("NPUFaultOccurred", "NPUFaultRecovered"))
        assert recorded == 4 * len(codes) * cycles  # occurred and recovered, on the node and the pod
        node_writes, pod_writes = event_writes(standin, "default"), event_writes(standin, "team-a")
        assert (node_writes, pod_writes) == (25, 25)  # the burst per object; one more per 5 minutes
        assert agent.metric("npu_agent_kube_events_dropped_total", cause="rate_limited") == recorded - 50
        assert agent.metric("npu_agent_fault_reports_total", sink="kube-events", result="failed") is None

        # From the 10th distinct message of a reason, similar events went out as one combined event, counted on.
        for namespace in ("default", "team-a"):
            occurred = by_reason(events(standin, namespace))["NPUFaultOccurred"]
            combined = [e for e in occurred if e["message"].startswith("(combined from similar events): ")]
            assert len(occurred) == 10 and len(combined) == 1 and combined[0]["count"] > 1, occurred
        assert agent.http("/readyz")[0] == 200
    finally:
        kubelet.__exit__(None, None, None)
