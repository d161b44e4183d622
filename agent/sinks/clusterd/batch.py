"""Plans the ClusterD sink's requests: pure, so unit tests drive them with their own clock.

Every occurrence of a public fault has a faultId of its own (see `pubfault`), so to ClusterD the
sink only ever adds a key (occur) and later removes it (recover), and never adds it again. Nothing
has to wait for ClusterD's delayed deletion of a recovered key, and an occur of a held key or a
recover of a removed one can be repeated at any time: ClusterD ignores the first and the second
deletes a key nobody will use again.

The view is what ClusterD holds as far as it acknowledged (`held`) and the keys recovered lately
(`recovered`). Those are the keys a ClusterD restart can bring back: it saves its cache about a
second late and loses its queue of pending deletions, so a key recovered just before the restart
comes back as held. Re-asserting the view (occur for every held key, recover for every recent one)
is how the sink converges with a ClusterD that may have lost or resurrected faults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from agent.model import Change
from agent.sinks.clusterd.pubfault import MAX_FAULTS_PER_REQUEST, PublicFault

RECOVERED_KEEP_S = 600  # far beyond ClusterD's ~1 s save lag and its deletions' ≤ 6 s delay
RECOVERED_MAX = MAX_FAULTS_PER_REQUEST  # a flapping device cannot make re-assertion cost more than a request

Transition = tuple[str, PublicFault]  # ("occur" | "recover", fault)


@dataclass
class ClusterdView:
    held: dict[str, PublicFault] = field(default_factory=dict)  # faultId -> fault
    recovered: dict[str, tuple[PublicFault, int]] = field(default_factory=dict)  # faultId -> (fault, acked at ms)
    # Saved before a resync is sent, with `held` including its occurs: a run that dies before the
    # answer cannot redo the same resync (the state it came from is gone), so the next one resyncs
    # again from a view that counts those occurs as possibly held, and recovers what is not wanted.
    resyncing: bool = False

    def acknowledged(self, sent: list[Transition], held: dict[str, PublicFault], now_ms: int) -> "ClusterdView":
        """The view once ClusterD answered 0 to `sent`, which left it holding `held`."""
        recovered = dict(self.recovered)
        recovered.update((f.fault_id, (f, now_ms)) for a, f in sent if a == "recover" and f.fault_id not in held)
        recent = sorted(((fid, item) for fid, item in recovered.items()
                         if now_ms - item[1] < RECOVERED_KEEP_S * 1000 and fid not in held),
                        key=lambda pair: pair[1][1])[-RECOVERED_MAX:]
        return ClusterdView(dict(held), dict(recent))

    def to_dict(self) -> dict:
        return {"held": [f.to_dict() for f in self.held.values()],
                "recovered": [[f.to_dict(), at] for f, at in self.recovered.values()],
                **({"resyncing": True} if self.resyncing else {})}

    @classmethod
    def from_dict(cls, item: dict) -> "ClusterdView":
        """KeyError/TypeError/ValueError on a malformed state."""
        held = [PublicFault.from_dict(f) for f in item["held"]]
        recovered = [(PublicFault.from_dict(f), int(at)) for f, at in item["recovered"]]
        return cls({f.fault_id: f for f in held}, {f.fault_id: (f, at) for f, at in recovered},
                   item.get("resyncing") is True)


@dataclass
class Plan:
    transitions: list[Transition]  # the request's faults, in order
    last_revision: int  # the cursor once ClusterD acknowledged them
    held: dict[str, PublicFault]  # what ClusterD holds then
    unsent: int = 0  # occurrences that began and ended before they could be sent (see plan)


def transitions(held: dict[str, PublicFault], device: int, wanted: dict[str, PublicFault]) -> list[Transition]:
    """What takes ClusterD from `held` to `wanted` for one device: recovers first, then occurs."""
    had = {fid: f for fid, f in held.items() if f.device == device}
    return ([("recover", f) for fid, f in had.items() if fid not in wanted]
            + [("occur", f) for fid, f in wanted.items() if fid not in had])


def plan(held: dict[str, PublicFault], cursor: int, changes: Iterable[Change],
         wanted_of: Callable[[Change], dict[str, PublicFault]], sent_before: int = 0) -> Plan:
    """The next request after `cursor`: at most 100 transitions, whole changes only, in log order.

    An occurrence whose occur and recover both fall into the request (it came and went while the
    request waited: behind the rate limit, or while ClusterD was away) is left out. ClusterD keeps
    state, not history: its cache ends the same, without holding a healthy NPU for 5 s, and a
    device that flapped through an outage costs one request, not one per flap. Not for an occur at
    or before `sent_before`: a previous run that died may have sent it already."""
    held = dict(held)
    slots: list[Transition | None] = []
    occurs: dict[str, int] = {}  # faultId -> its occur's slot in this request
    unsent = 0
    last = cursor
    for change in changes:
        items = transitions(held, change.state.phy_id, wanted_of(change))
        live = len(slots) - unsent
        if live and live + len(items) > MAX_FAULTS_PER_REQUEST:
            break
        for assertion, fault in items:
            if assertion == "occur":
                held[fault.fault_id] = fault
                if change.revision > sent_before:
                    occurs[fault.fault_id] = len(slots)
                slots.append((assertion, fault))
                continue
            del held[fault.fault_id]
            slot = occurs.pop(fault.fault_id, None)
            if slot is None:
                slots.append((assertion, fault))
            else:
                slots[slot] = None
                unsent += 1
        last = change.revision
    return Plan([s for s in slots if s is not None], last, held, unsent)


def resync(held: dict[str, PublicFault],
           wanted: dict[int, dict[str, PublicFault]]) -> tuple[list[Transition], dict[str, PublicFault]]:
    """From `held` to the devices' current public faults without any history: recover what is no
    longer wanted, occur everything that is (repeats are harmless). A held fault of a device the
    log does not know yet is kept until the device is seen."""
    target = {fid: f for fid, f in held.items() if f.device not in wanted}
    for faults in wanted.values():
        target.update(faults)
    return ([("recover", f) for fid, f in held.items() if fid not in target]
            + [("occur", f) for f in target.values()]), target


def reassertion(view: ClusterdView) -> list[Transition]:
    """Everything ClusterD should hold, and every recent key it should not."""
    return [("occur", f) for f in view.held.values()] + [("recover", f) for f, _ in view.recovered.values()]


def differences(view: ClusterdView, saved: dict[str, PublicFault]) -> list[Transition]:
    """What takes ClusterD from what it saved for this node (`saved`, faultId -> fault) to the view:
    recover what it holds and should not (a deletion its restart lost), occur what it lacks."""
    return ([("recover", f) for fid, f in saved.items() if fid not in view.held]
            + [("occur", f) for fid, f in view.held.items() if fid not in saved])


def current(items: list[Transition], wanted: dict[int, dict[str, PublicFault]]) -> list[Transition]:
    """`items` without the occurs of faults their device no longer has (`wanted`: the devices' public
    faults now), for a re-assertion or resync that waited while the device changed. Such a fault's
    recover is the next change to deliver; an occur just before it would make ClusterD hold the
    recovered fault for its delete delay (5 s and more). A recover is never stale: keys are not reused."""
    return [(assertion, f) for assertion, f in items
            if assertion == "recover" or f.device not in wanted or f.fault_id in wanted[f.device]]


def requests(items: list[Transition]) -> list[list[Transition]]:
    return [items[i:i + MAX_FAULTS_PER_REQUEST] for i in range(0, len(items), MAX_FAULTS_PER_REQUEST)]
