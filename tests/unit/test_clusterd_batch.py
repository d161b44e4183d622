"""The ClusterD request planner: order per fault, deferral after a recover, coalescing, the 100 cap."""

from __future__ import annotations

from agent.faults.clusterd_batch import SETTLE_S, ClusterdView, plan
from agent.faults.engine import DeviceState
from agent.faults.hub import Change
from agent.faults.levels import Level
from agent.faults.pubfault import PublicFault

NODE = "node-a"


def wanted_of(change: Change) -> dict[str, PublicFault]:
    """One public fault per faulty device (its id names the device), as the sink's mapping does."""
    state = change.state
    if state.level is Level.NormalNPU:
        return {}
    fid = f"fault-{state.phy_id}"
    return {fid: PublicFault(fid, "020011001", state.since_ms, state.phy_id, state.level.name, "")}


class Log:
    def __init__(self):
        self.changes: list[Change] = []

    def add(self, device: int, faulty: bool, since_ms: int = 1_760_000_000_000) -> None:
        level = Level.SeparateNPU if faulty else Level.NormalNPU
        state = DeviceState(phy_id=device, logic_id=device, level=level, since_ms=since_ms if faulty else 0)
        self.changes.append(Change(len(self.changes) + 1, state))

    def after(self, cursor: int) -> list[Change]:
        return [c for c in self.changes if c.revision > cursor]


def names(transitions) -> list[str]:
    return [f"{assertion} {fault.fault_id}" for assertion, fault in transitions]


def acknowledge(step, at: float):
    """What the sink does once ClusterD answered 0."""
    step.view.recovered_at.update((f.fault_id, at) for a, f in step.transitions if a == "recover")
    return step.view


def test_changes_go_out_in_log_order_and_the_view_follows():
    log = Log()
    log.add(1, True)
    log.add(2, True)
    log.add(1, False)
    step = plan(ClusterdView(), 0, log.after(0), wanted_of, now=100.0)
    assert names(step.transitions) == ["occur fault-1", "occur fault-2", "recover fault-1"]
    assert step.last_revision == 3 and step.coalesced == 0 and step.wait is None
    assert set(step.view.held) == {"fault-2"}


def test_an_occur_soon_after_an_acknowledged_recover_is_deferred_without_holding_others_back():
    log = Log()
    log.add(1, True)
    view = acknowledge(plan(ClusterdView(), 0, log.after(0), wanted_of, now=100.0), at=100.0)
    log.add(1, False)
    view = acknowledge(plan(view, 1, log.after(1), wanted_of, now=101.0), at=101.0)
    log.add(1, True, since_ms=1_760_000_009_000)
    log.add(2, True)
    step = plan(view, 2, log.after(2), wanted_of, now=102.0)
    assert names(step.transitions) == ["occur fault-2"]  # device 2 is not held up by device 1
    assert step.last_revision == 4 and list(step.view.deferred) == ["fault-1"]
    assert step.wait == SETTLE_S - 1.0
    # Nothing new; when the recover has settled, the deferred occur goes out first.
    early = plan(step.view, 4, [], wanted_of, now=101.0 + SETTLE_S - 0.1)
    assert early.transitions == [] and early.wait > 0
    due = plan(step.view, 4, [], wanted_of, now=101.0 + SETTLE_S)
    assert names(due.transitions) == ["occur fault-1"] and not due.view.deferred and due.wait is None
    assert due.transitions[0][1].time_ms == 1_760_000_009_000


def test_a_deferred_occur_and_the_recover_after_it_cancel_out():
    log = Log()
    log.add(1, True)
    view = acknowledge(plan(ClusterdView(), 0, log.after(0), wanted_of, now=100.0), at=100.0)
    log.add(1, False)
    view = acknowledge(plan(view, 1, log.after(1), wanted_of, now=101.0), at=101.0)
    log.add(1, True)
    log.add(1, False)
    step = plan(view, 2, log.after(2), wanted_of, now=102.0)
    assert step.transitions == [] and step.coalesced == 2 and not step.view.deferred
    assert step.last_revision == 4 and step.view.held == {}


