"""The ClusterD sink: keeps ClusterD's public-fault cache equal to this node's public faults.

It walks the durable fault log from its cursor, turns each device change into occur/recover
transitions against what ClusterD has acknowledged, sends them in batches of up to 100 at no more
than one request a second (ClusterD's per-resource budget is shared by the whole cluster), and
advances its cursor, saved with its view of ClusterD, only after ClusterD answered 0. A rate-limited
(410) or unreachable ClusterD is retried with backoff and jitter; a rejected request (409) cannot
happen for requests that passed the same validation here, so it is logged with the request as a bug.

Delivering every change once is not enough: ClusterD loses faults (a restart without its saved
cache), brings recovered ones back (a restart loses its queue of pending deletions), and a request
that timed out may still land. So the sink re-asserts its view (`clusterd_batch.reassertion`)
whenever ClusterD may have lost it: at start, when the connection to ClusterD dropped or a request
failed (and once more `FOLLOW_UP_S` later, for a ClusterD that reloads its cache after it started
serving), and every `reconcile_interval_seconds`. A node with no fault held or recently recovered
sends nothing (but for the periodic check below). A re-assertion (or resync) that waits out a ClusterD outage is made again at each try:
sent as built, it would occur faults recovered meanwhile, and ClusterD would hold them for its delete
delay (5 s and more) after their recover.

At the scale of a cluster (see `pacing`): a request ClusterD refused for its rate is retried after
a delay that grows with how long the node has waited, so that a storm on many nodes drains at
ClusterD's rate with fewer refused calls than a fixed backoff; such a retry is planned again from
the fault log, so a severe fault raised meanwhile goes with it rather than after it. The connection
is opened for a request and closed `idle_disconnect_seconds` after the last one (ClusterD admits
1,024 for the whole cluster), except on a small cluster (`cluster_nodes`), where a node holding
faults stays connected to hear of a ClusterD restart at once. The periodic re-assertion's period
grows with `cluster_nodes` so that the cluster's re-assertions stay a small share of the budget.
With `resources`, each node sends under one of them, always the same, by a hash of its name.

With the API server (`observe`), a new ClusterD process is noticed from its pod whether the node is
connected or not, and every re-assertion (after a restart, a lost connection, failed requests, as
a follow-up or periodically) first reads what ClusterD saved (its ConfigMap) and sends only the
difference; the follow-up, `FOLLOW_UP_S` later, reads it again once ClusterD has surely reloaded
it. A restart that kept everything costs no request, so it does not cost the cluster's budget what
a storm would. The check at start and the periodic one run on nodes without faults too: they find
keys ClusterD holds for the node that the node does not know (its state_dir was lost). With the ConfigMap unreadable,
the node re-sends everything, as without the API server.

The sink never dies: a failed cursor write keeps the cursor in memory and is retried with backoff
(delivery goes on meanwhile), an unexpected error restarts the delivery loop with backoff, and
both show on /readyz until they clear.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import Counter
from typing import TYPE_CHECKING, Callable

import grpc
from google.protobuf.json_format import MessageToDict

from agent._proto import pubfault_pb2 as pb
from agent._proto import pubfault_pb2_grpc as pb_grpc
from agent.config import ClusterdConfig, resource_names
from agent.sinks.clusterd.batch import (ClusterdView, Transition, current, differences, plan, reassertion,
                                        requests, resync)
from agent.sinks.clusterd.pacing import Pacing, reconcile_period_s, resource_of
from agent.model import Change, PodsOf, no_pods
from agent.faults.log import FaultLog
from agent.sinks.clusterd.pubfault import (MAX_FAULTS_PER_REQUEST, PublicFault, fault_problems, public_faults,
                                           request_problems, to_message)
from agent.common.fsutil import WriteRetry
from agent.common.ratelimit import TokenBucket, doubling
from agent.lifecycle import Tasks

if TYPE_CHECKING:
    from agent.sinks.clusterd.observe import ClusterdObserver

log = logging.getLogger(__name__)

SINK = "clusterd"
CALL_DEADLINE_S = 5.0
REQUESTS_PER_S, REQUEST_BURST = 1.0, 2
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 30.0
FOLLOW_UP_S = 30.0  # ClusterD reloads its saved cache only after it serves; requests before may be undone
# Every node notices a ClusterD restart at the same moment, and the new process has a burst of 100
# requests for the whole cluster: spread the re-assertions (and their follow-ups) a little.
REASSERT_SPREAD_S = 1.0
# After a restart, the nodes that hold faults read ClusterD's ConfigMap: spread over up to a second
# per CHECKS_PER_S nodes of the cluster (the API server serves them; ClusterD is not asked).
CHECKS_PER_S = 50.0
SAVE_LAG_S = 3.0  # ClusterD saves its cache about a second after a change, then the API server has it
HOLD_CONNECTION_NODES = 256  # up to this `cluster_nodes`, faulty nodes cannot fill a quarter of ClusterD's 1,024
RECONCILE_BUDGET_SHARE = 0.04  # of each resource's refill, for the whole cluster's periodic re-assertions
CHANNEL_OPTIONS = [
    # This channel's connection is its own, not shared with another channel of the process to the same
    # address (a process running many sinks, as the scale benchmark does, would otherwise use one).
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.keepalive_time_ms", 10_000),  # ClusterD answers pings more often than every 3 s with GOAWAY
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", 4 * 1024 * 1024),
    # Notice a returning ClusterD within a second or two (one connection: the attempts cost nothing).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


class ClusterdSink:
    """An agent.model.Sink; its own families are agent.sinks.clusterd.metrics'."""

    name = SINK

    def __init__(self, config: ClusterdConfig, node: str, fault_log: FaultLog,
                 clock: Callable[[], float] = time.time, pods_of: PodsOf = no_pods,
                 devices_known: Callable[[], bool] = lambda: True, monotonic: Callable[[], float] = time.monotonic,
                 observer: ClusterdObserver | None = None):
        """`clock` is the wall clock (request times), `monotonic` the one of the loop's sleeps (the loop's own);
        `observer`: ClusterD as the API server shows it (its restarts, what it saved), when there is one."""
        self._config = config
        self._devices_known = devices_known  # the first poll is done: the log's latest states are current
        self._pods_of = pods_of  # who holds an NPU when its fault is sent (kubelet attribution)
        self._node = node
        self._log = fault_log
        self._clock = clock
        self._now = monotonic
        resources = resource_names(config.resources)
        self._resource = resource_of(node, config.resource, resources)
        self._hold = config.cluster_nodes <= HOLD_CONNECTION_NODES
        self._reconcile_s = reconcile_period_s(config.reconcile_interval_seconds, config.cluster_nodes,
                                               len(resources) or 1, RECONCILE_BUDGET_SHARE)
        self._pacing = Pacing(monotonic, cluster_nodes=config.cluster_nodes)
        self._observer = observer if observer is not None and observer.reads else None  # (checks)
        self._check_spread_s = max(3 * REASSERT_SPREAD_S, config.cluster_nodes / CHECKS_PER_S)
        if observer is not None:
            observer.on_start(self.clusterd_started)
        self._bucket = TokenBucket(REQUESTS_PER_S, REQUEST_BURST, monotonic)
        self._wakeup = asyncio.Event()
        self.tasks = Tasks("clusterd-sink")
        self._channel: grpc.aio.Channel | None = None  # open while in use (see _connection)
        self._stub = None
        self._last_call = 0.0  # monotonic: when the last call ended
        self._batch_uncertain = False  # a try of the batch being sent failed: it may have been applied
        self._answered = False  # ClusterD answered a call on the current channel
        self._left_resource = ""  # the resource a previous run sent under, when it was another
        self._view = ClusterdView()  # what ClusterD holds, as far as it acknowledged
        self._cursor: int | None = None  # acknowledged up to here (saved, or waiting to be saved)
        self._save_at: float | None = None  # monotonic time of the next attempt to save the cursor
        self._reassert_at = 0.0  # monotonic
        self._reassert_why = "start"
        self._follow_up = True  # a request of the previous run may land after the first re-assertion
        self._failed_call = False  # since the last success: a request that failed may still land
        self._first_run = True
        self._in_flight: asyncio.Future | None = None
        self._maybe_sent = 0  # changes up to here may have been sent by a previous run that died
        self._cursor_writes = WriteRetry("ClusterD sink's cursor")
        self.writes = (self._cursor_writes,)  # (agent.model.Sink)
        self.counters: Counter[str] = Counter()  # requests by result
        self.reconciles: Counter[str] = Counter()  # re-assertions that sent something, by reason
        self.checks: Counter[str] = Counter(dict.fromkeys(("in_step", "differed", "unknown"), 0))  # see _reassert
        self.unsent = 0  # occurrences over before they could be sent (clusterd_batch.plan)
        self.last_success = 0.0
        self._accepted_at = -SAVE_LAG_S  # monotonic: when ClusterD last accepted a request
        self._postponed = False  # the re-assertion due was put off once for SAVE_LAG_S

    # ---- component ----------------------------------------------------------------------------

    async def start(self) -> None:
        self.tasks.start("delivery", self._run)

    async def stop(self) -> None:
        # A clean stop leaves no request in flight (the next start relies on it): let the one on its
        # way finish, within its deadline, before the tasks go.
        if self._in_flight is not None and not self._in_flight.done():
            await asyncio.wait([self._in_flight], timeout=CALL_DEADLINE_S)
            if self._in_flight.done() and not self._in_flight.cancelled():
                self._in_flight.exception()  # its outcome is the next run's business (it resends)
        await self.tasks.stop()
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = None

    def readiness(self) -> tuple[bool, str]:
        # Delivery lag (ClusterD down) shows in npu_agent_outbox_pending; this is about the agent itself.
        return not self._cursor_writes.problem, self._cursor_writes.problem

    def notify(self, changes: list[Change]) -> None:
        """The fault log has new changes (called on the loop after each durable append)."""
        self._wakeup.set()

    @property
    def pending(self) -> int:
        if self._cursor is None:
            return self._log.pending(SINK)
        return self._log.revision - self._cursor

    @property
    def held(self) -> int:
        return len(self._view.held)

    def _connection(self) -> grpc.aio.Channel:
        """The channel to ClusterD, opened (with its watch) when a request needs it."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self._config.address, options=CHANNEL_OPTIONS)
            self._stub = pb_grpc.PubFaultStub(self._channel)
            self.tasks.start("connection-watch", lambda channel=self._channel: self._watch_channel(channel))
            self._answered = False
        return self._channel

    def _holding(self) -> bool:
        return self._hold and bool(self._view.held)

    async def _disconnect_when_idle(self) -> float | None:
        """Close the connection once idle (this sink closes it, so its watch sees no loss); the seconds
        until that is due, None when there is no connection to close."""
        if self._channel is None or self._holding():
            return None
        left = self._last_call + self._config.idle_disconnect_seconds - self._now()
        if left > 0 or (self._in_flight is not None and not self._in_flight.done()):
            return max(left, 1.0)
        await self._disconnect()
        return None

    async def _disconnect(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await self.tasks.cancel("connection-watch")
            await channel.close(grace=None)

    async def _watch_channel(self, channel: grpc.aio.Channel) -> None:
        """A connection to ClusterD that drops may be ClusterD restarting: re-assert when it is back.

        Only while the sink keeps the channel open: from a request until `idle_disconnect_seconds`
        after the last one (what ClusterD may lose in a restart that keeps its saved cache is what
        it was told in the last seconds), or, on a small cluster, while ClusterD should hold faults
        of this node, so that a restart that lost them all is noticed at once."""
        state = channel.get_state()
        while True:
            await channel.wait_for_state_change(state)
            new = channel.get_state()
            # It left READY, even if it is READY again by now: on a busy node a restarted ClusterD
            # can be reconnected to before this loop runs, and is empty all the same.
            if state is grpc.ChannelConnectivity.READY:
                self._reassert_soon("connection lost")
            if new is grpc.ChannelConnectivity.IDLE and self._holding():
                new = channel.get_state(try_to_connect=True)
            state = new

    def clusterd_started(self) -> None:
        """A new ClusterD process serves (`observe`): check what it saved, and again once it surely
        reloaded that (the follow-up: a recover it handled before its reload is undone by it)."""
        self._reassert_soon("clusterd restarted", spread=self._check_spread_s)

    def _reassert_soon(self, why: str, spread: float = REASSERT_SPREAD_S) -> None:
        at = self._now() + random.uniform(0, spread)
        if at < self._reassert_at:
            self._reassert_at, self._reassert_why = at, why
        self._follow_up = True
        self._wakeup.set()

    # ---- delivery -----------------------------------------------------------------------------

    async def _run(self) -> None:
        if self._cursor is None:
            self._restore()
        if self._first_run:
            self._first_run = False
            await self._let_previous_requests_land()
        if self._left_resource:
            await self._leave_resource()
        if self._cursor is None:
            while not self._devices_known():  # resynchronise to the devices' state now, not the log's
                await asyncio.sleep(0.05)
            await self._resync("no usable cursor in this fault log epoch")
        while True:
            self._wakeup.clear()
            more = await self._deliver_once()
            if self._now() >= self._reassert_at:
                await self._reassert()
            if self._save_at is not None and self._now() >= self._save_at:
                await self._save()
            if more:
                continue
            idle = await self._disconnect_when_idle()
            waits = [self._reassert_at - self._now(), *([self._save_at - self._now()] if self._save_at else []),
                     *([idle] if idle is not None else [])]
            try:
                await asyncio.wait_for(self._wakeup.wait(), max(0.0, min(waits)))
            except TimeoutError:
                pass

    def _restore(self) -> None:
        saved = self._log.sink_state(SINK)
        self._cursor = self._log.cursor(SINK)
        if isinstance(saved, dict) and isinstance(saved.get("resource"), str) and saved["resource"] != self._resource:
            self._left_resource = saved["resource"]
        try:
            if saved is not None:
                self._view = ClusterdView.from_dict(saved)
            else:  # no view saved: whatever the cursor says, start from a resync
                self._view, self._cursor = ClusterdView(), None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.error("the clusterd sink's saved view is malformed; starting without it (faults ClusterD holds "
                      "from before may stay there)", extra={"error": str(exc)})
            self._view, self._cursor = ClusterdView(), None
        if not self._log.previous_clean:
            self._maybe_sent = self._log.revision
        if self._view.resyncing:
            self._cursor = None  # the previous run died in the middle of a resync: do it again
        if saved is None and self._cursor is None:
            self._follow_up = False  # no previous run of this sink: nothing of it can still be in flight
        log.info("clusterd sink starting", extra={
            "address": self._config.address, "resource": self._config.resource, "cursor": self._cursor,
            "pending": self.pending, "held": len(self._view.held), "recently_recovered": len(self._view.recovered)})

    async def _deliver_once(self) -> bool:
        """Send the next batch; True when more is pending."""
        changes = self._log.changes_after(self._cursor)
        if changes is None:  # cannot happen: compaction keeps what the saved cursor still needs
            await self._resync("the cursor fell behind the fault log")
            return False
        if not changes:
            return False
        step = plan(self._view.held, self._cursor, changes, self._wanted, self._maybe_sent)

        def build() -> list[Transition]:
            # Planned again at each try while ClusterD applied none of them (refused for its rate, or
            # not sent yet): a change logged while the node waited its turn (a severe fault after a
            # mild one) goes with this request rather than a whole wait after it. Once a try failed
            # it is sent as planned, however long ClusterD is away: it may have been applied (a
            # connection that broke mid-call), so an occur in it is never left out later.
            nonlocal step
            if not self._batch_uncertain:
                step = plan(self._view.held, self._cursor, self._log.changes_after(self._cursor) or changes,
                            self._wanted, self._maybe_sent)
            return step.transitions

        if step.transitions:
            await self._send(build)
        if step.unsent:
            self.unsent += step.unsent
            log.info("fault occurrences that began and ended before they could be sent; not sent", extra={
                "occurrences": step.unsent})
        await self._acknowledged(step.transitions, step.held, step.last_revision)
        return self._log.revision > self._cursor

    async def _resync(self, why: str) -> None:
        revision = self._log.revision
        items, target = resync(self._view.held, self._wanted_now())
        log.info("clusterd sink resynchronising ClusterD from the current state", extra={
            "reason": why, "revision": revision, "held": len(self._view.held), "now": len(target)})
        self._view = ClusterdView({**self._view.held, **target}, self._view.recovered, resyncing=True)
        self._cursor = revision
        await self._save()  # first: what may be held once these requests went out
        for chunk in requests(items):
            await self._send(lambda chunk=chunk: current(chunk, self._wanted_now()))  # see _reassert
        if items:
            self.reconciles["resync"] += 1
        await self._acknowledged(items, target, revision)
        if self._reassert_why == "start" and self._observer is not None:
            # What ClusterD holds for this node beyond what it was just told: keys of a run whose
            # state_dir was lost. Checked soon, and only the difference sent.
            self._reassert_at = self._now() + random.uniform(0, self._check_spread_s)
        elif self._reassert_why == "start":
            self._next_reassertion()  # the resync was the start's re-assertion

    async def _acknowledged(self, sent: list[Transition], held: dict[str, PublicFault], revision: int) -> None:
        self._view = self._view.acknowledged(sent, held, int(self._clock() * 1000))
        self._cursor = revision
        await self._save()

    async def _leave_resource(self) -> None:
        """The node sends under another resource than its previous run (`resources` changed): ClusterD
        keys a fault by resource, so the faults held under the old one are recovered there, and the
        resync that follows raises the current ones under the new one."""
        old, held = self._left_resource, list(self._view.held.values())
        log.info("clusterd resource changed; recovering this node's faults under the old one", extra={
            "old": old, "new": self._resource, "held": len(held)})
        for chunk in requests([("recover", f) for f in held]):
            await self._send(lambda chunk=chunk: chunk, resource=old)
        # (saved by the resync, which starts with a save: a run that dies before leaves again)
        self._view, self._cursor, self._left_resource = ClusterdView(), None, ""

    async def _save(self) -> None:
        try:
            await self._log.commit_async(SINK, self._cursor, {**self._view.to_dict(), "resource": self._resource})
        except OSError as exc:
            self._save_at = self._now() + self._cursor_writes.failed(exc, revision=self._cursor)
            return
        self._save_at = None
        self._cursor_writes.succeeded()

    def _next_reassertion(self) -> None:
        self._postponed = False
        if self._follow_up:
            self._follow_up, self._reassert_why = False, "follow-up"
            self._reassert_at = self._now() + FOLLOW_UP_S + random.uniform(0, self._check_spread_s)
        else:
            self._reassert_why = "periodic"
            self._reassert_at = self._now() + self._reconcile_s * random.uniform(0.9, 1.1)

    async def _reassert(self) -> None:
        why = self._reassert_why
        checked = self._observer is not None
        lag = self._accepted_at + SAVE_LAG_S - self._now()
        if checked and lag > 0 and not self._postponed:
            # What ClusterD was just told is not in its ConfigMap yet: read it once it is (once only:
            # a node whose requests keep coming is not kept from its check).
            self._reassert_at, self._postponed = self._now() + lag, True
            return
        self._next_reassertion()
        # A node with nothing held or recently recovered has nothing to re-assert, but the check at
        # start and the periodic one also find keys ClusterD holds for it that it does not know (a
        # previous run's whose state_dir was lost).
        everyone = why in ("start", "periodic") and checked
        if not everyone and not current(reassertion(self._view), self._wanted_now()):
            return
        wanted: Callable[[ClusterdView], list[Transition]] = reassertion
        if checked:
            saved = await self._observer.saved(self._node, self._resource)
            if isinstance(saved, str) or not saved.exists:
                # Unknown (the observer logs why), or no ConfigMap at all: everything, recent recovers too.
                self.checks["unknown" if isinstance(saved, str) else "differed"] += 1
                if not current(reassertion(self._view), self._wanted_now()):
                    return
            elif not self._differences(self._view, saved.faults):
                self.checks["in_step"] += 1
                return
            else:
                self.checks["differed"] += 1
                wanted = lambda view, saved=saved.faults: self._differences(view, saved)  # noqa: E731
        log.info("re-asserting public faults to clusterd", extra={
            "reason": why, "held": len(self._view.held), "recently_recovered": len(self._view.recovered),
            **({"only_differences": True} if wanted is not reassertion else {})})
        done: set[tuple[str, str]] = set()

        def build() -> list[Transition]:
            # At each try, from the devices' state then: it may wait out a whole ClusterD outage, while
            # the changes logged meanwhile wait behind it.
            items = current(wanted(self._view), self._wanted_now())
            return [t for t in items if (t[0], t[1].fault_id) not in done][:MAX_FAULTS_PER_REQUEST]

        while sent := await self._send(build):
            done.update((assertion, fault.fault_id) for assertion, fault in sent)
        self.reconciles[why] += 1

    def _differences(self, view: ClusterdView, saved: dict[str, PublicFault]) -> list[Transition]:
        """`differences`, as of the devices' state now: no occur of a fault gone since, and no recover of
        one a device still has (the view lags the log while a backlog is being delivered)."""
        wanted = self._wanted_now()
        faulty = {fid for faults in wanted.values() for fid in faults}
        return [(assertion, f) for assertion, f in current(differences(view, saved), wanted)
                if assertion == "occur" or f.fault_id not in faulty]

    def _wanted_now(self) -> dict[int, dict[str, PublicFault]]:
        """Each device's public faults as of its last logged change (which may be newer than the view)."""
        return {phy: self._wanted(change) for phy, change in self._log.latest().items()}

    async def _let_previous_requests_land(self) -> None:
        """A previous run that died (not a clean stop) may have left a request in flight, and ClusterD
        applies a request whatever the client's deadline: wait until that deadline has passed, so the
        stale request cannot land after (and undo) this run's first one."""
        if self._log.previous_clean or (self._log.sink_state(SINK) is None and self._cursor is None):
            return
        log.info("holding the first request until the previous run's last one has expired",
                 extra={"seconds": CALL_DEADLINE_S + 0.5})
        await asyncio.sleep(CALL_DEADLINE_S + 0.5)

    def _wanted(self, change: Change) -> dict[str, PublicFault]:
        return public_faults(self._node, change.state, self._config.public_codes)

    async def _send(self, build: Callable[[], list[Transition]], resource: str | None = None) -> list[Transition]:
        """What `build` returns, until ClusterD answered 0 (or refused the request as invalid: a bug,
        logged). `build` is called before each try, so a batch that can go stale while ClusterD is
        away is made again from the state then (`_batch_uncertain`: a try failed, and may have been
        applied). Returns the last batch built (sent, or not sendable), empty when there was nothing
        to send. `resource`: another than this node's (a resource it used before)."""
        codes = frozenset(self._config.public_codes.values())
        reported: set[tuple[str, str]] = set()
        attempt = 0
        self._batch_uncertain = False
        if not self._hold and self._channel is None:  # a connection to open: see Pacing.opening
            await asyncio.sleep(self._pacing.opening())
        while True:
            batch = build()
            faults = []
            for assertion, fault in batch:
                message = to_message(self._node, assertion, fault, self._pods_of(fault.device))
                # (a recover carries the code it was raised with, which the configuration may no longer list)
                problems = fault_problems(message, codes if assertion == "occur" else None)
                if problems:
                    if (assertion, fault.fault_id) not in reported:  # once, not at every try
                        reported.add((assertion, fault.fault_id))
                        self.counters["invalid"] += 1
                        log.error("public fault fails ClusterD's rules; not sent", extra={
                            "fault": MessageToDict(message), "problems": problems})
                    continue
                faults.append(message)
            if not faults:
                return batch
            delay = self._bucket.wait_time()
            if delay:
                await asyncio.sleep(delay)
                continue  # built again: the wait may have made it stale
            self._bucket.take()
            now_ms = int(self._clock() * 1000)
            request = pb.PublicFaultRequest(id=str(uuid.uuid4()), timestamp=now_ms, version="1.0",
                                            resource=resource or self._resource, faults=faults)
            problems = request_problems(request)
            # Only the node's clock can make it invalid (before 2025): wait for it rather than lose the request.
            outcome = "invalid" if problems else await self._call(request)
            if problems:
                self.counters["invalid"] += 1
                self._log_transition("request fails ClusterD's rules (the node's clock?); retrying", code="invalid",
                                     details="; ".join(problems))
            if outcome == "sent":
                self._pacing.delivered()
                self.last_success, self._accepted_at = self._clock(), self._now()
                if self._failed_call:  # what failed may land late, or ClusterD may have restarted meanwhile
                    self._failed_call = False
                    self._reassert_soon("after failed requests")
                return batch
            if outcome == "rejected":
                return batch
            if outcome == "refused":  # ClusterD's budget is spent: wait for the cluster's turn (see pacing)
                if not self._holding():  # nothing was applied: no restart can lose it; free the connection
                    await self._disconnect()
                await asyncio.sleep(self._pacing.refused())
                continue
            self._batch_uncertain = True
            attempt += 1
            backoff = random.uniform(0.5, doubling(attempt, BACKOFF_FIRST_S, BACKOFF_MAX_S))
            if outcome == "failed" and not self._holding() and self._channel is not None and \
                    self._channel.get_state() is not grpc.ChannelConnectivity.READY:
                # No connection (ClusterD away, or its listener full and resetting new ones): a channel
                # left to reconnect by itself would knock every few hundred ms, from every node at once.
                # One that had answered was lost (ClusterD restarting?), and its watch goes with it.
                if self._answered:
                    self._reassert_soon("connection lost")
                await self._disconnect()
                await asyncio.sleep(backoff)
                continue
            if outcome == "failed":
                if self._connection().get_state() is not grpc.ChannelConnectivity.READY:
                    await self._sleep_until_connected(backoff)
                    continue
            await asyncio.sleep(backoff)

    async def _sleep_until_connected(self, seconds: float) -> None:
        """Back off, but retry as soon as the channel connects again: ClusterD is back."""
        channel = self._connection()

        async def connected() -> None:
            state = channel.get_state(try_to_connect=True)
            while state is not grpc.ChannelConnectivity.READY:
                await channel.wait_for_state_change(state)
                state = channel.get_state(try_to_connect=True)
        try:
            await asyncio.wait_for(connected(), seconds)
        except TimeoutError:
            pass

    async def _call(self, request: pb.PublicFaultRequest) -> str:
        self._connection()
        self._in_flight = asyncio.ensure_future(self._stub.SendPublicFault(request, timeout=CALL_DEADLINE_S))
        try:
            reply = await asyncio.shield(self._in_flight)  # stop() waits for it rather than cancelling it
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNKNOWN and "qps exceeded" in (exc.details() or ""):
                # ClusterD's limit on all unary calls (1,000/s for everybody): refused before anything
                # was applied, like a 410
                self.counters["rate_limited"] += 1
                self._log_transition("clusterd refused the request; retrying", code="qps exceeded",
                                     details=exc.details())
                return "refused"
            self.counters["unavailable"] += 1
            self._log_transition("clusterd unreachable; retrying", code=exc.code().name, details=exc.details())
            # A request that reached ClusterD and got no answer may still be applied, later than what
            # follows it. (A refused connection applied nothing; a connection that broke mid-call is
            # noticed by the connection watch.)
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN):
                self._failed_call = True
            return "failed"
        finally:
            self._last_call = self._now()
        self._answered = True
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
        return "refused"

    _last_problem = ""

    def _log_transition(self, message: str, **fields) -> None:
        """Log when delivery starts failing (or fails differently) and when it works again, not every retry."""
        key = f"{message} {fields.get('code', '')}"
        if key == self._last_problem:
            return
        if message:
            log.warning(message, extra={**fields, "pending": self.pending})
        elif self._last_problem:
            log.info("clusterd reachable again")
        self._last_problem = key if message else ""
