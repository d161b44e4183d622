"""Kubernetes Events: client-go's correlation rules (pure, on given times), the events a device's
change makes, and the sink posting to an API stand-in over a socket: a flapping NPU, failures,
missing grants, expired events, a full queue."""

from __future__ import annotations

import asyncio
import logging

from agent.common.executor import Executor
from agent.faults.hub import FaultHub
from agent.model import ActiveCode, Change, DeviceState, Level, PodRef, Sink
from agent.sinks.events.correlator import COMBINED, EventCorrelator, ObjectRef, Recorded
from agent.sinks.events.sink import KubeEventsSink, fault_events
from testkit.fakes.kube import KubeStandIn
from testkit.wait import until
from tests.support.clock import FakeClock

NODE = "n1"
ON_NODE = ObjectRef("Node", NODE, uid=NODE)
T0 = 1_800_000_000.0


def recorded(message: str = "NPU1: fault 80E18402 occurred (SeparateNPU)", at: float = T0, reason="NPUFaultOccurred",
             involved: ObjectRef = ON_NODE) -> Recorded:
    return Recorded(involved, "Warning", reason, message, at)


def test_identical_events_patch_the_first_one_with_its_count():
    correlator = EventCorrelator(("npu-node-agent", NODE))
    first = correlator.correlate(recorded())
    assert (first.action, first.count, first.namespace) == ("create", 1, "default")
    assert first.name == f"{NODE}.{int(T0 * 1e9):x}"  # as client-go names them
    correlator.observed(first, first.name, 1)
    again = correlator.correlate(recorded(at=T0 + 5))
    assert (again.action, again.name, again.count, again.first_at) == ("patch", first.name, 2, T0)
    other = correlator.correlate(recorded("NPU2: fault 80E18402 occurred (SeparateNPU)", at=T0 + 6))
    assert other.action == "create" and other.name != first.name


def test_from_the_tenth_similar_message_events_combine_and_the_window_starts_over():
    correlator = EventCorrelator(("npu-node-agent", NODE))
    sent = [correlator.correlate(recorded(f"NPU{n}: fault occurred", at=T0 + n)) for n in range(12)]
    assert [s.combined for s in sent] == [False] * 9 + [True] * 3
    assert [s.action for s in sent[9:]] == ["create", "patch", "patch"]
    assert sent[11].event.message == COMBINED + "NPU11: fault occurred" and sent[11].count == 3
    assert len({s.name for s in sent[9:]}) == 1
    # A message already among the similar ones is not combined: it is itself, counted on.
    repeat = correlator.correlate(recorded("NPU3: fault occurred", at=T0 + 20))
    assert not repeat.combined and repeat.action == "patch" and repeat.name == sent[3].name
    # Another reason, type or object is another group.
    assert not correlator.correlate(recorded("NPU12: fault occurred", at=T0 + 21, reason="NPUFaultRecovered")).combined
    # Ten minutes after the last similar event the group starts over.
    later = correlator.correlate(recorded("NPU13: fault occurred", at=T0 + 21 + 601))
    assert not later.combined and later.action == "create"


def test_each_object_has_a_token_bucket_of_25_refilled_one_per_five_minutes():
    correlator = EventCorrelator(("npu-node-agent", NODE))
    pod = ObjectRef("Pod", "worker-0", "demo", "uid-1", "v1")
    node_sent = [correlator.correlate(recorded(at=T0 + n * 0.01)) for n in range(40)]
    assert sum(s is not None for s in node_sent) == 25 and all(node_sent[:25])
    assert correlator.correlate(recorded(involved=pod, at=T0 + 1)).namespace == "demo"  # its own bucket
    assert correlator.correlate(recorded(at=T0 + 100)) is None
    back = correlator.correlate(recorded(at=T0 + 301))
    # The drops were counted on: the next patch carries every occurrence.
    assert back is not None and back.action == "patch" and back.count == 42
    assert correlator.correlate(recorded(at=T0 + 302)) is None


def active(text: str, level: Level, escalated_by: str = "") -> ActiveCode:
    return ActiveCode(int(text, 16), text, level, 1, escalated_by=escalated_by)


def device(*codes: ActiveCode) -> DeviceState:
    return DeviceState(1, 1, level=max((c.level for c in codes), default=Level.NormalNPU), codes=codes)


def test_a_device_change_makes_occur_escalate_and_recover_events():
    assert fault_events(None, device(active("80E18402", Level.SeparateNPU))) == [
        ("Warning", "NPUFaultOccurred", "NPU1: fault 80E18402 occurred (SeparateNPU)")]
    base = device(active("81078603", Level.NotHandleFault), active("80E18402", Level.SeparateNPU))
    escalated = device(active("81078603", Level.PreSeparateNPU, "FaultDuration"), active("80E18402", Level.SeparateNPU))
    assert fault_events(base, escalated) == [
        ("Warning", "NPUFaultEscalated", "NPU1: fault 81078603 escalated from NotHandleFault to PreSeparateNPU by "
                                         "FaultDuration")]
    assert fault_events(escalated, escalated) == []
    frequency = device(active("81078603", Level.ManuallySeparateNPU, "FaultFrequency"))
    assert fault_events(escalated, frequency) == [
        ("Warning", "NPUFaultEscalated", "NPU1: fault 81078603 escalated from PreSeparateNPU to ManuallySeparateNPU by "
                                         "FaultFrequency"),
        ("Normal", "NPUFaultRecovered", "NPU1: fault 80E18402 recovered (was SeparateNPU)")]
    assert fault_events(device(), frequency) == [
        ("Warning", "NPUFaultOccurred",
         "NPU1: fault 81078603 occurred (ManuallySeparateNPU, escalated by FaultFrequency)")]


