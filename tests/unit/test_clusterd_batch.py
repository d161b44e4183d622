"""The ClusterD request planner: keys per occurrence, log order, the 100 cap, resync and re-assertion."""

from __future__ import annotations

from agent.sinks.clusterd.batch import (RECOVERED_KEEP_S, RECOVERED_MAX, ClusterdView, current, plan, reassertion,
                                         requests, resync)
from agent.model import Change, DeviceState, Level
from agent.sinks.clusterd.pubfault import PublicFault, public_faults

NODE = "node-a"
CODES = {"SeparateNPU": "020011001", "RestartNPU": "020011002"}
T = 1_780_000_000_000


def wanted_of(change: Change) -> dict[str, PublicFault]:
    return public_faults(NODE, change.state, CODES)


class Log:
    def __init__(self):
        self.changes: list[Change] = []

    def add(self, device: int, level: Level = Level.NormalNPU, at_ms: int = T) -> Change:
        """The device enters `level` at `at_ms` (a new occurrence whenever the level changes)."""
        state = DeviceState(phy_id=device, logic_id=device, level=level,
                            since_ms=at_ms if level is not Level.NormalNPU else 0, level_since_ms=at_ms)
        self.changes.append(Change(len(self.changes) + 1, state))
        return self.changes[-1]

    def after(self, cursor: int) -> list[Change]:
        return [c for c in self.changes if c.revision > cursor]


def ids(change: Change) -> str:
    [fid] = wanted_of(change)
    return fid


def names(transitions) -> list[tuple[str, str]]:
    return [(assertion, fault.fault_id) for assertion, fault in transitions]


def test_changes_go_out_in_log_order_and_the_view_follows():
    log = Log()
    one = log.add(1, Level.SeparateNPU)
    two = log.add(2, Level.SeparateNPU)
    first = plan({}, 0, log.after(0), wanted_of)
    assert names(first.transitions) == [("occur", ids(one)), ("occur", ids(two))]
    log.add(1, at_ms=T + 10)
    three = log.add(3, Level.RestartNPU, T + 11)
    step = plan(first.held, first.last_revision, log.after(first.last_revision), wanted_of)
    assert names(step.transitions) == [("recover", ids(one)), ("occur", ids(three))]
    assert step.last_revision == 4 and set(step.held) == {ids(two), ids(three)}


def test_each_occurrence_is_its_own_key_so_a_quick_reoccur_goes_out_at_once():
    log = Log()
    first = log.add(3, Level.SeparateNPU, T)
    held = plan({}, 0, log.after(0), wanted_of).held
    log.add(3, Level.NormalNPU, T + 100)
    again = log.add(3, Level.SeparateNPU, T + 200)
    assert ids(first) != ids(again)
    step = plan(held, 1, log.after(1), wanted_of)
    assert names(step.transitions) == [("recover", ids(first)), ("occur", ids(again))]
    assert set(step.held) == {ids(again)}


def test_a_level_change_is_a_recover_of_one_code_and_an_occur_of_the_other():
    log = Log()
    separate = log.add(0, Level.SeparateNPU, T)
    held = plan({}, 0, log.after(0), wanted_of).held
    restart = log.add(0, Level.RestartNPU, T + 5)
    step = plan(held, 1, log.after(1), wanted_of)
    assert names(step.transitions) == [("recover", ids(separate)), ("occur", ids(restart))]
    assert step.held[ids(restart)].code == "020011002"


def test_codes_changing_within_one_level_send_nothing():
    log = Log()
    first = log.add(0, Level.SeparateNPU, T)
    held = plan({}, 0, log.after(0), wanted_of).held
    later = DeviceState(0, 0, level=Level.SeparateNPU, since_ms=T - 50, level_since_ms=T)  # another code, same level
    step = plan(held, 1, [Change(2, later)], wanted_of)
    assert step.transitions == [] and step.last_revision == 2 and set(step.held) == {ids(first)}


def test_at_most_100_transitions_and_whole_changes_only():
    log = Log()
    for device in range(150):
        log.add(device, Level.SeparateNPU)
    step = plan({}, 0, log.after(0), wanted_of)
    assert len(step.transitions) == 100 and step.last_revision == 100
    rest = plan(step.held, step.last_revision, log.after(step.last_revision), wanted_of)
    assert len(rest.transitions) == 50 and rest.last_revision == 150 and len(rest.held) == 150


def test_resync_recovers_what_is_gone_keeps_unknown_devices_and_repeats_every_occur():
    log = Log()
    stays, goes, unknown = log.add(1, Level.SeparateNPU), log.add(2, Level.SeparateNPU), log.add(9, Level.SeparateNPU)
    held = plan({}, 0, log.after(0), wanted_of).held
    fresh = log.add(4, Level.RestartNPU)
    wanted = {1: wanted_of(stays), 2: {}, 4: wanted_of(fresh)}  # device 9 is not in the log any more
    items, target = resync(held, wanted)
    assert names(items) == [("recover", ids(goes)), ("occur", ids(unknown)), ("occur", ids(stays)), ("occur", ids(fresh))]
    assert set(target) == {ids(stays), ids(unknown), ids(fresh)}


