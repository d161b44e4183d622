"""Fault delivery to ClusterD: the real agent, the fake driver, and a ClusterD stand-in with ClusterD's rules,
its one delete queue for every sender in whole seconds, its late save and its restarts."""

from __future__ import annotations

import json
import signal
import time

import pytest

from testkit.fakes.clusterd import DEFAULT_CONFIG, ClusterdStandIn, OtherSender
from testkit.wait import wait_until
from tests.integration.conftest import phy
from tests.support.clock import FakeClock

NODE = "test-node"
SEPARATE, RESTART = "020011001", "020011002"
HBM, AICORE = 0x80E18402, 0x80E18005  # SeparateNPU, RestartNPU


@pytest.fixture
def clusterd():
    with ClusterdStandIn() as standin:
        yield standin


def with_clusterd(standin: ClusterdStandIn, **settings) -> dict:
    return {"clusterd": {"enabled": True, "address": f"127.0.0.1:{standin.port}", **settings}}


def held(standin: ClusterdStandIn) -> dict[int, set[str]]:
    """Physical device -> the public codes ClusterD holds for it (for this node)."""
    out: dict[int, set[str]] = {}
    for (node, _, _), stored in standin.active().items():
        if node == NODE:
            for device in stored.fault.influence[0].deviceIds:
                out.setdefault(device, set()).add(stored.fault.faultCode)
    return out


def history(standin: ClusterdStandIn, logic: int) -> list[tuple[str, str]]:
    """(assertion, faultId) of every fault for the device that ClusterD accepted, in arrival order."""
    return [(f.assertion, f.faultId) for r in standin.requests if r.code == 0 for f in r.request.faults
            if f.influence[0].nodeName == NODE and list(f.influence[0].deviceIds) == [phy(logic)]]


def occurrences(standin: ClusterdStandIn, logic: int) -> list[list[str]]:
    """Per faultId, in order of first appearance, its assertions with repeats collapsed."""
    by_id: dict[str, list[str]] = {}
    for assertion, fid in history(standin, logic):
        seen = by_id.setdefault(fid, [])
        if not seen or seen[-1] != assertion:
            seen.append(assertion)
    return list(by_id.values())


def no_silent_drops(standin: ClusterdStandIn) -> None:
    assert standin.dropped_faults() == []
    assert {r.code for r in standin.requests} <= {0}, [(r.code, r.info) for r in standin.requests if r.code]


def settled(standin: ClusterdStandIn, agent, timeout: float = 20) -> None:
    """Until the agent owes ClusterD nothing and ClusterD has run every deletion it queued."""
    wait_until(lambda: agent.metric("npu_agent_outbox_pending") == 0, timeout, "nothing owed to clusterd")
    standin.wait_for(lambda s: not s.queue(), timeout=timeout)


