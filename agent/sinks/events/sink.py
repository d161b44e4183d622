"""Kubernetes Events for NPU faults (`kubectl get events`, `kubectl describe node|pod`): an agent.model.Sink.

Derived from the changes the fault log hands its sinks, against the last state of each device (seeded
from the log at start, so a restart does not announce standing faults again): a code that appears is
`NPUFaultOccurred` (Warning), one that goes `NPUFaultRecovered` (Normal), one a frequency or duration
rule raises `NPUFaultEscalated` (Warning). Each is posted on the Node (involvedObject kind Node, uid
the node's name as the kubelet sets it, the event in `default`) and on every pod holding the NPU
(the event in the pod's namespace, with the pod's uid, so that `kubectl describe pod` finds it).

Events are best-effort, as client-go's recorder makes them: recorded into a bounded queue
(QUEUE_LIMIT; the newest is dropped when it is full, before anything else sees it), then, one at a
time by a task of their own, aggregated and rate-limited by its rules (correlator.py) and sent: the
fault pipeline never waits for the API server. A pod is known by its uid, as client-go keys it: a pod
recreated under the same name after a fault is another object, with its own events, counts and rate
limit. The uid is read before the event is correlated (kept UID_TTL_S, so a burst of events costs
one read, and a recreated pod is seen within seconds). A failed request is retried TRIES times in
all when another try may work, then dropped. Drops are counted by cause. A 403 shows on /readyz
with the missing grant until a later post succeeds, unless the pod's namespace is being deleted
(403 with the cause NamespaceTerminating) or is gone (404): such an event is dropped quietly, as
client-go's recorder drops it (counted as `namespace_gone`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter, deque
from dataclasses import replace
from typing import Callable

from kubernetes import client

from agent.common.executor import Lane
from agent.faults.hub import FaultHub
from agent.kube.calls import FAILURES, STRATEGIC_MERGE_PATCH, Failure, failure, kube_time
from agent.kube.client import REQUEST_TIMEOUT_S, core_api
from agent.lifecycle import Tasks
from agent.model import Change, DeviceState, PodsOf
from agent.sinks.events.correlator import EventCorrelator, ObjectRef, Outgoing, Recorded

log = logging.getLogger(__name__)

COMPONENT = "npu-node-agent"  # source.component and reportingComponent
OCCURRED, RECOVERED, ESCALATED = "NPUFaultOccurred", "NPUFaultRecovered", "NPUFaultEscalated"
REASONS = (OCCURRED, RECOVERED, ESCALATED)
WARNING, NORMAL = "Warning", "Normal"
QUEUE_LIMIT = 1000  # client-go's maxQueuedEvents
TRIES = 3
RETRY_S = (1.0, 2.0)
UID_TTL_S = 10.0
DROP_CAUSES = ("rate_limited", "failed", "queue_full", "namespace_gone")
LOGGED_LIMIT = 1000  # pods and namespaces remembered as logged (a bounded set: cleared when full)


def fault_events(old: DeviceState | None, new: DeviceState) -> list[tuple[str, str, str]]:
    """(type, reason, message) for each code of the device that occurred, recovered or was escalated."""
    before = {code.code: code for code in (old.codes if old else ())}
    after = {code.code: code for code in new.codes}
    npu = f"NPU{new.phy_id}"
    found = []
    for code, now in after.items():
        was = before.get(code)
        by = f", escalated by {now.escalated_by}" if now.escalated_by else ""
        if was is None:
            found.append((WARNING, OCCURRED, f"{npu}: fault {now.text} occurred ({now.level.name}{by})"))
        elif now.escalated_by and (now.escalated_by != was.escalated_by or now.level > was.level):
            found.append((WARNING, ESCALATED, f"{npu}: fault {now.text} escalated from {was.level.name} to "
                                              f"{now.level.name} by {now.escalated_by}"))
    for code, was in before.items():
        if code not in after:
            found.append((NORMAL, RECOVERED, f"{npu}: fault {was.text} recovered (was {was.level.name})"))
    return found


class KubeEventsSink:
    """An agent.model.Sink."""

    name = "kube-events"

    def __init__(self, node: str, hub: FaultHub, pods_of: PodsOf, *, kube: Lane,
                 api_factory: Callable[[], client.CoreV1Api] = core_api, clock: Callable[[], float] = time.time,
                 correlator: EventCorrelator | None = None, queue_limit: int = QUEUE_LIMIT, tries: int = TRIES,
                 retry_s: tuple[float, ...] = RETRY_S, uid_ttl_s: float = UID_TTL_S):
        self._node = node
        self._pods_of = pods_of
        self._kube = kube
        self._api_factory = api_factory
        self._api: client.CoreV1Api | None = None
        self._clock = clock
        self._correlator = correlator or EventCorrelator((COMPONENT, node))
        self._queue: deque[Recorded] = deque()
        self._queue_limit = queue_limit
        self._tries = tries
        self._retry_s = retry_s
        self._uid_ttl_s = uid_ttl_s
        self._uids: dict[tuple[str, str], tuple[str, float]] = {}  # (namespace, pod) -> (uid or "", until)
        # The last state of each device the events were derived from: the log's, so standing faults
        # are not announced again by a restart.
        self._last: dict[int, DeviceState] = {change.state.phy_id: change.state for change in hub.snapshot().devices}
        self._wakeup = asyncio.Event()
        self.tasks = Tasks("kube-events")
        self.recorded: Counter[str] = Counter({reason: 0 for reason in REASONS})
        self.dropped: Counter[str] = Counter({cause: 0 for cause in DROP_CAUSES})
        self.counters: Counter[str] = Counter()  # requests by result: created, patched, failed
        self.last_success = 0.0
        self.pending = 0  # best-effort: nothing is owed (the queue is `queued`)
        self.writes = ()  # it keeps nothing on disk (agent.model.Sink)
        self.error = ""  # for /readyz: a missing grant only
        self._failing = ""  # the failure being logged, "" while posts work
        self._full_logged = False
        self._unreadable: set[tuple[str, str]] = set()  # pods whose uid could not be read, logged once each
        self._gone_logged: set[str] = set()  # namespaces whose events were dropped as gone, logged once each

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def start(self) -> None:
        self.tasks.start("sender", self._send_all)

    async def stop(self) -> None:
        await self.tasks.stop(timeout=1.0)

    def readiness(self) -> tuple[bool, str]:
        return (not self.error, self.error)

    def notify(self, changes: list[Change]) -> None:
        now = self._clock()
        for change in changes:
            state = change.state
            found = fault_events(self._last.get(state.phy_id), state)
            self._last[state.phy_id] = state
            if not found:
                continue
            pods = list(dict.fromkeys((ref.namespace, ref.pod) for ref in self._pods_of(state.phy_id)))
            names = ", ".join(f"{namespace}/{pod}" for namespace, pod in pods)
            held = f" (pod{'s' if len(pods) > 1 else ''} {names})" if pods else ""
            for kind, reason, message in found:
                self._record(Recorded(ObjectRef("Node", self._node, uid=self._node), kind, reason, message + held, now))
                for namespace, pod in pods:  # the uid is read as it is sent
                    self._record(Recorded(ObjectRef("Pod", pod, namespace, api_version="v1"), kind, reason, message,
                                          now))
        if self._queue:
            self._wakeup.set()

    def _record(self, event: Recorded) -> None:
        """Queued as it is, before correlation: a dropped event leaves no trace in the counts sent."""
        self.recorded[event.reason] += 1
        if len(self._queue) >= self._queue_limit:  # client-go drops the newest when its queue is full
            self.dropped["queue_full"] += 1
            if not self._full_logged:
                self._full_logged = True
                log.warning("Kubernetes events queue full; dropping new events until it drains",
                            extra={"limit": self._queue_limit})
            return
        self._queue.append(event)

    async def _send_all(self) -> None:
        while True:
            while not self._queue:
                self._full_logged = False
                self._wakeup.clear()
                await self._wakeup.wait()
            event = self._queue.popleft()
            ref = event.involved
            if ref.kind == "Pod":
                event = replace(event, involved=replace(ref, uid=await self._uid_of(ref.namespace, ref.name)))
            outgoing = self._correlator.correlate(event)
            if outgoing is None:
                self.dropped["rate_limited"] += 1
                continue
            await self._deliver(outgoing)

    async def _deliver(self, outgoing: Outgoing) -> None:
        attempt = 0
        while True:
            try:
                name, count = await self._kube.run(self._send, outgoing, timeout=REQUEST_TIMEOUT_S + 5, key=self.name)
            except FAILURES as exc:
                problem = failure(exc)
                if outgoing.action == "patch" and problem.status == 404 and not problem.namespace_gone:
                    # The event expired (the API server's --event-ttl) since: create it again, as client-go does.
                    outgoing = replace(outgoing, action="create")
                    continue
                attempt += 1
                if problem.retryable and attempt < self._tries:
                    await asyncio.sleep(self._retry_s[min(attempt, len(self._retry_s)) - 1])
                    continue
                self._dropped(outgoing, problem)
                return
            self._correlator.observed(outgoing, name, count)
            self.counters["created" if outgoing.action == "create" else "patched"] += 1
            self.last_success = self._clock()
            if self._failing:
                log.info("Kubernetes events posted again", extra={"node": self._node})
            self._failing = self.error = ""
            return

    def _dropped(self, outgoing: Outgoing, problem: Failure) -> None:
        self.counters["failed"] += 1
        self._correlator.forget(outgoing)
        ref = outgoing.event.involved
        if problem.namespace_gone:  # the pod's namespace is being deleted or gone: nobody will read the event
            self.dropped["namespace_gone"] += 1
            if outgoing.namespace not in self._gone_logged:
                if len(self._gone_logged) >= LOGGED_LIMIT:
                    self._gone_logged.clear()
                self._gone_logged.add(outgoing.namespace)
                log.info("a pod's namespace is being deleted or gone; dropping its Kubernetes events", extra={
                    "namespace": outgoing.namespace, "object": f"{ref.kind} {ref.namespace}/{ref.name}",
                    "reason": problem.text})
            return
        self.dropped["failed"] += 1
        if problem.forbidden:
            self.error = (f"cannot {outgoing.action} events in namespace {outgoing.namespace} ({problem.text}): "
                          f"the agent's ClusterRole needs create and patch on events")
        if problem.text != self._failing:
            self._failing = problem.text
            log.error("cannot post a Kubernetes event; dropping it (events are best-effort)", extra={
                "event": f"{outgoing.namespace}/{outgoing.name}",
                "object": f"{ref.kind} {ref.namespace + '/' if ref.namespace else ''}{ref.name}",
                "reason": problem.text, "tries": self._tries})

    async def _uid_of(self, namespace: str, pod: str) -> str:
        """The pod's uid ("" when it cannot be read: the event still goes out, `kubectl get events` shows it)."""
        now = self._clock()
        cached = self._uids.get((namespace, pod))
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            uid = await self._kube.run(self._read_uid, namespace, pod, timeout=REQUEST_TIMEOUT_S + 5, key=self.name)
            self._unreadable.discard((namespace, pod))
        except FAILURES as exc:
            uid = ""
            if (namespace, pod) not in self._unreadable:  # once per pod until its uid is read again
                if len(self._unreadable) >= LOGGED_LIMIT:
                    self._unreadable.clear()
                self._unreadable.add((namespace, pod))
                log.warning("cannot read the uid of a pod holding a faulty NPU; its events name the pod without it "
                            "(kubectl describe pod will not list them)",
                            extra={"pod": f"{namespace}/{pod}", "reason": failure(exc).text})
        if len(self._uids) >= 4 * self._queue_limit:  # pods come and go: the cache does not grow without end
            self._uids = {key: value for key, value in self._uids.items() if value[1] > now}
        self._uids[(namespace, pod)] = (uid, now + self._uid_ttl_s)
        return uid

    # ---- in the kube lane -----------------------------------------------------------------------

    def _core(self) -> client.CoreV1Api:
        if self._api is None:
            self._api = self._api_factory()
        return self._api

    def _read_uid(self, namespace: str, pod: str) -> str:
        response = self._core().read_namespaced_pod(pod, namespace, _request_timeout=REQUEST_TIMEOUT_S,
                                                     _preload_content=False)
        return str((json.loads(response.data).get("metadata") or {}).get("uid") or "")

    def _send(self, outgoing: Outgoing) -> tuple[str, int]:
        """Create or patch the event; the name and count the API server stored."""
        api, event, ref = self._core(), outgoing.event, outgoing.event.involved
        if outgoing.action == "create":
            involved = {"kind": ref.kind, "namespace": ref.namespace, "name": ref.name, "uid": ref.uid,
                        "apiVersion": ref.api_version}
            body = {"metadata": {"name": outgoing.name, "namespace": outgoing.namespace},
                    "involvedObject": {key: value for key, value in involved.items() if value},
                    "reason": event.reason, "message": event.message, "type": event.type, "count": outgoing.count,
                    "firstTimestamp": kube_time(outgoing.first_at), "lastTimestamp": kube_time(event.at),
                    "source": {"component": COMPONENT, "host": self._node},
                    "reportingComponent": COMPONENT, "reportingInstance": self._node}
            response = api.create_namespaced_event(outgoing.namespace, body, _request_timeout=REQUEST_TIMEOUT_S,
                                                   _preload_content=False)
        else:  # what client-go's two-way merge patch of a repeated event holds
            body = {"count": outgoing.count, "lastTimestamp": kube_time(event.at), "message": event.message}
            response = api.patch_namespaced_event(outgoing.name, outgoing.namespace, body,
                                                  _content_type=STRATEGIC_MERGE_PATCH,
                                                  _request_timeout=REQUEST_TIMEOUT_S, _preload_content=False)
        stored = json.loads(response.data)
        return str(stored["metadata"]["name"]), int(stored.get("count") or outgoing.count)
