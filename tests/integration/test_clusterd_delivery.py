"""Fault delivery to ClusterD: the real agent, the fake driver, and a ClusterD stand-in with its rules."""

from __future__ import annotations

import signal
import time

import pytest

from agent.faults.pubfault import fault_id
from tests.fakes.clusterd import ClusterdStandIn
from tests.integration.conftest import phy
from tests.integration.harness import wait_until

NODE = "test-node"
SEPARATE, RESTART = "020011001", "020011002"


@pytest.fixture
def clusterd():
    with ClusterdStandIn() as standin:
        yield standin


def with_clusterd(standin: ClusterdStandIn) -> dict:
    return {"clusterd": {"enabled": True, "address": f"127.0.0.1:{standin.port}"}}


def fid(logic: int, code: str) -> str:
    return fault_id(NODE, phy(logic), code)


def collapsed(assertions: list[str]) -> list[str]:
    """Consecutive repeats are harmless (ClusterD ignores a repeated occur); order is what counts."""
    return [a for i, a in enumerate(assertions) if i == 0 or assertions[i - 1] != a]


def active_ids(standin: ClusterdStandIn) -> set[str]:
    return {key[2] for key in standin.active()}


def no_silent_drops(standin: ClusterdStandIn) -> None:
    assert standin.dropped_faults() == []
    assert {r.code for r in standin.requests} <= {0}, [(r.code, r.info) for r in standin.requests if r.code]


def wait_past_deferred_deletions(standin: ClusterdStandIn, agent) -> None:
    """Until the agent owes nothing and every deletion ClusterD may have queued (5 s after a request) is due."""
    wait_until(lambda: agent.metric("npu_agent_outbox_pending") == 0
               and agent.metric("npu_agent_clusterd_deferred_occurs") == 0, 10, "nothing owed to clusterd")
    deadline = standin.requests[-1].at + 5.5
    standin.wait_for(lambda s: time.time() > deadline, timeout=10)


