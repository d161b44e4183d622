"""The fault hub: the node's current fault state and fan-out of revisioned changes to subscribers.

Revisions come from the durable fault log, so they continue across restarts within one epoch. The
hub keeps the last `keep` changes so a subscriber that reconnects can resume; one that asks for
more than that, or falls further behind than its queue allows, is given a fresh snapshot instead.
A slow subscriber never blocks the publisher or the other subscribers.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter, deque

from agent.model import Change, DeviceState, Snapshot


class Subscription:
    def __init__(self, hub: "FaultHub", queue_limit: int):
        self._hub = hub
        self._limit = queue_limit
        self._pending: deque[Change] = deque()
        self._wakeup = asyncio.Event()
        self.needs_snapshot = False

    def push(self, change: Change) -> None:
        if self.needs_snapshot:
            return
        if len(self._pending) >= self._limit:
            # Too far behind: drop the backlog, the next item is a fresh snapshot.
            self._pending.clear()
            self.needs_snapshot = True
            self._hub.counters["resynced"] += 1
        else:
            self._pending.append(change)
        self._wakeup.set()

    def prime(self, changes: list[Change] | None) -> None:
        """Start with these missed changes, or with a snapshot when None."""
        if changes is None:
            self.needs_snapshot = True
        else:
            self._pending.extend(changes)
        self._wakeup.set()

    async def next(self, timeout: float | None) -> Change | Snapshot | None:
        """The next item; None when `timeout` passed with nothing to send (time for a keepalive)."""
        while not self._pending and not self.needs_snapshot:
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except TimeoutError:
                return None
        if self.needs_snapshot:
            self.needs_snapshot = False
            self._pending.clear()
            return self._hub.snapshot()
        return self._pending.popleft()

    def close(self) -> None:
        self._hub._subscribers.discard(self)


class FaultHub:
    def __init__(self, node: str, keep: int = 4096, queue_limit: int = 1024, epoch: str = "",
                 history: list[Change] = (), latest: dict[int, Change] | None = None):
        self.node = node
        self.epoch = epoch or os.urandom(8).hex()  # revisions are comparable only within one epoch
        self._latest: dict[int, Change] = dict(latest or {})
        self._recent: deque[Change] = deque(history, maxlen=keep)
        self.revision = max([0, *(c.revision for c in self._recent), *(c.revision for c in self._latest.values())])
        self._queue_limit = queue_limit
        self._subscribers: set[Subscription] = set()
        self.counters: Counter[str] = Counter()  # delivered / resynced, for metrics
        self.chip_name = ""  # of the node's NPUs, once the driver listed them
        self.current = False  # every device was polled: the states are the devices' now, not the log's

    def publish(self, changes: list[Change]) -> None:
        for change in changes:
            self.revision = change.revision
            self._latest[change.state.phy_id] = change
            self._recent.append(change)
            for subscriber in list(self._subscribers):
                subscriber.push(change)

    def latest(self, phy_id: int) -> DeviceState | None:
        change = self._latest.get(phy_id)
        return None if change is None else change.state

    def snapshot(self) -> Snapshot:
        return Snapshot(self.revision, tuple(self._latest[phy] for phy in sorted(self._latest)))

    def subscribe(self, epoch: str = "", since_revision: int = 0) -> Subscription:
        subscription = Subscription(self, self._queue_limit)
        subscription.prime(self._missed(epoch, since_revision))
        self._subscribers.add(subscription)
        return subscription

    def _missed(self, epoch: str, since: int) -> list[Change] | None:
        if not epoch or epoch != self.epoch or since > self.revision:
            return None
        if since == self.revision:
            return []
        oldest = self._recent[0].revision if self._recent else self.revision + 1
        if since + 1 < oldest:
            return None  # no longer kept
        return [change for change in self._recent if change.revision > since]

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)
