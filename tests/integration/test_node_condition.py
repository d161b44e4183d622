"""The `NPUProblem` node condition, end to end: the real agent patches `nodes/<node>/status` of the
Kubernetes API stand-in over a real socket while a fake kubelet patches its own conditions."""

from __future__ import annotations

import threading

from kubernetes import watch

from testkit.fakes.kube import KubeStandIn
from testkit.fakes.kubelet.podresources import PodResourcesStandIn
from testkit.wait import wait_until
from tests.integration.conftest import phy

NODE = "test-node"
SMP = "application/strategic-merge-patch+json"
RESOURCE = "huawei.com/Ascend910"
STATUS_PATH = f"/api/v1/nodes/{NODE}/status"


def node_object(*conditions) -> dict:
    return {"kind": "Node", "metadata": {"name": NODE, "labels": {"accelerator": "huawei-Ascend910"}},
            "spec": {"podCIDR": "10.0.0.0/24"}, "status": {"conditions": list(conditions)}}


def ready(heartbeat: str = "2025-01-01T00:00:00Z") -> dict:
    return {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status",
            "lastHeartbeatTime": heartbeat, "lastTransitionTime": "2025-01-01T00:00:00Z"}


def conditions(standin: KubeStandIn) -> dict[str, dict]:
    node = standin.get("Node", "", NODE)
    return {c["type"]: c for c in (node or {}).get("status", {}).get("conditions", [])}


def npu_problem(standin: KubeStandIn) -> dict:
    return conditions(standin).get("NPUProblem") or {}


class FakeKubelet:
    """Patches the node's conditions every 50 ms as the kubelet does (a two-way strategic merge patch
    with `$setElementOrder/conditions`, never the agent's condition), until stopped."""

    def __init__(self, standin: KubeStandIn):
        self._api = standin.client()
        self._stop = threading.Event()
        self.patches = 0
        self.last = ""  # the heartbeat of its last patch
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "FakeKubelet":
        self._thread.start()
        wait_until(lambda: self.patches, 5, "the fake kubelet's first patch")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        assert self.error is None, self.error

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                heartbeat = f"2025-01-01T{self.patches // 3600 % 24:02d}:{self.patches // 60 % 60:02d}:" \
                            f"{self.patches % 60:02d}Z"
                self._api.patch_node_status(NODE, {"status": {
                    "$setElementOrder/conditions": [{"type": "MemoryPressure"}, {"type": "Ready"}],
                    "conditions": [{"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory",
                                    "lastHeartbeatTime": heartbeat, "lastTransitionTime": "2025-01-01T00:00:00Z"},
                                   {"type": "Ready", "lastHeartbeatTime": heartbeat}]}}, _content_type=SMP)
                self.patches += 1
                self.last = heartbeat
                self._stop.wait(0.05)
        except BaseException as exc:  # handed to the test thread
            self.error = exc


def statuses_since(standin: KubeStandIn, resource_version: str) -> list[str]:
    """Every status the NPUProblem condition passed through since `resource_version`, in order: a
    watch from there replays the stand-in's history of the node, then ends."""
    seen: list[str] = []
    for event in watch.Watch().stream(standin.client().list_node, field_selector=f"metadata.name={NODE}",
                                      resource_version=resource_version, timeout_seconds=1, deserialize=False):
        found = [c["status"] for c in event["object"].get("status", {}).get("conditions", [])
                 if c["type"] == "NPUProblem"]
        if found and (not seen or seen[-1] != found[0]):
            seen.append(found[0])
    return seen


def kubernetes(**keys) -> dict:
    return {"enabled": True, **keys}


def test_the_condition_follows_the_faults_beside_the_kubelets_conditions_and_survives_a_restart(
        start_agent, short_dir, tmp_path):
    # History enough for the kubelet's patches: the test replays the node's from its start.
    with KubeStandIn(history=100_000) as standin:
        condition_follows_the_faults(start_agent, standin, standin.write_kubeconfig(tmp_path / "kubeconfig"),
                                     short_dir)