class Rig:
    def __init__(self, standin: KubeStandIn, holders=(), **kwargs):
        self.standin = standin
        self.executor = Executor(name="test")
        self.hub = FaultHub(NODE)
        self.sink = KubeEventsSink(NODE, self.hub, lambda phy: tuple(holders), kube=self.executor.lane("kube", 2),
                                   api_factory=standin.client, **{"retry_s": (0.01,), **kwargs})
        self.revision = 0

    def flap(self, times: int, code: str = "80E18402") -> None:
        for _ in range(times):
            for state in (device(active(code, Level.SeparateNPU)), device()):
                self.revision += 1
                self.sink.notify([Change(self.revision, state)])

    def writes(self, namespace: str = "default") -> int:
        return sum(1 for method, path in self.standin.requests
                   if method in ("POST", "PATCH") and path.startswith(f"/api/v1/namespaces/{namespace}/events"))

    def events(self, namespace: str = "default") -> list[dict]:
        return self.standin.list("Event", namespace)


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


def test_an_npu_flapping_hundreds_of_times_costs_the_api_server_25_requests_per_object():
    async def body(rig: Rig):
        rig.flap(300)
        await until(lambda: sum(rig.sink.counters.values()) == 50, 20, "every request answered")
        assert rig.sink.queued == 0 and rig.sink.dropped["rate_limited"] == 1200 - 50
        assert rig.sink.recorded["NPUFaultOccurred"] == rig.sink.recorded["NPUFaultRecovered"] == 600
        assert rig.writes("default") == 25 and rig.writes("demo") == 25
        reads = [path for method, path in rig.standin.requests if method == "GET"]
        assert reads == ["/api/v1/namespaces/demo/pods/worker-0"]  # its uid, once
        on_pod = {e["reason"]: e for e in rig.events("demo")}
        assert on_pod["NPUFaultOccurred"]["count"] == 13 and on_pod["NPUFaultRecovered"]["count"] == 12
        assert on_pod["NPUFaultOccurred"]["involvedObject"]["uid"] == uid
        assert rig.sink.counters == {"created": 4, "patched": 46}

    with KubeStandIn() as standin:
        uid = standin.put({"kind": "Pod", "metadata": {"name": "worker-0", "namespace": "demo"}})["metadata"]["uid"]
        # The queue holds the whole burst (the test records it without yielding); the uid stays cached.
        run(standin, body, holders=[PodRef("demo", "worker-0", "main"), PodRef("demo", "worker-0", "sidecar")],
            queue_limit=1200, uid_ttl_s=3600.0)


def test_a_pod_recreated_under_the_same_name_is_another_object_with_its_own_events():
    clock = FakeClock()

    async def body(rig: Rig):
        rig.flap(1)
        await until(lambda: rig.sink.counters["created"] == 4, 5, "node and pod events created")
        rig.standin.delete("Pod", "demo", "worker-0")  # the job controller recreates the pod after the fault
        new_uid = rig.standin.put({"kind": "Pod", "metadata": {"name": "worker-0", "namespace": "demo"}})[
            "metadata"]["uid"]
        clock.advance(11)  # past the uid's short cache
        rig.flap(1)
        await until(lambda: rig.sink.counters["created"] == 6 and rig.sink.counters["patched"] == 2, 5, "sent")
        on_pod = sorted((e["involvedObject"]["uid"], e["reason"], e["count"]) for e in rig.events("demo"))
        assert on_pod == sorted([(old_uid, "NPUFaultOccurred", 1), (old_uid, "NPUFaultRecovered", 1),
                                 (new_uid, "NPUFaultOccurred", 1), (new_uid, "NPUFaultRecovered", 1)])
        assert sorted(e["count"] for e in rig.events("default")) == [2, 2]  # the node is the same object

    with KubeStandIn() as standin:
        old_uid = standin.put({"kind": "Pod", "metadata": {"name": "worker-0", "namespace": "demo"}})["metadata"]["uid"]
        run(standin, body, holders=[PodRef("demo", "worker-0", "main")], clock=clock)