def test_an_unsent_recover_and_the_reoccur_after_it_coalesce_keeping_the_held_fault():
    log = Log()
    log.add(1, True, since_ms=1_760_000_000_000)
    view = acknowledge(plan(ClusterdView(), 0, log.after(0), wanted_of, now=100.0), at=100.0)
    # A backlog: the device flaps 50 times, then ends faulty; another device fails meanwhile.
    for i in range(50):
        log.add(1, False)
        log.add(1, True, since_ms=1_760_000_100_000 + i)
    log.add(3, True)
    step = plan(view, 1, log.after(1), wanted_of, now=200.0)
    assert names(step.transitions) == ["occur fault-3"]
    assert step.coalesced == 100 and step.last_revision == 102
    assert step.view.held["fault-1"].time_ms == 1_760_000_000_000  # what ClusterD still holds
    # Ending healthy instead leaves exactly one recover, carrying the start time ClusterD has.
    log.add(1, False)
    last = plan(step.view, 102, log.after(102), wanted_of, now=201.0)
    assert names(last.transitions) == ["recover fault-1"]
    assert last.transitions[0][1].time_ms == 1_760_000_000_000


def test_a_brief_fault_inside_one_batch_is_sent_as_occur_then_recover():
    log = Log()
    log.add(1, True)
    log.add(1, False)
    log.add(1, True)
    step = plan(ClusterdView(), 0, log.after(0), wanted_of, now=100.0)
    # occur, recover, occur: the second pair coalesces; ClusterD ends up holding the fault.
    assert names(step.transitions) == ["occur fault-1"] and step.coalesced == 2


def test_recovers_from_a_previous_run_defer_occurs_until_they_settled():
    log = Log()
    log.add(1, True)
    step = plan(ClusterdView(unknown_before=99.0), 0, log.after(0), wanted_of, now=100.0)
    assert step.transitions == [] and step.wait == SETTLE_S - 1.0
    later = plan(ClusterdView(unknown_before=90.0), 0, log.after(0), wanted_of, now=100.0)
    assert names(later.transitions) == ["occur fault-1"]


def test_a_request_holds_at_most_100_faults_and_whole_changes():
    log = Log()
    for device in range(150):
        log.add(device, True)
    first = plan(ClusterdView(), 0, log.after(0), wanted_of, now=100.0)
    assert len(first.transitions) == 100 and first.last_revision == 100
    second = plan(first.view, 100, log.after(100), wanted_of, now=101.0)
    assert len(second.transitions) == 50 and second.last_revision == 150
    assert len(second.view.held) == 150


def test_a_recover_cancelling_an_occur_deferred_for_a_previous_run_is_still_sent():
    # The previous run may have had the occur in flight when it died: ClusterD may hold the fault.
    log = Log()
    log.add(1, True)
    step = plan(ClusterdView(unknown_before=99.0), 0, log.after(0), wanted_of, now=100.0)
    assert list(step.view.deferred) == ["fault-1"]
    log.add(1, False)
    after = plan(step.view, 1, log.after(1), wanted_of, now=101.0)
    assert names(after.transitions) == ["recover fault-1"] and after.coalesced == 0
    assert not after.view.deferred and not after.view.held


def test_the_wire_fault_names_its_pods_within_clusterds_limits():
    from agent.faults.pubfault import fault_problems, to_message
    from agent.kube.podresources import PodRef

    fault = PublicFault("f" * 64, "020011001", 1_760_000_000_000, 3, "SeparateNPU", "80E18402")
    assert "pod" not in to_message(NODE, "occur", fault).faultLocation  # a free NPU names nobody
    pods = tuple(PodRef("ns", f"pod-{i}-" + "x" * 240, "c\tmain") for i in range(40))
    message = to_message(NODE, "occur", fault, pods)
    assert fault_problems(message, frozenset({"020011001"})) == []
    assert message.faultLocation["pod"].startswith("pod-0-x") and len(message.faultLocation["pod"]) == 128
    assert message.faultLocation["container"] == "c main" and message.faultLocation["pods"] == "40"
    assert len(message.description) == 512 and "\t" not in message.description
    lone = to_message(NODE, "occur", fault, (PodRef("team-é", "train-0", "main"),))
    assert lone.description.endswith("; pods: team-é/train-0 (container main)")