def condition_follows_the_faults(start_agent, standin, kubeconfig, short_dir):
    standin.put(node_object(ready()))
    pods = PodResourcesStandIn(short_dir / "kubelet.sock")
    pods.set_pods(("team-a", "train-0", "main", RESOURCE, [f"Ascend910-{phy(2)}"]))
    with pods, FakeKubelet(standin) as kubelet:
        since = standin.resource_version
        agent, fake = start_agent(devices={"poll_interval_seconds": 1}, env={"KUBECONFIG": kubeconfig},
                                  kubernetes=kubernetes(node_condition=True, pod_resources_socket=str(pods.socket_path),
                                                        pod_resources_refresh_seconds=0.5))
        wait_until(lambda: npu_problem(standin).get("reason") == "NPUsHealthy", 10, "the condition written False")
        healthy = npu_problem(standin)
        assert healthy["status"] == "False" and healthy["message"] == "8 NPUs healthy, no active fault code"

        fake.occur(2, 0x80E18402)
        wait_until(lambda: npu_problem(standin).get("status") == "True", 5, "the condition True")
        problem = npu_problem(standin)
        assert problem["reason"] == "SeparateNPU"
        assert problem["message"] == f"NPU{phy(2)} SeparateNPU 80E18402 (pod team-a/train-0)"
        assert problem["lastTransitionTime"] >= healthy["lastTransitionTime"]
        fake.occur(5, 0x80BB8003, severity=1)  # a second NPU, a lesser level: named after the worse one
        wait_until(lambda: "; " in npu_problem(standin).get("message", ""), 5, "both NPUs named")
        assert npu_problem(standin)["message"] == (f"NPU{phy(2)} SeparateNPU 80E18402 (pod team-a/train-0); "
                                                   f"NPU{phy(5)} RestartRequest 80BB8003")
        assert npu_problem(standin)["lastTransitionTime"] == problem["lastTransitionTime"]  # still True

        fake.recover(2, 0x80E18402)
        fake.recover(5, 0x80BB8003)
        wait_until(lambda: npu_problem(standin).get("status") == "False", 5, "the condition False again")
        recovered = npu_problem(standin)

        # The kubelet's conditions were never lost, nor the agent's: each patch named its own only.
        assert kubelet.patches > 10
        wait_until(lambda: conditions(standin)["Ready"]["lastHeartbeatTime"] == kubelet.last, 2, "the kubelet's last")
        assert set(conditions(standin)) == {"Ready", "MemoryPressure", "NPUProblem"}
        assert conditions(standin)["Ready"]["reason"] == "KubeletReady"  # kept from before the kubelet's patches

        # SIGTERM leaves the condition; a restart writes it again without a blink, its transition kept.
        agent.stop()
        fake.close()
        assert npu_problem(standin) == recovered
        restarted, _ = start_agent(devices={"poll_interval_seconds": 1}, env={"KUBECONFIG": kubeconfig},
                                   kubernetes=kubernetes(node_condition=True, pod_resources_socket=""))
        wait_until(lambda: (restarted.metric("npu_agent_fault_reports_total", sink="node-condition",
                                             result="written") or 0) >= 1, 10, "the restarted agent's first write")
        after = npu_problem(standin)
        assert after["status"] == "False" and after["lastTransitionTime"] == recovered["lastTransitionTime"]
        assert after["lastHeartbeatTime"] >= recovered["lastHeartbeatTime"]
        assert restarted.metric("npu_agent_node_condition", status="False") == 1
    assert statuses_since(standin, since) == ["False", "True", "False"]
    # Written only with strategic merge patches of the status subresource, never a whole-object update.
    agents = [(m, p) for m, p in standin.requests if p.startswith("/api/v1/nodes")]
    assert agents and {m for m, _ in agents} == {"PATCH", "GET"}  # GET: the watch's list
    assert {p.split("?")[0] for m, p in agents if m == "PATCH"} == {STATUS_PATH}