def test_acknowledged_recovers_are_kept_for_reassertion_for_a_while_and_bounded():
    log = Log()
    for device in range(RECOVERED_MAX + 20):
        log.add(device, Level.SeparateNPU)
    step = plan({}, 0, log.after(0), wanted_of)
    view = ClusterdView().acknowledged(step.transitions, step.held, now_ms=T)
    for device in range(RECOVERED_MAX + 20):
        log.add(device, at_ms=T + 1)
    cursor = step.last_revision
    while cursor < len(log.changes):
        step = plan(view.held, cursor, log.after(cursor), wanted_of)
        view = view.acknowledged(step.transitions, step.held, now_ms=T + cursor)
        cursor = step.last_revision
    assert view.held == {} and len(view.recovered) == RECOVERED_MAX
    recovered_last = {f.fault_id for a, f in step.transitions if a == "recover"}
    assert len(recovered_last) == 40 and recovered_last <= set(view.recovered)  # the newest are all kept
    assert all(at > T for _, at in view.recovered.values())
    assert [a for a, _ in reassertion(view)] == ["recover"] * RECOVERED_MAX
    later = view.acknowledged([], {}, now_ms=T + RECOVERED_KEEP_S * 1000 + cursor + 1)
    assert later.recovered == {}


def test_reassertion_repeats_every_held_key_and_recent_recover():
    log = Log()
    gone = log.add(1, Level.SeparateNPU)
    held = log.add(2, Level.SeparateNPU)
    step = plan({}, 0, log.after(0), wanted_of)
    log.add(1, at_ms=T + 1)
    view = ClusterdView().acknowledged(step.transitions, step.held, now_ms=T)
    step = plan(view.held, 2, log.after(2), wanted_of)
    view = view.acknowledged(step.transitions, step.held, now_ms=T)
    assert names(reassertion(view)) == [("occur", ids(held)), ("recover", ids(gone))]
    assert reassertion(ClusterdView()) == []
    assert [len(r) for r in requests(reassertion(view) * 60)] == [100, 20]


def test_a_reassertion_made_again_leaves_out_the_occurs_of_faults_gone_since():
    log = Log()
    log.add(1, Level.SeparateNPU)
    log.add(2, Level.SeparateNPU)
    stays = log.add(3, Level.SeparateNPU)
    unknown = log.add(4, Level.SeparateNPU)
    gone = log.add(5, Level.SeparateNPU)
    step = plan({}, 0, log.after(0), wanted_of)
    view = ClusterdView().acknowledged(step.transitions, step.held, now_ms=T)
    step = plan(view.held, 5, [log.add(5, at_ms=T + 1)], wanted_of)
    view = view.acknowledged(step.transitions, step.held, now_ms=T)  # the view: 1-4 held, 5 recovered
    # While the re-assertion waited, device 1 recovered and device 2 moved to another level (the log
    # has it, the view not yet); device 4's state is not known.
    now = {c.state.phy_id: wanted_of(c) for c in [log.add(1, at_ms=T + 2), log.add(2, Level.RestartNPU, T + 2), stays]}
    assert names(current(reassertion(view), now)) == [("occur", ids(stays)), ("occur", ids(unknown)),
                                                       ("recover", ids(gone))]
    assert current(reassertion(view), {}) == reassertion(view)


def test_the_view_survives_its_own_serialisation():
    log = Log()
    log.add(1, Level.SeparateNPU)
    log.add(2, Level.SeparateNPU)
    log.add(1, at_ms=T + 1)
    step = plan({}, 0, log.after(0), wanted_of)
    view = ClusterdView().acknowledged(step.transitions, step.held, now_ms=T)
    assert ClusterdView.from_dict(view.to_dict()) == view


def test_an_occurrence_that_came_and_went_within_one_request_is_not_sent():
    log = Log()
    first = log.add(3, Level.SeparateNPU, T)
    log.add(3, Level.NormalNPU, T + 1)
    kept = log.add(3, Level.SeparateNPU, T + 2)
    other = log.add(5, Level.SeparateNPU, T + 3)
    step = plan({}, 0, log.after(0), wanted_of)
    assert names(step.transitions) == [("occur", ids(kept)), ("occur", ids(other))]
    assert step.unsent == 1 and set(step.held) == {ids(kept), ids(other)} and ids(first) not in step.held
    # One already sent is recovered as usual.
    later = log.add(3, Level.NormalNPU, T + 4)
    step = plan(step.held, step.last_revision, log.after(step.last_revision), wanted_of)
    assert names(step.transitions) == [("recover", ids(kept))] and step.unsent == 0 and later.revision == 5


def test_a_flapping_device_costs_one_request_however_long_the_backlog():
    log = Log()
    for flap in range(500):
        log.add(2, Level.SeparateNPU, T + 2 * flap)
        log.add(2, Level.NormalNPU, T + 2 * flap + 1)
    final = log.add(2, Level.SeparateNPU, T + 5000)
    step = plan({}, 0, log.after(0), wanted_of)
    assert names(step.transitions) == [("occur", ids(final))] and step.unsent == 500 and step.last_revision == 1001


def test_an_occur_a_dead_run_may_have_sent_is_not_left_out():
    log = Log()
    first = log.add(4, Level.SeparateNPU, T)  # the previous run sent this, maybe, and died
    log.add(4, Level.NormalNPU, T + 1)  # this run finds the device healthy
    step = plan({}, 0, log.after(0), wanted_of, sent_before=1)
    assert names(step.transitions) == [("occur", ids(first)), ("recover", ids(first))] and step.unsent == 0
