"""The NPUProblem condition: what it says (pure), and how the sink writes it to a Kubernetes API
stand-in over a socket (its heartbeat, batching, start grace, retries), with a fake clock."""

from __future__ import annotations

import asyncio

from agent.common.executor import Executor
from agent.faults.hub import FaultHub
from agent.model import ActiveCode, Change, DeviceState, Health, Level, PodRef, Sink
from agent.sinks.nodecondition.condition import MESSAGE_LIMIT, Condition, bounded, npu_problem
from agent.sinks.nodecondition.sink import NodeConditionSink, StaleConditionRemoval
from testkit.fakes.kube import KubeStandIn
from testkit.wait import until
from tests.support.clock import FakeClock

NODE = "n1"


def state(phy: int, *codes: tuple[str, Level], health: Health = Health.HEALTHY) -> DeviceState:
    active = tuple(ActiveCode(int(text, 16), text, level, 1) for text, level in codes)
    return DeviceState(phy, phy, health, max((c.level for c in active), default=Level.NormalNPU), 1 if active else 0,
                       active)


def pods(phy: int) -> tuple[PodRef, ...]:
    return {1: (PodRef("demo", "worker-0", "main"), PodRef("demo", "worker-0", "sidecar")),
            3: (PodRef("a", "x", "c"), PodRef("b", "y", "c"))}.get(phy, ())


def test_the_condition_names_the_worst_level_and_each_faulty_npu_worst_first():
    states = [state(0), state(1, ("80E01801", Level.SeparateNPU)), state(2, health=Health.UNHEALTHY),
              state(3, ("80BB8003", Level.RestartRequest), ("80E18402", Level.SeparateNPU)),
              state(4, health=Health.UNKNOWN)]
    condition = npu_problem(states, pods, polled=True)
    assert condition == Condition("True", "SeparateNPU", "NPU1 SeparateNPU 80E01801 (pod demo/worker-0); "
                                                         "NPU3 SeparateNPU 80BB8003,80E18402 (pods a/x, b/y); "
                                                         "NPU2 unhealthy, no fault code; NPU4 health unreadable")
    assert npu_problem([state(2, health=Health.UNHEALTHY)], pods, polled=True).reason == "NPUUnhealthy"
    assert npu_problem([state(0), state(1)], pods, polled=True) == Condition(
        "False", "NPUsHealthy", "2 NPUs healthy, no active fault code")


def test_only_a_fault_that_interrupts_the_workload_or_an_unhealthy_npu_without_a_code_makes_it_true():
    assert npu_problem([state(0, ("80BB8003", Level.RestartRequest))], pods, polled=True) == Condition(
        "True", "RestartRequest", "NPU0 RestartRequest 80BB8003")
    # Codes that leave the workload running: False (no drain), the worst level as reason, the NPUs listed.
    low = [state(0), state(1, ("81078603", Level.NotHandleFault)), state(2, ("80E01801", Level.SubHealthFault))]
    assert npu_problem(low, pods, polled=True) == Condition(
        "False", "SubHealthFault", "NPU2 SubHealthFault 80E01801; NPU1 NotHandleFault 81078603 (pod demo/worker-0)")
    assert npu_problem([state(0, ("80E01801", Level.NormalNPU))], pods, polled=True) == Condition(
        "False", "NormalNPU", "NPU0 NormalNPU 80E01801")
    # A low-level code beside an unhealthy NPU without one: True, for the unhealthy one.
    assert npu_problem([state(0, ("81078603", Level.NotHandleFault)), state(1, health=Health.UNHEALTHY)], pods,
                       polled=True).status == "True"
    # A low-level code beside an unreadable NPU: the agent cannot tell.
    unknown = npu_problem([state(0, ("81078603", Level.NotHandleFault)), state(1, health=Health.UNKNOWN)], pods,
                          polled=True)
    assert (unknown.status, unknown.message) == ("Unknown", "NPU0 NotHandleFault 81078603; NPU1 health unreadable")


def test_the_condition_is_unknown_until_every_npu_was_polled_and_while_the_driver_cannot_be_read():
    faulty = [state(1, ("80E01801", Level.SeparateNPU))]
    assert npu_problem(faulty, pods, polled=False) == Condition(
        "Unknown", "NPUStateUnknown", "the agent has not polled every NPU since it started")
    assert npu_problem(faulty, pods, polled=True, driver_problem="dcmi backend unavailable: gone") == Condition(
        "Unknown", "NPUStateUnknown", "the NPU driver cannot be read: dcmi backend unavailable: gone")
    assert npu_problem([state(0), state(1, health=Health.UNKNOWN)], pods, polled=True) == Condition(
        "Unknown", "NPUStateUnknown", "NPU1 health unreadable")
    assert npu_problem([], pods, polled=True).status == "Unknown"