def test_the_condition_is_unknown_while_the_driver_cannot_be_read(start_agent, kube, tmp_path):
    standin, kubeconfig = kube
    standin.put(node_object(ready()))
    agent, _ = start_agent(library=str(tmp_path / "missing" / "libdcmi.so"), wait_ready=False,
                           env={"KUBECONFIG": kubeconfig}, kubernetes=kubernetes(node_condition=True,
                                                                                 pod_resources_socket=""))
    wait_until(lambda: npu_problem(standin).get("status") == "Unknown", 10, "the condition Unknown")
    condition = npu_problem(standin)
    assert condition["reason"] == "NPUStateUnknown"
    assert condition["message"].startswith("the NPU driver cannot be read: dcmi backend unavailable")
    wait_until(lambda: agent.metric("npu_agent_node_condition", status="Unknown") == 1, 5, "the status exported")


def test_with_the_feature_off_an_earlier_runs_condition_is_removed_and_the_kubelets_stay(start_agent, kube):
    standin, kubeconfig = kube
    left = {"type": "NPUProblem", "status": "True", "reason": "SeparateNPU", "message": "NPU1 SeparateNPU 80E18402",
            "lastHeartbeatTime": "2025-01-01T00:00:00Z", "lastTransitionTime": "2025-01-01T00:00:00Z"}
    standin.put(node_object(ready(), left))
    agent, _ = start_agent(env={"KUBECONFIG": kubeconfig}, kubernetes=kubernetes(pod_resources_socket=""))
    agent.wait_for_log("no node condition: removed any an earlier run left")
    assert set(conditions(standin)) == {"Ready"} and conditions(standin)["Ready"] == ready()
    patches = [p for m, p in standin.requests if m == "PATCH"]
    assert patches == [STATUS_PATH]  # one patch, nothing read first
    assert agent.metric("npu_agent_node_condition", status="True") is None  # no such family with the feature off


def test_a_missing_grant_is_named_on_readyz_and_not_when_the_feature_is_off(start_agent, tmp_path):
    with KubeStandIn(rbac=True) as standin:
        standin.add_service_account_token("agent-token", "npu-system", "npu-node-agent")
        kubeconfig = standin.write_kubeconfig(tmp_path / "kubeconfig", token="agent-token")
        standin.put(node_object(ready()))

        # Off: the removal's 403 is one line at info, and the agent is ready.
        # Nothing else that calls the API server: only this grant is missing.
        alone = dict(env={"KUBECONFIG": kubeconfig}, profiling={"metrics": False})
        off, _ = start_agent(**alone, kubernetes=kubernetes(pod_resources_socket=""))
        line = off.wait_for_log("cannot remove an earlier run's node condition (kubernetes.node_condition is off); "
                                "leaving it")
        assert line["level"] == "info" and "403" in line["reason"]
        assert off.http("/readyz")[0] == 200
        off.stop()

        on, _ = start_agent(wait_ready=False, **alone,
                            kubernetes=kubernetes(node_condition=True, pod_resources_socket=""))
        wait_until(lambda: on.http("/readyz")[0] == 503 and "nodes/status" in on.http("/readyz")[1], 15,
                   "/readyz naming the grant")
        reason = on.http("/readyz")[1]
        assert "node-condition" in reason and "needs patch on nodes/status" in reason, reason
        assert 'cannot patch resource "nodes/status"' in reason, reason
        assert on.metric("npu_agent_fault_reports_total", sink="node-condition", result="forbidden") >= 1
        standin.allow(user="system:serviceaccount:npu-system:npu-node-agent", verbs=("patch",),
                      resources=("nodes/status",))
        wait_until(lambda: npu_problem(standin).get("status") == "False", 20, "written once granted")
        wait_until(lambda: on.http("/readyz")[0] == 200, 10, "ready once granted")
        on.wait_for_log("node condition written again")
