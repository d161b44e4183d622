"""The ClusterD sink: every public-fault transition, in order, to `/PubFault/SendPublicFault`.

It walks the durable fault log from its cursor, turns each device change into occur/recover
transitions against what ClusterD has acknowledged, sends them in batches of up to 100 at no more
than one request a second (ClusterD's per-resource budget is shared by the whole cluster), and
advances its cursor only after ClusterD answered 0. Nothing is sent twice on purpose, and nothing
is dropped: a rate-limited (410) or unreachable ClusterD is retried with backoff and jitter; a
rejected request (409) cannot happen for requests that passed the same validation here, so it is
logged with the request as a bug and skipped.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import Counter
from typing import Callable

import grpc
from google.protobuf.json_format import MessageToDict

from agent._proto import pubfault_pb2 as pb
from agent._proto import pubfault_pb2_grpc as pb_grpc
from agent.config import ClusterdConfig
from agent.faults.clusterd_batch import SETTLE_S, ClusterdView, plan
from agent.faults.hub import Change
from agent.faults.log import FaultLog
from agent.faults.pubfault import (MAX_FAULTS_PER_REQUEST, PublicFault, fault_problems, public_faults,
                                   request_problems, to_message)
from agent.kube.podresources import PodsOf, no_pods
from agent.ratelimit import TokenBucket

log = logging.getLogger(__name__)

SINK = "clusterd"
CALL_DEADLINE_S = 5.0
REQUESTS_PER_S, REQUEST_BURST = 1.0, 2
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 30.0
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),  # ClusterD answers pings more often than every 3 s with GOAWAY
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", 4 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 1_000),
    ("grpc.max_reconnect_backoff_ms", 5_000),  # notice a returning ClusterD within seconds
]


class ClusterdSink:
    name = SINK

    def __init__(self, config: ClusterdConfig, node: str, fault_log: FaultLog,
                 clock: Callable[[], float] = time.time, pods_of: PodsOf = no_pods):
        self._config = config
        self._pods_of = pods_of  # who holds an NPU when its fault is sent (kubelet attribution)
        self._node = node
        self._log = fault_log
        self._clock = clock
        self._bucket = TokenBucket(REQUESTS_PER_S, REQUEST_BURST, time.monotonic)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub = None
        self._view = ClusterdView()  # what ClusterD holds, as far as it acknowledged
        self.coalesced = 0  # transitions ClusterD could not have represented (see clusterd_batch)
        self.counters: Counter[str] = Counter()  # requests by result
        self.last_success = 0.0

    # ---- component ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._channel = grpc.aio.insecure_channel(self._config.address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.PubFaultStub(self._channel)
        self._task = asyncio.create_task(self._run(), name="clusterd-sink")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._channel is not None:
            await self._channel.close(grace=None)

    def readiness(self) -> tuple[bool, str]:
        return True, ""  # delivery lag shows in npu_agent_outbox_pending, not in readiness

    def notify(self, changes: list[Change]) -> None:
        """The fault log has new changes (called on the loop after each durable append)."""
        self._wakeup.set()

    @property
    def pending(self) -> int:
        return self._log.pending(SINK)

    @property
    def deferred(self) -> int:
        return len(self._view.deferred)

    # ---- delivery -----------------------------------------------------------------------------

    def _desired(self, states) -> dict[str, PublicFault]:
        wanted: dict[str, PublicFault] = {}
        for state in states:
            wanted.update(public_faults(self._node, state, self._config.public_codes))
        return wanted

    async def _run(self) -> None:
        cursor = self._log.cursor(SINK)
        acked_states = self._log.state_at(cursor) or {}
        self._view = ClusterdView(held=self._desired(acked_states.values()),
                                  unknown_before=self._last_run_recovers())
        log.info("clusterd sink starting", extra={"address": self._config.address, "resource": self._config.resource,
                                                  "cursor": cursor, "pending": self._log.pending(SINK),
                                                  "active_public_faults": len(self._view.held)})
        await self._let_previous_requests_land()
        # Reconcile: ClusterD may have lost what it had; occur for what is active is a harmless repeat.
        active = list(self._view.held.values())
        for start in range(0, len(active), MAX_FAULTS_PER_REQUEST):
            await self._send_until_done([("occur", f) for f in active[start:start + MAX_FAULTS_PER_REQUEST]])
        while True:
            self._wakeup.clear()
            wait = await self._deliver_once()
            if wait == 0:
                continue
            try:
                await asyncio.wait_for(self._wakeup.wait(), wait)
            except TimeoutError:
                pass

    async def _deliver_once(self) -> float | None:
        """Send the next batch; returns how long to wait before trying again (None: until woken)."""
        cursor = self._log.cursor(SINK)
        changes = self._log.changes_after(cursor)
        if changes is None:  # cannot happen: compaction keeps what a cursor still needs
            log.error("clusterd cursor fell behind the fault log; resynchronising", extra={"cursor": cursor})
            latest = self._log.latest()
            wanted = self._desired(c.state for c in latest.values())
            batch = [("recover", f) for fid, f in self._view.held.items() if fid not in wanted]
            batch += [("occur", f) for f in wanted.values()]
            for start in range(0, len(batch), MAX_FAULTS_PER_REQUEST):
                await self._send_until_done(batch[start:start + MAX_FAULTS_PER_REQUEST])
            self._view = ClusterdView(held=wanted, recovered_at=self._view.recovered_at)
            self._log.commit(SINK, self._log.revision)
            return None
        if not changes and not self._view.deferred:
            return None
        now = time.monotonic()
        step = plan(self._view, cursor, changes, self._wanted, now)
        if step.coalesced:
            self.coalesced += step.coalesced
            log.info("recover and re-occur of the same fault too close for ClusterD; coalesced", extra={
                "transitions": step.coalesced, "deferred": len(step.view.deferred)})
        if step.transitions:
            await self._send_until_done(step.transitions)
            acked = time.monotonic()
            step.view.recovered_at = {fid: at for fid, at in step.view.recovered_at.items() if acked - at < SETTLE_S}
            step.view.recovered_at.update((f.fault_id, acked) for a, f in step.transitions if a == "recover")
        self._view = step.view
        if step.last_revision > cursor:
            self._log.commit(SINK, step.last_revision)
            if self._log.pending(SINK) > 0:
                return 0.0  # more than one request's worth was pending
        return step.wait

    async def _let_previous_requests_land(self) -> None:
        """A previous run that died in the middle of a send may have left its request in flight, and
        ClusterD applies a request whatever the client's deadline: wait until that deadline has
        passed, so the stale request cannot land after (and undo) this run's first one."""
        if not self._log.pending(SINK):
            return
        last = max(self._log.previous_append_at or 0.0, self._log.previous_commit_at or 0.0)
        hold = min(CALL_DEADLINE_S + 0.5, last + CALL_DEADLINE_S + 0.5 - time.time())
        if hold > 0:
            log.info("holding the first request until the previous run's last one has expired",
                     extra={"seconds": round(hold, 2)})
            await asyncio.sleep(hold)

    def _last_run_recovers(self) -> float:
        """Until when (monotonic) the previous run may have sent recovers: its last commit."""
        committed = self._log.previous_commit_at
        if committed is None:
            return float("-inf")
        return time.monotonic() - max(0.0, time.time() - committed)

    def _wanted(self, change: Change) -> dict[str, PublicFault]:
        return public_faults(self._node, change.state, self._config.public_codes)

    async def _send_until_done(self, batch: list[tuple[str, PublicFault]]) -> None:
        faults = []
        for assertion, fault in batch:
            message = to_message(self._node, assertion, fault, self._pods_of(fault.device))
            problems = fault_problems(message, frozenset(self._config.public_codes.values()))
            if problems:
                self.counters["invalid"] += 1
                log.error("public fault fails ClusterD's rules; not sent", extra={
                    "fault": MessageToDict(message), "problems": problems})
                continue
            faults.append(message)
        attempt = 0
        while faults:
            delay = self._bucket.wait_time()
            if delay:
                await asyncio.sleep(delay)
            self._bucket.take()
            now_ms = int(self._clock() * 1000)
            request = pb.PublicFaultRequest(id=str(uuid.uuid4()), timestamp=now_ms, version="1.0",
                                            resource=self._config.resource, faults=faults)
            problems = request_problems(request)
            if problems:  # cannot happen for what this module builds; never send what ClusterD would refuse
                self.counters["invalid"] += 1
                log.error("request fails ClusterD's rules; not sent", extra={"problems": problems})
                return
            outcome = await self._call(request)
            if outcome == "sent":
                self.last_success = self._clock()
                return
            if outcome == "rejected":
                return
            attempt += 1
            backoff = random.uniform(0.5, min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** attempt))
            if outcome == "unreachable":
                await self._sleep_until_connected(backoff)
            else:
                await asyncio.sleep(backoff)

    async def _sleep_until_connected(self, seconds: float) -> None:
        """Back off, but retry as soon as the channel connects again: ClusterD is back."""
        async def connected() -> None:
            state = self._channel.get_state(try_to_connect=True)
            while state is not grpc.ChannelConnectivity.READY:
                await self._channel.wait_for_state_change(state)
                state = self._channel.get_state(try_to_connect=True)
        try:
            await asyncio.wait_for(connected(), seconds)
        except TimeoutError:
            pass

    async def _call(self, request: pb.PublicFaultRequest) -> str:
        try:
            reply = await self._stub.SendPublicFault(request, timeout=CALL_DEADLINE_S)
        except grpc.aio.AioRpcError as exc:
            self.counters["unavailable"] += 1
            self._log_transition("clusterd unreachable; retrying", code=exc.code().name, details=exc.details())
            # A channel that is still connected (ClusterD answered with an error) would be "ready" at once.
            connected = self._channel.get_state() is grpc.ChannelConnectivity.READY
            return "retry" if connected else "unreachable"
        if reply.code == 0:
            self.counters["sent"] += 1
            self._log_transition("")
            log.info("public faults delivered", extra={
                "faults": [f"{f.assertion} {f.faultCode} NPU{f.influence[0].deviceIds[0]}" for f in request.faults]})
            return "sent"
        if reply.code == 409:
            self.counters["rejected"] += 1
            log.error("clusterd rejected a request that passed its own rules here (a bug); skipped",
                      extra={"info": reply.info, "request": MessageToDict(request)})
            return "rejected"
        self.counters["rate_limited" if reply.code == 410 else "error"] += 1
        self._log_transition("clusterd refused the request; retrying", code=reply.code, details=reply.info)
        return "retry"

    _last_problem = ""

    def _log_transition(self, message: str, **fields) -> None:
        """Log when delivery starts failing (or fails differently) and when it works again, not every retry."""
        key = f"{message} {fields.get('code', '')}"
        if key == self._last_problem:
            return
        if message:
            log.warning(message, extra={**fields, "pending": self._log.pending(SINK)})
        elif self._last_problem:
            log.info("clusterd reachable again")
        self._last_problem = key if message else ""