def test_the_message_is_bounded_and_says_how_many_more():
    states = [state(phy, ("80E01801", Level.SeparateNPU), ("80E18402", Level.SeparateNPU)) for phy in range(64)]
    message = npu_problem(states, lambda phy: (PodRef("training-namespace", f"job-worker-{phy}", "c"),),
                          polled=True).message
    assert len(message.encode()) <= MESSAGE_LIMIT
    kept = message.split("; ")
    assert kept[-1] == f"... and {64 - (len(kept) - 1)} more" and len(kept) > 10
    assert kept[0] == "NPU0 SeparateNPU 80E01801,80E18402 (pod training-namespace/job-worker-0)"
    assert bounded(["x" * 2000]) == "x" * (MESSAGE_LIMIT - 3) + "..."
    cut = bounded(["x" * 2000, "y"])
    assert cut.endswith("...; ... and 1 more") and len(cut.encode()) <= MESSAGE_LIMIT
    assert bounded(["a", "b"], limit=4) == "a; b"


class Rig:
    """The sink over a hub the test fills, writing to a stand-in's node, on a fake clock."""

    def __init__(self, standin: KubeStandIn, **kwargs):
        self.standin = standin
        self.clock = FakeClock()
        self.hub = FaultHub(NODE)
        self.problem = ""
        self.executor = Executor(name="test")
        self.sink = NodeConditionSink(NODE, self.hub, pods, polled=lambda: self.hub.current,
                                      driver_problem=lambda: self.problem, kube=self.executor.lane("kube", 2),
                                      api_factory=standin.client, clock=self.clock,
                                      **{"recheck_s": 0.02, "retry_s": (0.01,), **kwargs})
        self.revision = 0

    def publish(self, *states: DeviceState) -> None:
        changes = []
        for device in states:
            self.revision += 1
            changes.append(Change(self.revision, device))
        self.hub.publish(changes)
        self.sink.notify(changes)

    def condition(self) -> dict:
        node = self.standin.get("Node", "", NODE) or {}
        return next((c for c in node.get("status", {}).get("conditions", []) if c["type"] == "NPUProblem"), {})

    def patches(self) -> int:
        return sum(1 for method, path in self.standin.requests if method == "PATCH")


async def looked_again(rig: Rig) -> None:
    """Until the sink has looked at the state at least once more, wholly after this call: what it
    decides then is final for the time on the fake clock (the look under way may predate the call)."""
    rounds = rig.sink.rounds
    await until(lambda: rig.sink.rounds >= rounds + 2, 5, "the sink looked at the state again")


def run(standin: KubeStandIn, body, **kwargs) -> None:
    async def main():
        rig = Rig(standin, **kwargs)
        await rig.sink.start()
        try:
            await body(rig)
        finally:
            await rig.sink.stop()
            rig.executor.close()

    asyncio.run(main())


def test_the_heartbeat_rewrites_an_unchanged_condition_and_keeps_its_transition():
    async def body(rig: Rig):
        rig.hub.current = True
        rig.publish(state(0), state(1))
        await until(lambda: rig.sink.counters["written"] == 1, 5, "the first write")
        first, written = rig.condition(), 1
        rig.clock.advance(0.5)  # within the heartbeat: nothing to write
        await looked_again(rig)
        assert rig.sink.counters["written"] == written
        rig.clock.advance(2.0)  # past the heartbeat period
        await until(lambda: rig.sink.counters["written"] == written + 1, 5, "the heartbeat's write")
        again = rig.condition()
        assert again["lastHeartbeatTime"] > first["lastHeartbeatTime"]
        assert {k: v for k, v in again.items() if k != "lastHeartbeatTime"} == {
            k: v for k, v in first.items() if k != "lastHeartbeatTime"}
        rig.clock.advance(2.5)
        await until(lambda: rig.sink.counters["written"] == written + 2, 5, "the next heartbeat")

    with KubeStandIn() as standin:
        standin.put({"kind": "Node", "metadata": {"name": NODE}, "status": {"conditions": []}})
        run(standin, body, heartbeat_s=2.0)