def test_events_in_a_namespace_being_deleted_or_gone_are_dropped_quietly_and_the_agent_stays_ready(caplog):
    caplog.set_level(logging.INFO, logger="agent.sinks.events.sink")

    async def body(rig: Rig):
        rig.flap(2)
        await until(lambda: rig.sink.dropped["namespace_gone"] == 8 and rig.sink.queued == 0, 5, "dropped")
        assert rig.sink.counters["created"] == 2 and rig.sink.counters["patched"] == 2  # the node's go out
        assert rig.sink.readiness() == (True, "") and rig.sink.dropped["failed"] == 0
        assert rig.events("ending") == [] and rig.events("gone") == []
        dropped = [r for r in caplog.records if r.getMessage().startswith("a pod's namespace is being deleted")]
        assert sorted(r.namespace for r in dropped) == ["ending", "gone"]  # once each
        unread = [r for r in caplog.records if r.getMessage().startswith("cannot read the uid")]
        assert [r.pod for r in unread] == ["gone/p"]  # once, however many events

    with KubeStandIn() as standin:
        standin.put({"kind": "Pod", "metadata": {"name": "q", "namespace": "ending"}})
        standin.terminate_namespace("ending")
        run(standin, body, holders=[PodRef("gone", "p", "c"), PodRef("ending", "q", "c")], uid_ttl_s=0.0)


def test_a_failing_post_is_retried_then_dropped_and_counted_and_the_next_one_goes_out():
    async def body(rig: Rig):
        rig.standin.fail_next("POST", "/events", 500, times=3)
        rig.flap(1)
        await until(lambda: rig.sink.dropped["failed"] == 1, 5, "the first dropped after 3 tries")
        await until(lambda: rig.sink.counters["created"] == 1, 5, "the next one created")
        assert [e["reason"] for e in rig.events()] == ["NPUFaultRecovered"]
        assert rig.sink.readiness() == (True, "")  # events are best-effort: a failure is not unreadiness
        rig.flap(1)  # the dropped one is created, not patched
        await until(lambda: rig.sink.counters["created"] == 2 and rig.sink.counters["patched"] == 1, 5, "sent")
        assert sorted((e["reason"], e["count"]) for e in rig.events()) == [
            ("NPUFaultOccurred", 1), ("NPUFaultRecovered", 2)]

    with KubeStandIn() as standin:
        run(standin, body, tries=3)


def test_a_missing_grant_shows_on_readiness_until_a_post_succeeds():
    async def body(rig: Rig):
        rig.flap(1)
        await until(lambda: rig.sink.dropped["failed"] == 2, 5, "both refused, not retried")
        ready, why = rig.sink.readiness()
        assert not ready and "needs create and patch on events" in why and "403" in why
        assert sum(1 for method, _ in rig.standin.requests if method == "POST") == 2
        rig.standin.allow(user="agent", verbs=("create", "patch"), resources=("events",))
        rig.flap(1)
        await until(lambda: rig.sink.counters["created"] == 2, 5, "posted once granted")
        assert rig.sink.readiness() == (True, "")

    with KubeStandIn(rbac=True) as standin:
        standin.add_token("t", "agent")
        kube_client = standin.client

        class Standin:  # the stand-in as the agent's token sees it
            requests = property(lambda self: standin.requests)
            allow = staticmethod(standin.allow)
            list = staticmethod(standin.list)

            @staticmethod
            def client():
                return kube_client(token="t")

        run(Standin(), body)


def test_an_expired_event_is_created_again_and_a_full_queue_drops_the_newest():
    async def body(rig: Rig):
        rig.flap(1)
        await until(lambda: rig.sink.counters["created"] == 2, 5, "both created")
        ttl_clock.advance(61)
        assert rig.events() == []  # expired by the API server's TTL
        rig.flap(1)
        await until(lambda: rig.sink.counters["created"] == 4, 5, "created again after the patch found nothing")
        assert sorted(e["count"] for e in rig.events()) == [2, 2]
        # Held requests: the queue fills up to its limit and the newest are dropped, counted.
        rig.standin.hang("POST", "/events", times=1)
        rig.standin.event_ttl = 3600
        rig.flap(1, code="80E18403")
        await until(lambda: rig.standin.held == 1, 5, "the first post held")
        rig.flap(2, code="80E18403")  # 4 more beside the one waiting: 1 waits too, 3 are dropped
        assert rig.sink.queued == 2 and rig.sink.dropped["queue_full"] == 3
        rig.standin.release()
        await until(lambda: rig.sink.queued == 0 and rig.sink.counters["created"] == 6, 5, "the queue drained")
        # The dropped ones never counted: occurred was sent twice, recovered once, and the next go on from there.
        rig.flap(1, code="80E18403")
        await until(lambda: rig.sink.queued == 0 and rig.sink.counters["patched"] == 3, 5, "sent")
        assert sorted(e["count"] for e in rig.events() if "80E18403" in e["message"]) == [2, 3]

    ttl_clock = FakeClock()
    with KubeStandIn(event_ttl=60, clock=ttl_clock) as standin:
        run(standin, body, queue_limit=2)


def test_the_sink_is_a_sink():
    sink = KubeEventsSink(NODE, FaultHub(NODE), lambda phy: (), kube=Executor(name="test").lane("kube"))
    assert isinstance(sink, Sink) and sink.writes == () and sink.pending == 0