def test_a_fault_reaches_clusterd_and_its_recovery_follows(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    fake.occur(2, HBM, severity=3)
    clusterd.wait_for(lambda s: held(s) == {phy(2): {SEPARATE}}, timeout=3)
    [stored] = clusterd.active().values()
    fault = stored.fault
    assert (fault.faultType, fault.faultCode, list(fault.influence[0].deviceIds)) == ("NPU", SEPARATE, [phy(2)])
    assert fault.influence[0].nodeName == NODE and stored.level == "SeparateNPU"
    assert fault.faultLocation["codes"] == "80E18402"
    assert abs(fault.faultTime / 1000 - time.time()) < 30
    fake.recover(2, HBM)
    clusterd.wait_for(lambda s: occurrences(s, 2) == [["occur", "recover"]], timeout=4)
    recover = [f for r in clusterd.requests for f in r.request.faults if f.assertion == "recover"][0]
    assert recover.faultTime == fault.faultTime and recover.faultId == fault.faultId
    clusterd.wait_for(lambda s: not s.active(), timeout=10)  # ClusterD deletes it ~5 s after the occur
    no_silent_drops(clusterd)
    wait_until(lambda: agent.metric("npu_agent_outbox_pending") == 0, 3, "outbox drained")
    assert agent.metric("npu_agent_fault_reports_total", sink="clusterd", result="sent") == 2
    assert agent.metric("npu_agent_clusterd_public_faults") == 0


def test_a_recover_and_quick_reoccur_is_a_new_fault_sent_at_once(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    fake.occur(3, HBM)
    clusterd.wait_for(lambda s: phy(3) in held(s), timeout=3)
    fake.recover(3, HBM)
    clusterd.wait_for(lambda s: occurrences(s, 3) == [["occur", "recover"]], timeout=4)
    recovered_at = clusterd.requests[-1].at
    fake.occur(3, HBM)  # within ClusterD's 5 s: the old key is still there, queued for deletion
    clusterd.wait_for(lambda s: len(occurrences(s, 3)) == 2, timeout=4)
    assert occurrences(clusterd, 3) == [["occur", "recover"], ["occur"]]
    assert clusterd.requests[-1].at - recovered_at < 4  # not held back until ClusterD deleted the old key
    settled(clusterd, agent)
    assert held(clusterd) == {phy(3): {SEPARATE}}
    no_silent_drops(clusterd)


def test_quick_recover_and_reoccur_cycles_never_lose_the_fault_while_other_senders_fill_the_delete_queue(
        start_agent):
    """ClusterD deletes a recovered key by key alone, from one queue for every sender, up to ~6 s after
    the recover. Here the queue always holds other senders' deletions and pops late in each second
    (the other sender's first request is noticed by the 0.95 s poll, and the queue never empties
    after it), and each cycle starts just after a second boundary: a re-occur of the same key after
    any fixed wait under ~5.9 s would be ignored and then deleted, in every cycle."""
    with ClusterdStandIn(poll_phase=0.95) as clusterd:
        agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
        wait_until(lambda: 0.5 < time.time() % 1 < 0.7, 2, "the middle of a second", interval=0.005)
        other = OtherSender(clusterd.port, jitter_s=0.1).start()
        clusterd.wait_for(lambda s: s.queue(), timeout=5)
        for cycle in range(4):
            devices = (2 * cycle, 2 * cycle + 1)
            wait_until(lambda: time.time() % 1 < 0.1, 2, "the start of a second", interval=0.005)
            for logic in devices:
                fake.occur(logic, HBM)
            clusterd.wait_for(lambda s: all(phy(l) in held(s) for l in devices), timeout=4)
            for logic in devices:
                fake.recover(logic, HBM)
            clusterd.wait_for(lambda s: all(history(s, l)[-1][0] == "recover" for l in devices), timeout=4)
            for logic in devices:
                fake.occur(logic, HBM)
            clusterd.wait_for(lambda s: all(history(s, l)[-1][0] == "occur" for l in devices), timeout=8)
            first_keys = {(NODE, "npu-node-agent", history(clusterd, l)[0][1]) for l in devices}
            clusterd.wait_for(lambda s: not first_keys & {key for _, key in s.queue()}, timeout=15)
            assert {phy(l) for l in devices} <= set(held(clusterd)), f"cycle {cycle}: a fault was lost"
        assert set(held(clusterd)) == {phy(logic) for logic in range(8)}
        other.stop()
        assert other.sent > 10 and other.rejected == 0
    no_silent_drops(clusterd)


def test_clusterd_restarted_without_its_saved_faults_holds_the_agent_set_again_within_seconds(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    fake.occur(0, HBM)
    fake.occur(5, AICORE)
    wanted = {phy(0): {SEPARATE}, phy(5): {RESTART}}
    clusterd.wait_for(lambda s: held(s) == wanted, timeout=4)
    settled(clusterd, agent)
    clusterd.restart(persisted=False)  # its ConfigMap was lost: it comes back empty
    restarted = time.monotonic()
    clusterd.wait_for(lambda s: held(s) == wanted, timeout=10)
    assert time.monotonic() - restarted < 8
    wait_until(lambda: (agent.metric("npu_agent_clusterd_reconciles_total", reason="connection lost") or 0) >= 1, 5,
               "the re-assertion counted")  # counted when ClusterD's answer is back, after it holds the faults
    no_silent_drops(clusterd)


def test_a_fault_recovered_just_before_a_clusterd_restart_does_not_come_back(start_agent):
    clock = FakeClock(time.time())  # ClusterD's time, moved by the test; it starts at the agent's real time
    with ClusterdStandIn(clock=clock, reload_delay_s=8) as clusterd:
        clock.advance(9)  # past its first reload: from now on it saves what it holds
        agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
        fake.occur(4, HBM)
        clusterd.wait_for(lambda s: phy(4) in held(s), timeout=3)
        fake.recover(4, HBM)
        clusterd.wait_for(lambda s: occurrences(s, 4) == [["occur", "recover"]], timeout=4)
        [(_, key)] = history(clusterd, 4)[:1]

        def recovers_since(at: float) -> int:
            return sum(1 for r in clusterd.requests if r.at >= at for f in r.request.faults
                       if f.assertion == "recover" and f.faultId == key)

        # Young when recovered, so ClusterD queued its deletion; a restart loses the queue, and its
        # saved cache still has the fault.
        assert clusterd.queue() and phy(4) in held(clusterd) and clusterd.persisted()
        clock.advance(0.5)  # (requests from now on are told apart by their time)
        clusterd.restart(persisted=True)
        assert not held(clusterd)  # it reloads its saved cache only some seconds after it serves
        clusterd.wait_for(lambda s: recovers_since(clock.now) >= 1, timeout=10)  # the agent noticed
        clock.advance(6)  # that recover's deletion runs before the reload ...
        clock.advance(3)  # ... which brings the fault back
        assert phy(4) in held(clusterd)
        reloaded = clock.now
        clusterd.wait_for(lambda s: recovers_since(reloaded) >= 1, timeout=60)  # the follow-up, 30-40 s later
        clock.advance(6)
        assert not held(clusterd)
        # ClusterD has the request once it is sent; the agent counts the re-assertion when its answer is back
        wait_until(lambda: (agent.metric("npu_agent_clusterd_reconciles_total", reason="follow-up") or 0) >= 1, 5,
                   "the follow-up counted")
        no_silent_drops(clusterd)


def test_a_reassertion_that_waits_out_an_outage_never_raises_a_fault_recovered_meanwhile(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    fake.occur(1, HBM)
    fake.occur(2, HBM)  # still faulty when ClusterD is back: the re-assertion has something to send
    clusterd.wait_for(lambda s: held(s) == {phy(1): {SEPARATE}, phy(2): {SEPARATE}}, timeout=4)
    settled(clusterd, agent)
    [(_, recovered)] = history(clusterd, 1)
    clusterd.stop()  # the connection drops: the agent re-asserts, and retries while ClusterD is away
    agent.wait_for_log("re-asserting public faults to clusterd", reason="connection lost")
    wait_until(lambda: agent.metric("npu_agent_fault_reports_total", sink="clusterd", result="unavailable"), 5,
               "the re-assertion failing")
    fake.recover(1, HBM)
    wait_until(lambda: not agent.fault_of(phy(1)), 3, "recovery seen by the agent")
    back = len(clusterd.requests)
    clusterd.start(persisted=False)  # back without its saved cache: what it holds now, the agent sent
    clusterd.wait_for(lambda s: phy(2) in held(s), timeout=15)
    settled(clusterd, agent)
    assert clusterd.requests[back:], "nothing was re-asserted"
    # ClusterD's cache after each request: the recovered fault never came back, not even for its delete delay.
    assert [r.at for r in clusterd.requests[back:] if (NODE, "npu-node-agent", recovered) in r.cached] == []
    assert held(clusterd) == {phy(2): {SEPARATE}}
    no_silent_drops(clusterd)


def test_a_slow_periodic_reconciliation_repairs_what_nothing_signalled(start_agent, clusterd):
    # (a small cluster: the period is the configured one, not stretched to share ClusterD's budget)
    agent, fake = start_agent(devices={"poll_interval_seconds": 1},
                              **with_clusterd(clusterd, reconcile_interval_seconds=30, cluster_nodes=1))
    fake.occur(2, HBM)
    clusterd.wait_for(lambda s: phy(2) in held(s), timeout=3)
    settled(clusterd, agent)
    before = len(clusterd.requests)
    clusterd.forget_all()  # behind a proxy, a ClusterD restart does not break the agent's connection
    clusterd.wait_for(lambda s: phy(2) in held(s), timeout=45)
    wait_until(lambda: (agent.metric("npu_agent_clusterd_reconciles_total", reason="periodic") or 0) >= 1, 5,
               "the re-assertion counted")  # counted when ClusterD's answer is back, after it holds the faults
    assert len(clusterd.requests) - before <= 3  # one request per reconciliation, nothing more
    no_silent_drops(clusterd)


def test_nothing_is_lost_across_a_clusterd_outage(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    clusterd.stop()
    fake.occur(1, HBM)
    wait_until(lambda: agent.fault_of(phy(1)), 2, "fault seen by the agent")
    fake.recover(1, HBM)
    wait_until(lambda: not agent.fault_of(phy(1)), 3, "recovery seen by the agent")
    fake.occur(3, AICORE)
    wait_until(lambda: agent.fault_of(phy(3)), 2, "second fault seen")
    assert agent.metric("npu_agent_outbox_pending") >= 2  # (the first may have gone into the start-up resync)
    clusterd.start()
    clusterd.wait_for(lambda s: phy(3) in held(s), timeout=40)
    settled(clusterd, agent)
    # Device 1's fault came and went while ClusterD was away: sent as a pair if its occur was already
    # on its way in a delivery, otherwise not at all (ClusterD keeps state, not history). In the
    # start-up resync, which is made again at each try, only its recover goes (a try may have landed).
    assert occurrences(clusterd, 1) in ([], [["occur", "recover"]], [["recover"]])
    assert occurrences(clusterd, 3) == [["occur"]]
    settled(clusterd, agent)
    assert held(clusterd) == {phy(3): {RESTART}}
    no_silent_drops(clusterd)


def test_nothing_is_lost_when_the_agent_is_killed_during_a_send(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    agent.wait_for_log("clusterd sink resynchronising ClusterD from the current state")  # the start is behind it
    clusterd.delay(3)  # the request is in flight when the agent dies
    fake.occur(4, HBM)
    wait_until(lambda: agent.fault_of(phy(4)), 2, "fault seen by the agent")
    agent.process.send_signal(signal.SIGKILL)
    agent.process.wait(5)
    fake.close()
    clusterd.delay(0)
    # The fake driver lives in the agent's process: after the restart the chip is healthy again,
    # so the restarted agent owes ClusterD the occur (if it never landed) and then the recover.
    agent2, _ = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    clusterd.wait_for(lambda s: occurrences(s, 4) == [["occur", "recover"]], timeout=20)
    settled(clusterd, agent2)
    assert not held(clusterd)
    no_silent_drops(clusterd)


def test_outage_and_agent_kill_at_once(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    clusterd.stop()
    fake.occur(5, AICORE)
    fake.occur(6, HBM)
    wait_until(lambda: agent.fault_of(phy(5)) and agent.fault_of(phy(6)), 2, "faults seen by the agent")
    agent.process.send_signal(signal.SIGKILL)
    agent.process.wait(5)
    fake.close()
    clusterd.start()
    agent2, fake2 = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    # The restarted driver starts healthy: both faults recover; then device 6 fails again at once.
    fake2.occur(6, HBM)
    clusterd.wait_for(lambda s: phy(6) in held(s), timeout=20)
    settled(clusterd, agent2)
    assert held(clusterd) == {phy(6): {SEPARATE}}
    # Device 5's fault came and went while ClusterD was away: whatever it was told ends in a recover.
    assert all(sequence[-1] == "recover" for sequence in occurrences(clusterd, 5))
    no_silent_drops(clusterd)


def test_flapping_devices_stay_within_one_request_per_second_and_end_consistent(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    first = len(clusterd.requests)
    for round_ in range(6):
        for logic in range(8):
            (fake.occur if round_ % 2 == 0 else fake.recover)(logic, HBM)
        wait_until(lambda: all(bool(agent.fault_of(phy(l))) == (round_ % 2 == 0) for l in range(8)), 4,
                   f"round {round_} seen by the agent")
    for logic in range(0, 8, 2):
        fake.occur(logic, HBM)  # end with half of the devices faulty
    wait_until(lambda: all(bool(agent.fault_of(phy(l))) == (l % 2 == 0) for l in range(8)), 4,
               "the last round seen by the agent")  # else nothing is owed yet and `settled` holds at once
    settled(clusterd, agent, timeout=60)
    assert held(clusterd) == {phy(logic): {SEPARATE} for logic in range(0, 8, 2)}
    times = sorted(r.at for r in clusterd.requests[first:])
    # Sustained rate: never more than the burst (2) plus one per second in any window.
    for i, start in enumerate(times):
        in_window = [t for t in times[i:] if t - start < 5.0]
        assert len(in_window) <= 5 + 2, f"{len(in_window)} requests within 5 s"
    for logic in range(8):
        for sequence in occurrences(clusterd, logic):
            assert sequence in (["occur"], ["occur", "recover"]), sequence  # every key: added once, removed once
    no_silent_drops(clusterd)


def test_a_fault_that_flaps_during_an_outage_stays_at_clusterd(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    fake.occur(1, HBM)
    clusterd.wait_for(lambda s: phy(1) in held(s), timeout=3)
    clusterd.stop()
    for _ in range(3):
        fake.recover(1, HBM)
        wait_until(lambda: not agent.fault_of(phy(1)), 3, "recovery seen by the agent")
        fake.occur(1, HBM)
        wait_until(lambda: agent.fault_of(phy(1)), 2, "fault seen again by the agent")
    fake.occur(2, HBM)
    wait_until(lambda: agent.fault_of(phy(2)), 2, "second fault seen")
    clusterd.start()
    clusterd.wait_for(lambda s: phy(2) in held(s), timeout=40)
    settled(clusterd, agent)
    assert held(clusterd) == {phy(1): {SEPARATE}, phy(2): {SEPARATE}}
    no_silent_drops(clusterd)


def test_a_broken_driver_clock_does_not_keep_a_fault_from_clusterd(start_agent, clusterd):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    fake.alarm_clock(1)  # the driver says the fault was raised one second after 1970 began
    fake.occur(7, HBM)
    clusterd.wait_for(lambda s: phy(7) in held(s), timeout=4)
    [stored] = clusterd.active().values()
    assert abs(stored.fault.faultTime / 1000 - time.time()) < 30  # when the agent saw it
    assert agent.metric("npu_agent_driver_fault_times_clamped_total") >= 1
    agent.wait_for_log("fault time too old to be true; using when the agent first saw the fault")
    no_silent_drops(clusterd)


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_fault_log_lost_or_cut_between_runs_still_delivers_and_clears(start_agent, clusterd, tmp_path, damage):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    fake.occur(0, HBM)
    clusterd.wait_for(lambda s: phy(0) in held(s), timeout=4)
    fake.recover(0, HBM)
    clusterd.wait_for(lambda s: occurrences(s, 0) == [["occur", "recover"]], timeout=4)
    for logic in (0, 1, 2):
        fake.occur(logic, HBM)
    clusterd.wait_for(lambda s: set(held(s)) == {phy(0), phy(1), phy(2)}, timeout=4)
    settled(clusterd, agent)
    agent.stop()
    fake.close()
    log = tmp_path / "state" / "faultlog" / "log"
    if damage == "deleted":
        log.unlink()
    else:  # keep the records up to device 0's first fault: its last word there is a fault long over
        lines = log.read_bytes().splitlines(keepends=True)
        first_fault = next(i for i, line in enumerate(lines) if b"80E18402" in line)
        log.write_bytes(b"".join(lines[:first_fault + 1]))
    # The restarted fake driver starts healthy: what ClusterD holds must be recovered, and new faults sent.
    agent2, fake2 = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    fake2.occur(3, AICORE)
    clusterd.wait_for(lambda s: held(s) == {phy(3): {RESTART}}, timeout=20)
    settled(clusterd, agent2)
    assert held(clusterd) == {phy(3): {RESTART}}
    for sequence in occurrences(clusterd, 0):
        assert sequence in (["occur"], ["occur", "recover"]), sequence  # no key occurs again after its recover
    agent2.wait_for_log("fault log lost records it had; starting a new epoch (sinks resynchronise from the "
                        "current state, stream clients get a snapshot)")
    assert agent2.metric("npu_agent_outbox_pending") == 0 and agent2.metric("npu_agent_fault_log_reset") == 1
    no_silent_drops(clusterd)


def test_switched_off_clusterd_keeps_its_place_in_the_fault_log_for_the_configured_while(start_agent, clusterd,
                                                                                          tmp_path):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(clusterd))
    fake.occur(0, HBM)
    clusterd.wait_for(lambda s: phy(0) in held(s), timeout=4)
    settled(clusterd, agent)
    agent.stop()
    fake.close()
    cursors = tmp_path / "state" / "faultlog" / "cursors.json"
    acknowledged = json.loads(cursors.read_text())["sinks"]["clusterd"]["revision"]
    off, fake = start_agent(devices={"poll_interval_seconds": 1})  # clusterd switched off: kept a day by default
    off.wait_for_log("cursor of a sink that is not configured; kept for a while, then dropped", sink="clusterd",
                     drop_after_s=86400.0)
    assert json.loads(cursors.read_text())["sinks"]["clusterd"]["revision"] == acknowledged
    off.stop()
    fake.close()
    off, _ = start_agent(devices={"poll_interval_seconds": 1},
                         fault_log={"retire_unconfigured_cursors_after_seconds": 0})
    off.wait_for_log("cursor of a sink no longer configured dropped; the fault log compacts without it",
                     sink="clusterd")
    assert json.loads(cursors.read_text())["sinks"]["clusterd"]["revision"] is None


def test_a_full_then_read_only_state_dir_pauses_delivery_and_it_resumes_with_nothing_lost(
        start_agent, clusterd, small_fs):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1}, state_dir=str(small_fs.path),
                              **with_clusterd(clusterd))
    fake.occur(0, HBM)
    clusterd.wait_for(lambda s: phy(0) in held(s), timeout=4)

    small_fs.fill()
    fake.occur(1, HBM)
    fake.recover(0, HBM)
    wait_until(lambda: agent.http("/readyz")[0] == 503, 10, "/readyz reports the state it cannot write")
    assert "cannot write" in agent.http("/readyz")[1]
    small_fs.free()
    clusterd.wait_for(lambda s: held(s) == {phy(1): {SEPARATE}}, timeout=40)
    wait_until(lambda: agent.http("/readyz")[0] == 200, 40, "/readyz 200 once the disk has room")

    small_fs.read_only()
    try:
        fake.occur(2, AICORE)
        fake.recover(1, HBM)
        wait_until(lambda: agent.http("/readyz")[0] == 503, 10, "/readyz reports the read-only state_dir")
    finally:
        small_fs.read_only(False)
    clusterd.wait_for(lambda s: held(s) == {phy(2): {RESTART}}, timeout=40)
    wait_until(lambda: agent.http("/readyz")[0] == 200, 40, "/readyz 200 once writable")
    settled(clusterd, agent)
    assert held(clusterd) == {phy(2): {RESTART}}
    assert agent.metric("npu_agent_state_write_failures_total", file="fault log") >= 1
    agent.wait_for_log("fault log written again")
    no_silent_drops(clusterd)


SUBHEALTH = 0x81A3880C  # SubHealthFault: public 010011001


@pytest.fixture
def start_agent_of(start_agent):
    def start(standin: ClusterdStandIn, **settings):
        return start_agent(devices={"poll_interval_seconds": 1}, **with_clusterd(standin, **settings))
    return start


def test_a_node_of_a_large_cluster_closes_its_connection_when_idle_and_opens_one_to_send(start_agent_of):
    with ClusterdStandIn(listener_cap=(1024, 512)) as clusterd:
        agent, fake = start_agent_of(clusterd, cluster_nodes=1000, idle_disconnect_seconds=10)
        fake.occur(2, HBM)
        clusterd.wait_for(lambda s: phy(2) in held(s), timeout=4)
        assert clusterd.connections[0] == 1
        clusterd.wait_for(lambda s: s.connections[0] == 0, timeout=15)  # 10 s after its last request
        fake.recover(2, HBM)
        clusterd.wait_for(lambda s: occurrences(s, 2) == [["occur", "recover"]], timeout=4)
        assert clusterd.connections[1] >= 1
        no_silent_drops(clusterd)


def test_a_node_of_a_small_cluster_stays_connected_while_it_holds_faults(start_agent_of):
    with ClusterdStandIn(listener_cap=(1024, 512)) as clusterd:
        agent, fake = start_agent_of(clusterd, cluster_nodes=16, idle_disconnect_seconds=10)
        fake.occur(2, HBM)
        clusterd.wait_for(lambda s: phy(2) in held(s), timeout=4)
        time.sleep(12)  # (the idle period passing; nothing to poll for)
        assert clusterd.connections[0] == 1
        clusterd.restart(persisted=False)  # so a restart that lost everything is repaired at once
        clusterd.wait_for(lambda s: phy(2) in held(s), timeout=10)
        no_silent_drops(clusterd)


def test_a_severe_fault_raised_while_a_refused_mild_one_waits_goes_with_it(start_agent_of):
    """ClusterD's budget is spent (a refill of one request per 100 s here): the mild fault's request is
    refused and waits for its turn; the severe fault logged meanwhile is in the next try, not after it."""
    with ClusterdStandIn(rate_per_s=0.01, burst=1) as clusterd:
        agent, fake = start_agent_of(clusterd)
        fake.occur(1, HBM)  # takes the one token
        clusterd.wait_for(lambda s: phy(1) in held(s), timeout=4)
        fake.occur(2, SUBHEALTH)
        clusterd.wait_for(lambda s: any(r.code == 410 for r in s.requests), timeout=4)
        fake.occur(3, HBM)
        wait_until(lambda: agent.fault_of(phy(3)), 3, "the severe fault seen by the agent")
        clusterd.refill_now()
        clusterd.wait_for(lambda s: phy(3) in held(s), timeout=25)
        [request] = [r.request for r in clusterd.requests if r.code == 0 and any(
            f.influence[0].deviceIds[0] == phy(3) for f in r.request.faults)]
        assert {f.influence[0].deviceIds[0] for f in request.faults} == {phy(2), phy(3)}
        assert held(clusterd) == {phy(1): {SEPARATE}, phy(2): {"010011001"}, phy(3): {SEPARATE}}
        assert clusterd.dropped_faults() == [] and {r.code for r in clusterd.requests} == {0, 410}


def test_a_node_sends_under_its_own_resource_and_moves_its_faults_when_the_resources_change(start_agent_of):
    from agent.sinks.clusterd.pacing import resource_of
    shards = ["npu-node-agent-a", "npu-node-agent-b", "npu-node-agent-c"]
    config = {**DEFAULT_CONFIG, "publicFaultResource": [*DEFAULT_CONFIG["publicFaultResource"], *shards]}
    with ClusterdStandIn(config) as clusterd:
        first = resource_of(NODE, "", shards[:2])
        agent, fake = start_agent_of(clusterd, resources=",".join(shards[:2]))
        fake.occur(0, HBM)
        clusterd.wait_for(lambda s: phy(0) in held(s), timeout=4)
        [(_, resource, old_key)] = clusterd.active()
        assert resource == first
        agent.stop()
        fake.close()
        moved = next(r for r in shards if r != first)
        agent, fake = start_agent_of(clusterd, resources=moved)  # the driver starts healthy again
        fake.occur(1, HBM)
        clusterd.wait_for(lambda s: {key[1] for key in s.active()} == {moved} and phy(1) in held(s), timeout=15)
        assert [r.request.resource for r in clusterd.requests if any(
            f.faultId == old_key and f.assertion == "recover" for f in r.request.faults)] == [first]
        settled(clusterd, agent)
        assert held(clusterd) == {phy(1): {SEPARATE}}
        no_silent_drops(clusterd)
