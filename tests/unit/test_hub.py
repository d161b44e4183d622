"""The fault hub: revisions, resume, snapshots, and slow subscribers that never block the others."""

from __future__ import annotations

import asyncio

from agent.model import Change, DeviceState, Level, Snapshot
from agent.faults.hub import FaultHub


def state(phy: int, level: Level = Level.NormalNPU) -> DeviceState:
    return DeviceState(phy, phy, level=level)


class Publisher:
    """Numbers changes the way the fault log does."""

    def __init__(self, hub: FaultHub):
        self.hub = hub

    def __call__(self, states: list[DeviceState]) -> None:
        self.hub.publish([Change(self.hub.revision + i + 1, s) for i, s in enumerate(states)])


def drain(subscription, count: int) -> list:
    async def take():
        return [await subscription.next(0.01) for _ in range(count)]
    return asyncio.run(take())


def test_new_subscriber_gets_a_snapshot_then_changes():
    hub = FaultHub("n")
    Publisher(hub)([state(0), state(1)])
    sub = hub.subscribe()
    Publisher(hub)([state(1, Level.SeparateNPU)])
    first, idle = drain(sub, 2)
    # The snapshot is taken when it is sent, so it already holds the change made before that.
    assert isinstance(first, Snapshot) and first.revision == 3
    assert [c.state.level for c in first.devices] == [Level.NormalNPU, Level.SeparateNPU]
    assert idle is None  # nothing more: time for a keepalive
    Publisher(hub)([state(0, Level.RestartNPU)])
    assert drain(sub, 1) == [Change(4, state(0, Level.RestartNPU))]


def test_resume_gets_exactly_the_missed_changes():
    hub = FaultHub("n")
    Publisher(hub)([state(0), state(1)])
    Publisher(hub)([state(0, Level.RestartNPU)])
    sub = hub.subscribe(hub.epoch, since_revision=1)
    items = drain(sub, 3)
    assert [i.revision for i in items[:2]] == [2, 3] and items[2] is None


def test_resume_from_another_epoch_or_a_forgotten_revision_gets_a_snapshot():
    hub = FaultHub("n", keep=2)
    for level in (Level.NotHandleFault, Level.RestartNPU, Level.SeparateNPU, Level.NormalNPU):
        Publisher(hub)([state(0, level)])
    assert isinstance(drain(hub.subscribe("other-epoch", 3), 1)[0], Snapshot)
    assert isinstance(drain(hub.subscribe(hub.epoch, 1), 1)[0], Snapshot)  # revision 2 no longer kept
    assert [i.revision for i in drain(hub.subscribe(hub.epoch, 2), 2)] == [3, 4]
    assert isinstance(drain(hub.subscribe(hub.epoch, 99), 1)[0], Snapshot)  # from the future: start over


def test_a_subscriber_that_falls_behind_is_resynced_and_others_are_unaffected():
    hub = FaultHub("n", queue_limit=3)
    slow = hub.subscribe(hub.epoch, 0)
    fast = hub.subscribe(hub.epoch, 0)
    Publisher(hub)([state(0)])
    assert drain(fast, 1)[0].revision == 1
    for _ in range(5):
        Publisher(hub)([state(0, Level.RestartNPU)])
        Publisher(hub)([state(0)])
        drain(fast, 2)
    item = drain(slow, 1)[0]
    assert isinstance(item, Snapshot) and item.revision == hub.revision
    assert drain(slow, 1)[0] is None
    assert hub.counters["resynced"] == 1


def test_closing_a_subscription_removes_it():
    hub = FaultHub("n")
    sub = hub.subscribe()
    assert hub.subscribers == 1
    sub.close()
    assert hub.subscribers == 0


def test_a_hub_seeded_from_the_log_resumes_across_a_restart():
    history = [Change(r, state(0, Level.RestartNPU if r % 2 else Level.NormalNPU)) for r in range(5, 10)]
    hub = FaultHub("n", epoch="e1", history=history, latest={0: history[-1]})
    assert hub.revision == 9
    assert [i.revision for i in drain(hub.subscribe("e1", 7), 2)] == [8, 9]
    assert isinstance(drain(hub.subscribe("e1", 2), 1)[0], Snapshot)
