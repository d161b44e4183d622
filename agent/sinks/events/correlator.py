"""Aggregation and rate limiting of Kubernetes Events, by client-go's rules (tools/record's
EventCorrelator, with its defaults), so that the agent's Events load the API server no more than a
kubelet's do. A pure class: events and times in, what to send out (the sink correlates each event as
it is about to send it, as client-go's recorder does; the object reference, the uid included, is part
of every key, so a pod recreated under the same name starts afresh).

1. Similar events: events about one object with the same type and reason but different messages.
   From the MAX_SIMILAR-th distinct message within MAX_SIMILAR_INTERVAL_S of the last one, they
   collapse into one event `(combined from similar events): <latest message>`, counted on.
2. Identical events (same object, type, reason and message) are not created again: the existing
   event's `count` and `lastTimestamp` are patched (`kubectl get events` shows `(x5 over 3m)`).
3. What is left passes a token bucket per object (BURST, refilled by one every 1/QPS s = 5 min);
   the rest is dropped and counted. A flapping NPU costs the API server at most BURST requests per
   object, then one per 5 minutes.

The caches hold at most CACHE_SIZE keys each (least recently used out), like client-go's LRUs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace

MAX_SIMILAR = 10  # defaultAggregateMaxEvents
MAX_SIMILAR_INTERVAL_S = 600.0  # defaultAggregateIntervalInSeconds
BURST = 25  # defaultSpamBurst
QPS = 1.0 / 300.0  # defaultSpamQPS
CACHE_SIZE = 4096  # maxLruCacheEntries
COMBINED = "(combined from similar events): "


@dataclass(frozen=True)
class ObjectRef:
    """An Event's involvedObject."""

    kind: str
    name: str
    namespace: str = ""
    uid: str = ""
    api_version: str = ""


@dataclass(frozen=True)
class Recorded:
    """One event as the agent records it (client-go's recorder: Eventf)."""

    involved: ObjectRef
    type: str  # Normal or Warning
    reason: str
    message: str
    at: float  # when it happened (seconds since the epoch)


@dataclass(frozen=True)
class Outgoing:
    """What to send: create the event `name`, or patch its count, lastTimestamp and message."""

    action: str  # "create" or "patch"
    key: str  # the cache key to note the server's answer under (observed())
    name: str
    namespace: str
    event: Recorded
    count: int
    first_at: float
    combined: bool = False


@dataclass
class _Similar:
    messages: dict[str, None] = field(default_factory=dict)  # an ordered set: the oldest leaves first
    last_at: float = 0.0


@dataclass
class _Seen:
    count: int
    first_at: float
    name: str


class _Bucket:
    """flowcontrol's token bucket: starts full, refills continuously."""

    def __init__(self, burst: int, qps: float, now: float):
        self.tokens, self.burst, self.qps, self.at = float(burst), burst, qps, now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.qps)
        self.at = max(self.at, now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class _Lru(OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get(self, key, default=None):
        if key in self:
            self.move_to_end(key)
            return self[key]
        return default

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


def event_namespace(ref: ObjectRef) -> str:
    """Where an event about `ref` lives: its object's namespace, `default` for a cluster-scoped one."""
    return ref.namespace or "default"


class EventCorrelator:
    def __init__(self, source: tuple[str, str], *, max_similar: int = MAX_SIMILAR,
                 similar_interval_s: float = MAX_SIMILAR_INTERVAL_S, burst: int = BURST, qps: float = QPS,
                 cache_size: int = CACHE_SIZE):
        self._source = source  # (component, host): part of every key, as in client-go
        self._max_similar = max_similar
        self._similar_interval_s = similar_interval_s
        self._burst, self._qps = burst, qps
        self._similar: _Lru = _Lru(cache_size)
        self._seen: _Lru = _Lru(cache_size)
        self._buckets: _Lru = _Lru(cache_size)
        self._last_nanos = 0

    def correlate(self, event: Recorded) -> Outgoing | None:
        """What to send for this event, or None when the object's rate limit drops it."""
        ref, now = event.involved, event.at
        object_key = "\x00".join((*self._source, ref.kind, ref.namespace, ref.name, ref.uid, ref.api_version))
        similar_key = "\x00".join((object_key, event.type, event.reason))
        key = "\x00".join((similar_key, event.message))
        combined = False
        # 1. Similar events: count the distinct messages of this object, type and reason.
        similar = self._similar.get(similar_key)
        if similar is None or now - similar.last_at > self._similar_interval_s:
            similar = _Similar()
        known = event.message in similar.messages  # client-go: a message among them is itself, not combined
        similar.messages[event.message] = None
        similar.last_at = now
        self._similar.put(similar_key, similar)
        if not known and len(similar.messages) >= self._max_similar:
            # As client-go, the set stays below the limit, so each further new message combines. It drops
            # any one (PopAny); the oldest here, so that what combines does not depend on hashing.
            del similar.messages[next(iter(similar.messages))]
            event = replace(event, message=COMBINED + event.message)
            key, combined = similar_key, True
        # 2. Identical events: the one already sent is counted on.
        seen = self._seen.get(key)
        if seen is not None and seen.count > 0:
            outgoing = Outgoing("patch", key, seen.name, event_namespace(ref), event, seen.count + 1, seen.first_at,
                                combined)
        else:
            outgoing = Outgoing("create", key, self._name(ref, now), event_namespace(ref), event, 1, now, combined)
        # Noted before the rate limit, as client-go does: a dropped repeat still counts in the next patch.
        self._seen.put(key, _Seen(outgoing.count, outgoing.first_at, outgoing.name))
        # 3. The object's token bucket.
        bucket = self._buckets.get(object_key)
        if bucket is None:
            bucket = _Bucket(self._burst, self._qps, now)
            self._buckets.put(object_key, bucket)
        return outgoing if bucket.take(now) else None

    def observed(self, outgoing: Outgoing, name: str, count: int) -> None:
        """The API server stored the event as `name` with `count` (events correlated since count on from
        there: this never lowers a count)."""
        seen = self._seen.get(outgoing.key)
        if seen is None or seen.name != name:  # pushed out of the cache meanwhile, or the server renamed it
            self._seen.put(outgoing.key, _Seen(max(count, 1), outgoing.first_at, name))
        else:
            seen.count = max(seen.count, count)

    def forget(self, outgoing: Outgoing) -> None:
        """The event is not on the server (dropped after failures): an identical one is created anew."""
        seen = self._seen.get(outgoing.key)
        if seen is not None and seen.name == outgoing.name and outgoing.action == "create":
            del self._seen[outgoing.key]

    def _name(self, ref: ObjectRef, now: float) -> str:
        """`<object>.<hex nanoseconds>`, as client-go names events; never the same name twice."""
        self._last_nanos = max(int(now * 1e9), self._last_nanos + 1)
        return f"{ref.name}.{self._last_nanos:x}"