def test_a_fault_reaches_clusterd_and_its_recovery_follows(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    fake.occur(2, 0x80E18402, severity=3)
    clusterd.wait_for(lambda s: fid(2, SEPARATE) in active_ids(s), timeout=2)
    stored = next(v for k, v in clusterd.active().items() if k[2] == fid(2, SEPARATE))
    fault = stored.fault
    assert (fault.faultType, fault.faultCode, list(fault.influence[0].deviceIds)) == ("NPU", SEPARATE, [phy(2)])
    assert fault.influence[0].nodeName == NODE and stored.level == "SeparateNPU"
    assert fault.faultLocation["codes"] == "80E18402"
    fake.recover(2, 0x80E18402)
    clusterd.wait_for(lambda s: s.assertions(fid(2, SEPARATE)) == ["occur", "recover"], timeout=4)
    recover = [f for r in clusterd.requests for f in r.request.faults if f.assertion == "recover"][0]
    assert recover.faultTime == fault.faultTime  # the fault's start, repeated in the recover
    clusterd.wait_for(lambda s: not s.active(), timeout=8)  # ClusterD deletes it 5 s after the occur
    no_silent_drops(clusterd)
    wait_until(lambda: agent.metric("npu_agent_outbox_pending") == 0, 3, "outbox drained")
    assert agent.metric("npu_agent_fault_reports_total", sink="clusterd", result="sent") == 2


def test_nothing_is_lost_across_a_clusterd_outage(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    clusterd.stop()
    fake.occur(1, 0x80E18402)
    wait_until(lambda: agent.fault_of(phy(1)), 2, "fault seen by the agent")
    fake.recover(1, 0x80E18402)
    wait_until(lambda: not agent.fault_of(phy(1)), 3, "recovery seen by the agent")
    fake.occur(3, 0x80E18005)
    wait_until(lambda: agent.fault_of(phy(3)), 2, "second fault seen")
    assert agent.metric("npu_agent_outbox_pending") >= 3
    clusterd.start()
    clusterd.wait_for(lambda s: fid(3, RESTART) in active_ids(s), timeout=40)
    clusterd.wait_for(lambda s: s.assertions(fid(1, SEPARATE)) == ["occur", "recover"], timeout=10)
    assert collapsed(clusterd.assertions(fid(3, RESTART))) == ["occur"]
    no_silent_drops(clusterd)
    wait_until(lambda: agent.metric("npu_agent_outbox_pending") == 0, 3, "outbox drained")


def test_nothing_is_lost_when_the_agent_is_killed_during_a_send(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    clusterd.delay(3)  # the request is in flight when the agent dies
    fake.occur(4, 0x80E18402)
    wait_until(lambda: agent.fault_of(phy(4)), 2, "fault seen by the agent")
    agent.process.send_signal(signal.SIGKILL)
    agent.process.wait(5)
    fake.close()
    clusterd.delay(0)
    # The fake driver lives in the agent's process: after the restart the chip is healthy again,
    # so the restarted agent owes ClusterD the occur (if it never landed) and then the recover.
    agent2, _ = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    clusterd.wait_for(lambda s: collapsed(s.assertions(fid(4, SEPARATE))) == ["occur", "recover"], timeout=20)
    no_silent_drops(clusterd)


def test_outage_and_agent_kill_at_once(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    clusterd.stop()
    fake.occur(5, 0x80E18005)
    fake.occur(6, 0x80E18402)
    wait_until(lambda: agent.fault_of(phy(5)) and agent.fault_of(phy(6)), 2, "faults seen by the agent")
    agent.process.send_signal(signal.SIGKILL)
    agent.process.wait(5)
    fake.close()
    clusterd.start()
    agent2, fake2 = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    # The restarted driver starts healthy: both faults recover; then device 6 fails again at once.
    fake2.occur(6, 0x80E18402)
    clusterd.wait_for(lambda s: collapsed(s.assertions(fid(5, RESTART))) == ["occur", "recover"], timeout=20)
    # (readiness means the first poll is done, so the restarted agent has seen device 6 healthy.)
    # The restarted sink holds its first request until the dead run's request can no longer land,
    # so device 6's recover and re-occur usually wait in one batch and coalesce: ClusterD keeps it.
    clusterd.wait_for(lambda s: fid(6, SEPARATE) in active_ids(s), timeout=20)
    assert collapsed(clusterd.assertions(fid(6, SEPARATE))) in (["occur"], ["occur", "recover", "occur"])
    wait_until(lambda: agent2.metric("npu_agent_outbox_pending") == 0, 10, "outbox drained")
    wait_past_deferred_deletions(clusterd, agent2)
    assert fid(6, SEPARATE) in active_ids(clusterd)
    assert fid(5, RESTART) not in active_ids(clusterd)
    no_silent_drops(clusterd)


def test_flapping_devices_stay_within_one_request_per_second_and_end_consistent(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    first = len(clusterd.requests)
    for round_ in range(6):
        for logic in range(8):
            (fake.occur if round_ % 2 == 0 else fake.recover)(logic, 0x80E18402)
        wait_until(lambda: all(bool(agent.fault_of(phy(l))) == (round_ % 2 == 0) for l in range(8)), 4,
                   f"round {round_} seen by the agent")
    for logic in range(0, 8, 2):
        fake.occur(logic, 0x80E18402)  # end with half of the devices faulty
    wanted = {fid(logic, SEPARATE) for logic in range(0, 8, 2)}
    clusterd.wait_for(lambda s: active_ids(s) == wanted and agent.metric("npu_agent_outbox_pending") == 0,
                      timeout=60)
    times = sorted(r.at for r in clusterd.requests[first:])
    # Sustained rate: never more than the burst (2) plus one per second in any window.
    for i, start in enumerate(times):
        in_window = [t for t in times[i:] if t - start < 5.0]
        assert len(in_window) <= 5 + 2, f"{len(in_window)} requests within 5 s"
    for logic in range(8):
        sequence = collapsed(clusterd.assertions(fid(logic, SEPARATE)))
        assert sequence[::2] == ["occur"] * len(sequence[::2]) and sequence[1::2] == ["recover"] * len(sequence[1::2])
    no_silent_drops(clusterd)


def test_a_recover_and_quick_reoccur_keeps_the_fault_at_clusterd(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    fake.occur(3, 0x80E18402)
    clusterd.wait_for(lambda s: fid(3, SEPARATE) in active_ids(s), timeout=3)
    fake.recover(3, 0x80E18402)
    clusterd.wait_for(lambda s: s.assertions(fid(3, SEPARATE)) == ["occur", "recover"], timeout=4)
    fake.occur(3, 0x80E18402)  # within ClusterD's 5 s: an occur now would be ignored, then deleted
    fake.occur(4, 0x80E18005)  # another device is not held up meanwhile
    clusterd.wait_for(lambda s: fid(4, RESTART) in active_ids(s), timeout=3)
    assert clusterd.assertions(fid(3, SEPARATE)) == ["occur", "recover"]
    assert agent.metric("npu_agent_clusterd_deferred_occurs") == 1
    clusterd.wait_for(lambda s: s.assertions(fid(3, SEPARATE)) == ["occur", "recover", "occur"], timeout=8)
    at = {f.assertion: r.at for r in clusterd.requests for f in r.request.faults if f.faultId == fid(3, SEPARATE)}
    assert at["occur"] - at["recover"] >= 5.0
    wait_past_deferred_deletions(clusterd, agent)
    assert {fid(3, SEPARATE), fid(4, RESTART)} <= active_ids(clusterd)
    no_silent_drops(clusterd)


def test_a_fault_that_flaps_during_an_outage_stays_at_clusterd(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    fake.occur(1, 0x80E18402)
    clusterd.wait_for(lambda s: fid(1, SEPARATE) in active_ids(s), timeout=3)
    clusterd.stop()
    for _ in range(3):
        fake.recover(1, 0x80E18402)
        wait_until(lambda: not agent.fault_of(phy(1)), 3, "recovery seen by the agent")
        fake.occur(1, 0x80E18402)
        wait_until(lambda: agent.fault_of(phy(1)), 2, "fault seen again by the agent")
    fake.occur(2, 0x80E18402)
    wait_until(lambda: agent.fault_of(phy(2)), 2, "second fault seen")
    clusterd.start()
    clusterd.wait_for(lambda s: fid(2, SEPARATE) in active_ids(s), timeout=40)
    wait_until(lambda: agent.metric("npu_agent_outbox_pending") == 0, 3, "outbox drained")
    # The first recover was already being retried when the rest came; the pairs after it that
    # ClusterD could not have kept apart were not sent, and counted.
    assert agent.metric("npu_agent_clusterd_coalesced_transitions_total") >= 4
    wait_past_deferred_deletions(clusterd, agent)
    assert {fid(1, SEPARATE), fid(2, SEPARATE)} <= active_ids(clusterd)
    assert collapsed(clusterd.assertions(fid(1, SEPARATE))) in (["occur"], ["occur", "recover", "occur"])
    no_silent_drops(clusterd)
