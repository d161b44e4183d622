"""Plans the ClusterD sink's next request: pure, so unit tests drive it with their own clock.

ClusterD keeps a fault's state, not its history, and its semantics (`clusterd.md` §4.3) make one
sequence unrepresentable: an `occur` less than 5 s after a `recover` of the same faultId. ClusterD
ignores that occur (the fault is still there) and then deletes the fault anyway, so the fault is
gone while the device is still broken. The planner therefore

* defers such an occur until ClusterD has deleted the recovered fault (`SETTLE_S` after the
  recover was acknowledged) without holding back anybody else's transitions;
* coalesces a recover that has not been sent yet with the occur of the same faultId that follows
  it (both are dropped; ClusterD keeps the fault it holds), and a deferred occur with the recover
  that follows it when ClusterD acknowledged the recover before (both are dropped; ClusterD does
  not hold the fault). Both pairs are counted. Everything else is delivered in log order.

After a restart the sink cannot know whether the previous run's last request reached ClusterD, so
every occur waits until `SETTLE_S` after the previous run's last commit, and a recover that cancels
such an occur is still sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from agent.faults.hub import Change
from agent.faults.pubfault import MAX_FAULTS_PER_REQUEST, PublicFault

SETTLE_S = 5.5  # ClusterD deletes a recovered fault up to 5 s after the recover; margin for the ack's delay

Transition = tuple[str, PublicFault]  # ("occur" | "recover", fault)


@dataclass
class ClusterdView:
    """What the sink knows of ClusterD's cache, from acknowledged requests."""
    held: dict[str, PublicFault] = field(default_factory=dict)  # held by ClusterD, or owed as a deferred occur
    deferred: dict[str, PublicFault] = field(default_factory=dict)  # occurs waiting for a recover to settle
    recovered_at: dict[str, float] = field(default_factory=dict)  # when ClusterD acknowledged each recover
    unknown_before: float = float("-inf")  # recovers of any other faultId may have been sent until then


@dataclass
class Plan:
    transitions: list[Transition]  # the request's faults, in order
    last_revision: int  # the cursor once ClusterD acknowledged them
    view: ClusterdView  # the view once ClusterD acknowledged them (recovered_at updated by the sink)
    coalesced: int  # transitions dropped in pairs
    wait: float | None  # seconds until the first deferred occur is due; None when nothing is deferred


def _recovered(view: ClusterdView, fault_id: str) -> float:
    return view.recovered_at.get(fault_id, view.unknown_before)


def transitions(held: dict[str, PublicFault], device: int, wanted: dict[str, PublicFault]) -> list[Transition]:
    """What takes ClusterD from `held` to `wanted` for one device: recovers first, then occurs."""
    had = {fid: f for fid, f in held.items() if f.device == device}
    return ([("recover", f) for fid, f in had.items() if fid not in wanted]
            + [("occur", f) for fid, f in wanted.items() if fid not in had])


def plan(view: ClusterdView, cursor: int, changes: Iterable[Change],
         wanted_of: Callable[[Change], dict[str, PublicFault]], now: float) -> Plan:
    """The next request after `cursor`: at most 100 transitions, whole changes only."""
    held, deferred = dict(view.held), dict(view.deferred)
    slots: list[Transition | None] = []
    unsent_recovers: dict[str, tuple[int, PublicFault]] = {}  # faultId -> (slot, the fault ClusterD holds)
    coalesced = 0
    for fault_id, fault in list(deferred.items()):  # due deferred occurs are older than anything pending
        if now - _recovered(view, fault_id) >= SETTLE_S and len(slots) < MAX_FAULTS_PER_REQUEST:
            slots.append(("occur", fault))
            del deferred[fault_id]
    last = cursor
    for change in changes:
        items = transitions(held, change.state.phy_id, wanted_of(change))
        if sum(s is not None for s in slots) + len(items) > MAX_FAULTS_PER_REQUEST:
            break
        for assertion, fault in items:
            fid = fault.fault_id
            if assertion == "recover":
                previous = held.pop(fid)
                if deferred.pop(fid, None) is not None and fid in view.recovered_at:
                    coalesced += 2  # ClusterD acknowledged the recover before the occur that never went out
                    continue
                # (deferred only for a previous run's recovers: ClusterD may hold the fault, so recover it)
                unsent_recovers[fid] = (len(slots), previous)
                slots.append(("recover", fault))
            elif fid in unsent_recovers:
                slot, previous = unsent_recovers.pop(fid)
                slots[slot] = None
                held[fid] = previous  # ClusterD keeps the fault (and the start time) it has
                coalesced += 2
            else:
                held[fid] = fault
                if now - _recovered(view, fid) < SETTLE_S:
                    deferred[fid] = fault
                else:
                    slots.append(("occur", fault))
        last = change.revision
    due = [_recovered(view, fid) + SETTLE_S - now for fid in deferred]
    return Plan(transitions=[s for s in slots if s is not None], last_revision=last,
                view=ClusterdView(held, deferred, dict(view.recovered_at), view.unknown_before),
                coalesced=coalesced, wait=max(0.0, min(due)) if due else None)
