"""The `NPUProblem` condition on this node's Node object (`kubectl describe node`): an agent.model.Sink
that writes the latest state, as the device-info ConfigMap sink does.

Written with a strategic merge patch of `nodes/<node>/status` that names this one condition (the
merge key of `status.conditions` is `type`), never with a whole-status update: the kubelet writes its
own conditions concurrently, and neither may overwrite the other's. No resourceVersion is sent, so
a concurrent write never conflicts.

Timing: a change is written at most once a second; the state is looked at again every RECHECK_S
(pods move, the driver fails, without a fault change) and the condition is written again at least
every HEARTBEAT_S, node-problem-detector's default `--k8s-exporter-heartbeat-period` (5 min), so that
`lastHeartbeatTime` shows a live writer. Every write refreshes `lastHeartbeatTime`;
`lastTransitionTime` changes only when the status does, across restarts too: the first write of a
process learns the status a previous run left from an empty patch's answer (the API server returns
the node; an empty patch needs only the `patch` grant the writes need, no `get nodes`). A failed
write is retried after a backoff (RETRY_S). Only a 403 (a missing grant, which only an operator can
fix) makes the agent unready, naming the grant on /readyz; any other failure (the API server
restarting, unreachable, overloaded; the Node not found) is logged once per cause, counted and shown
on the status page, and the agent stays ready: an API server blip must not make every agent of the
cluster NotReady at once.

At start the condition a previous run left stays while the agent has not polled every NPU, for
START_GRACE_S: a restart must not make it blink to Unknown. After that, or at once when the driver
cannot be read, Unknown is written. SIGTERM leaves the condition as it is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from typing import Callable

from kubernetes import client

from agent.common.executor import Lane
from agent.faults.hub import FaultHub
from agent.kube.calls import FAILURES, STRATEGIC_MERGE_PATCH, Failure, failure, kube_time
from agent.kube.client import REQUEST_TIMEOUT_S, core_api
from agent.lifecycle import Tasks
from agent.model import Change, PodsOf
from agent.sinks.nodecondition.condition import CONDITION_TYPE, Condition, npu_problem

log = logging.getLogger(__name__)

HEARTBEAT_S = 300.0
RECHECK_S = 10.0
MIN_INTERVAL_S = 1.0
START_GRACE_S = 30.0
GRACE_RECHECK_S = 1.0
RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class NodeConditionSink:
    """An agent.model.Sink."""

    name = "node-condition"

    def __init__(self, node: str, hub: FaultHub, pods_of: PodsOf, *, polled: Callable[[], bool],
                 driver_problem: Callable[[], str], kube: Lane,
                 api_factory: Callable[[], client.CoreV1Api] = core_api, clock: Callable[[], float] = time.time,
                 heartbeat_s: float = HEARTBEAT_S, recheck_s: float = RECHECK_S,
                 min_interval_s: float = MIN_INTERVAL_S, start_grace_s: float = START_GRACE_S,
                 retry_s: tuple[float, ...] = RETRY_S):
        self._node = node
        self._hub = hub
        self._pods_of = pods_of
        self._polled = polled
        self._driver_problem = driver_problem
        self._kube = kube
        self._api_factory = api_factory
        self._api: client.CoreV1Api | None = None
        self._clock = clock
        self._heartbeat_s = heartbeat_s
        self._recheck_s = recheck_s
        self._min_interval_s = min_interval_s
        self._start_grace_s = start_grace_s
        self._retry_s = retry_s
        self._wakeup = asyncio.Event()
        self.tasks = Tasks("node-condition")
        self._started_at = 0.0
        self._attempted_at = float("-inf")
        self._written_at = 0.0
        # (status, lastTransitionTime) on the node as last seen; None until this process has looked.
        self._on_node: tuple[str, str] | None = None
        self.written: Condition | None = None  # what this process last wrote
        self.error = ""  # for /readyz: a missing grant only
        self.failing = ""  # the failure being retried, "" while writes work
        self.rounds = 0  # looks at the state so far (tests wait on it rather than on time)
        self.counters: Counter[str] = Counter()  # written, forbidden, error
        self.last_success = 0.0
        self.pending = 0  # it writes the latest state; it has no backlog
        self.writes = ()  # it keeps nothing on disk (agent.model.Sink)

    async def start(self) -> None:
        self._started_at = self._clock()
        self.tasks.start("writer", self._run)

    async def stop(self) -> None:
        await self.tasks.stop(timeout=1.0)  # the condition stays: a restart must not blink it

    def readiness(self) -> tuple[bool, str]:
        return (not self.error, self.error)

    def notify(self, changes: list[Change]) -> None:
        self._wakeup.set()

    def wanted(self) -> Condition | None:
        """The condition to write now; None while a previous run's may still stand (the start's grace)."""
        problem = self._driver_problem()
        states = [change.state for change in self._hub.snapshot().devices]
        condition = npu_problem(states, self._pods_of, polled=self._polled(), driver_problem=problem)
        if (condition.status == "Unknown" and self.written is None and not problem
                and self._clock() - self._started_at < self._start_grace_s):
            return None
        return condition

    async def _run(self) -> None:
        failures = 0
        while True:
            # Cleared before the state is read: a change during the write wakes the next round.
            self._wakeup.clear()
            wait = await self._write_if_due()
            self.rounds += 1
            if wait is None:  # failed: back off, whatever changes meanwhile (the next write takes the latest)
                failures += 1
                await asyncio.sleep(self._retry_s[min(failures, len(self._retry_s)) - 1])
                continue
            failures = 0
            try:
                await asyncio.wait_for(self._wakeup.wait(), wait)
            except TimeoutError:
                pass

    async def _write_if_due(self) -> float | None:
        """Write when due; the seconds until the next look, or None after a failure."""
        wanted = self.wanted()
        now = self._clock()
        if wanted is None:  # looked at every second: the driver failing to open ends the grace
            return min(GRACE_RECHECK_S, max(0.0, self._started_at + self._start_grace_s - now))
        since = now - self._written_at
        if wanted == self.written and since < self._heartbeat_s:
            return min(self._recheck_s, self._heartbeat_s - since)
        if now - self._attempted_at < self._min_interval_s:  # changes within a second go out as one write
            return self._min_interval_s - (now - self._attempted_at)
        self._attempted_at = now
        try:
            if self._on_node is None:
                self._on_node = await self._kube.run(self._read, timeout=REQUEST_TIMEOUT_S + 5, key=self.name)
            status, transition = self._on_node
            if wanted.status != status or not transition:
                transition = kube_time(now)
            await self._kube.run(self._patch, self._body(wanted, now, transition), timeout=REQUEST_TIMEOUT_S + 5,
                                 key=self.name)
        except FAILURES as exc:
            return self._failed(failure(exc))
        if self.failing:
            log.info("node condition written again", extra={"node": self._node, "condition": CONDITION_TYPE})
        if wanted.status != (self.written.status if self.written else self._on_node[0]):
            log.info("node condition changed", extra={"node": self._node, "condition": CONDITION_TYPE,
                                                      "status": wanted.status, "reason": wanted.reason})
        self.error = self.failing = ""
        self._on_node = (wanted.status, transition)
        self.written, self._written_at = wanted, now
        self.counters["written"] += 1
        self.last_success = self._clock()
        return min(self._recheck_s, self._heartbeat_s)

    def _body(self, condition: Condition, now: float, transition: str) -> dict:
        return {"status": {"conditions": [{
            "type": CONDITION_TYPE, "status": condition.status, "reason": condition.reason,
            "message": condition.message, "lastHeartbeatTime": kube_time(now), "lastTransitionTime": transition}]}}

    def _failed(self, problem: Failure) -> None:
        self.counters["forbidden" if problem.forbidden else "error"] += 1
        where = f"nodes/{self._node}/status"
        if problem.forbidden:
            failing = f"cannot patch {where} ({problem.text}): the agent's ClusterRole needs patch on nodes/status"
        elif problem.status == 404:
            failing = (f"cannot patch {where} ({problem.text}): no Node named {self._node!r}; the agent's node name "
                       f"must be the Node's (the pod's spec.nodeName)")
        else:
            failing = f"cannot patch {where}: {problem.text}"
        if failing != self.failing:
            log.error("cannot write the node condition; retrying", extra={
                "node": self._node, "condition": CONDITION_TYPE, "reason": failing})
        self.failing = failing
        # Only a missing grant is a readiness problem: it is this agent's to report, while any other
        # failure would make every agent of the cluster unready at once.
        self.error = failing if problem.forbidden else ""
        return None

    # ---- in the kube lane -----------------------------------------------------------------------

    def _call(self, body: dict) -> dict:
        if self._api is None:
            self._api = self._api_factory()
        response = self._api.patch_node_status(self._node, body, _content_type=STRATEGIC_MERGE_PATCH,
                                               _request_timeout=REQUEST_TIMEOUT_S, _preload_content=False)
        return json.loads(response.data or b"{}")

    def _read(self) -> tuple[str, str]:
        """(status, lastTransitionTime) of the condition on the node now, ("", "") when it has none."""
        node = self._call({})  # an empty patch changes nothing and answers with the node
        conditions = (node.get("status") or {}).get("conditions") or []
        for condition in conditions:
            if isinstance(condition, dict) and condition.get("type") == CONDITION_TYPE:
                return str(condition.get("status") or ""), str(condition.get("lastTransitionTime") or "")
        return "", ""

    def _patch(self, body: dict) -> None:
        self._call(body)


class StaleConditionRemoval:
    """With `kubernetes.node_condition` off: removes a condition an earlier run left, once at start,
    with a strategic merge patch deleting it (`$patch: delete`; nothing is read first). A 403 is
    logged once at info (the chart grants the patch; a hand-made Role may not need to) and is not a
    readiness problem; errors a retry may fix are retried a few times, then logged."""

    name = "node-condition-removal"
    TRIES = 4

    def __init__(self, node: str, *, kube: Lane, api_factory: Callable[[], client.CoreV1Api] = core_api,
                 retry_s: tuple[float, ...] = RETRY_S):
        self._node = node
        self._kube = kube
        self._api_factory = api_factory
        self._retry_s = retry_s
        self.tasks = Tasks(self.name)
        self.result = ""  # removed, forbidden, failed; "" while under way

    async def start(self) -> None:
        self.tasks.start("remove", self._remove)

    async def stop(self) -> None:
        await self.tasks.stop(timeout=1.0)

    def readiness(self) -> tuple[bool, str]:
        return True, ""

    async def _remove(self) -> None:
        where = f"nodes/{self._node}/status"
        for attempt in range(self.TRIES):
            try:
                await self._kube.run(self._patch, timeout=REQUEST_TIMEOUT_S + 5, key=self.name)
            except FAILURES as exc:
                problem = failure(exc)
                if problem.forbidden:
                    self.result = "forbidden"
                    log.info("cannot remove an earlier run's node condition (kubernetes.node_condition is off); "
                             "leaving it", extra={"node": self._node, "condition": CONDITION_TYPE,
                                                  "reason": problem.text})
                    return
                if not problem.retryable or attempt + 1 == self.TRIES:
                    self.result = "failed"
                    log.warning("cannot remove an earlier run's node condition", extra={
                        "node": self._node, "condition": CONDITION_TYPE, "patch": where, "reason": problem.text})
                    return
                await asyncio.sleep(self._retry_s[min(attempt, len(self._retry_s) - 1)])
                continue
            self.result = "removed"
            log.info("no node condition: removed any an earlier run left",
                     extra={"node": self._node, "condition": CONDITION_TYPE})
            return

    def _patch(self) -> None:
        api = self._api_factory()
        api.patch_node_status(self._node, {"status": {"conditions": [{"type": CONDITION_TYPE, "$patch": "delete"}]}},
                              _content_type=STRATEGIC_MERGE_PATCH, _request_timeout=REQUEST_TIMEOUT_S,
                              _preload_content=False)