def test_changes_within_a_second_are_one_write_and_a_transition_moves_lasttransitiontime():
    async def body(rig: Rig):
        rig.hub.current = True
        rig.publish(state(0))
        await until(lambda: rig.sink.counters["written"] == 1, 5, "the first write")
        healthy = rig.condition()
        patches = rig.patches()
        rig.clock.advance(0.2)
        for _ in range(20):  # a burst of changes inside the second after the last write
            rig.publish(state(0, ("80E18402", Level.SeparateNPU)))
            rig.publish(state(0))
        rig.publish(state(0, ("80E18402", Level.SeparateNPU)))
        await looked_again(rig)
        assert rig.patches() == patches  # held until a second has passed since the last write
        rig.clock.advance(1.0)
        await until(lambda: rig.condition().get("status") == "True", 5, "the latest state written")
        assert rig.patches() == patches + 1
        assert rig.condition()["lastTransitionTime"] > healthy["lastTransitionTime"]

    with KubeStandIn() as standin:
        standin.put({"kind": "Node", "metadata": {"name": NODE}, "status": {"conditions": []}})
        run(standin, body)


def test_an_earlier_runs_condition_stands_through_the_start_grace_then_unknown_is_written():
    async def body(rig: Rig):
        await until(lambda: rig.sink.rounds >= 1, 5, "the state looked at")  # the clock stands: one look says it
        assert rig.patches() == 0 and rig.condition()["status"] == "True"  # not polled yet: left as it was
        rig.clock.advance(31)
        await until(lambda: rig.condition().get("status") == "Unknown", 5, "Unknown after the grace")
        assert rig.condition()["lastTransitionTime"] > "2025-01-01T00:00:00Z"
        rig.hub.current = True
        rig.publish(state(0, ("80E18402", Level.SeparateNPU)))
        rig.clock.advance(1)
        await until(lambda: rig.condition().get("status") == "True", 5, "True once polled")

    with KubeStandIn() as standin:
        standin.put({"kind": "Node", "metadata": {"name": NODE}, "status": {"conditions": [
            {"type": "NPUProblem", "status": "True", "reason": "SeparateNPU", "message": "NPU0 SeparateNPU 80E18402",
             "lastHeartbeatTime": "2025-01-01T00:00:00Z", "lastTransitionTime": "2025-01-01T00:00:00Z"}]}})
        run(standin, body)


def test_a_restart_keeps_the_transition_of_the_same_status_and_the_driver_failing_is_written_at_once():
    async def body(rig: Rig):
        rig.problem = "dcmi backend unavailable: libdcmi.so not found"
        await until(lambda: rig.sink.counters["written"] == 1, 5, "Unknown written at once, no grace")
        assert rig.condition()["lastTransitionTime"] == "2025-01-01T00:00:00Z"  # it was Unknown before
        assert rig.condition()["message"] == ("the NPU driver cannot be read: dcmi backend unavailable: "
                                              "libdcmi.so not found")

    with KubeStandIn() as standin:
        standin.put({"kind": "Node", "metadata": {"name": NODE}, "status": {"conditions": [
            {"type": "NPUProblem", "status": "Unknown", "reason": "NPUStateUnknown", "message": "old",
             "lastHeartbeatTime": "2025-01-01T00:00:00Z", "lastTransitionTime": "2025-01-01T00:00:00Z"}]}})
        run(standin, body)


def test_server_errors_and_a_missing_node_are_retried_and_logged_without_making_the_agent_unready(caplog):
    async def body(rig: Rig):
        async def tick():  # time passes: a write follows the last one by at least a second
            while True:
                rig.clock.advance(1.0)
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(tick())
        rig.hub.current = True
        rig.publish(state(0))
        await until(lambda: rig.sink.counters["error"] >= 3, 5, "the missing node retried")
        # A 404 (or a 5xx, an unreachable server) is no grant an operator must add: the agent stays ready.
        assert rig.sink.readiness() == (True, "")
        assert "404" in rig.sink.failing and f"no Node named {NODE!r}" in rig.sink.failing
        logged = [r for r in caplog.records if r.getMessage().startswith("cannot write the node condition")]
        assert len(logged) == 1 and f"nodes/{NODE}/status" in logged[0].reason  # once, however often retried
        rig.standin.fail_next("PATCH", "/status", 500, times=3)
        rig.standin.put({"kind": "Node", "metadata": {"name": NODE}, "status": {"conditions": []}})
        await until(lambda: rig.sink.counters["written"] == 1, 10, "written once the node exists")
        assert rig.condition()["status"] == "False" and rig.sink.readiness() == (True, "") and rig.sink.failing == ""
        assert rig.sink.counters["error"] >= 6 and rig.sink.counters["written"] == 1
        ticking.cancel()

    with KubeStandIn() as standin:
        run(standin, body)


def test_both_writers_are_what_the_agent_expects():
    executor = Executor(name="test")
    sink = NodeConditionSink(NODE, FaultHub(NODE), pods, polled=lambda: True, driver_problem=lambda: "",
                             kube=executor.lane("kube"))
    assert isinstance(sink, Sink) and sink.writes == () and sink.pending == 0
    assert StaleConditionRemoval(NODE, kube=executor.lane("kube")).readiness() == (True, "")
