"""One job's link to its TaskD manager: register as the job's proxy, announce its workers, carry
messages up, take the manager's messages down, and hold messages while the manager is away.

What TaskD's proxy lacks and this adds: a dial timeout with backoff,
a bounded queue that keeps messages in order while the manager is unreachable (each caller waits
for the manager's ack, or is told "not delivered" when the queue is full or its deadline passes),
and, after every reconnect, a path discovery for every worker still connected, so a restarted
manager can reach them without waiting for the workers to notice.

A worker's path discovery is answered at once and never lost: the position joins `known`, and every
connection announces each known position exactly until the manager has acknowledged it — whether
it arrived before the link, while the link was being set up, or after.

Nothing goes up before the way down is open. TaskD's manager installs this proxy's down stream only
when its handler for the stream gets to run, and says nothing when it has (no headers, no message);
until then whatever it sends to the proxy fails with 6002 "stream not inited" and is gone — the
answer to a REGISTER flushed a moment too early, for one. So once the stream is opened, the link
sends a sync message addressed to itself: the manager routes it down that very stream (answering
"stream not inited" while it holds none, retried with backoff for up to STREAM_OPEN_S) and the
link's own ack coming back proves the stream works. Only then do held messages go out, and new
ones after them.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable

import grpc

from agent._proto import tasknet_pb2 as pb
from agent._proto import tasknet_pb2_grpc as pb_grpc
from agent.taskd.frames import Frame, Malformed
from agent.taskd.routes import Code, Position
from agent.lifecycle import Tasks

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 5.0
ACK_WRITE_TIMEOUT_S = 10.0  # TaskD's receiver gives up on an ack after 10 s
STREAM_OPEN_S = 10.0  # how long a manager may take to install this proxy's down stream; then reconnect
STREAM_RETRY_MIN_S = 0.02  # between checks of the down stream: a manager's handler is usually quick
STREAM_RETRY_MAX_S = 0.5
MAX_MESSAGE = 8 << 20  # TaskD's send and receive limit
CLIENT_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    # A Go gRPC server (TaskD's manager) sends GOAWAY to clients that ping more often than every
    # 5 min; it pings us every 5 s itself, and a dead manager's stream fails on read.
    ("grpc.keepalive_time_ms", 300_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]


class NotDelivered(Exception):
    def __init__(self, code: Code, reason: str):
        super().__init__(reason)
        self.code = code


class LinkDown(Exception):
    pass


@dataclass(eq=False)
class Held:
    message: bytes  # on the wire, as it goes to the manager
    future: asyncio.Future
    sending: bool = False


@dataclass
class LinkCounters:
    connects: int = 0  # links established (registration and path replay done)
    held_delivered: int = 0  # messages delivered after waiting for the manager


class ManagerLink:
    def __init__(self, job: str, address: str, me: Position, *,
                 on_message: Callable[[bytes], Awaitable[pb.Ack | None]],
                 dial_timeout_s: float = 5.0, hold_s: float = 60.0, queue_limit: int = 1024,
                 rpc_timeout_s: float = 30.0):
        self.job = job
        self.address = address
        self.me = me
        self.connected = False
        self.held: deque[Held] = deque()
        self.known: dict[Position, None] = {}  # level-1 positions below, announced on every connection
        self._announced: set[Position] = set()  # those the current connection's manager acknowledged
        self.counters = LinkCounters()
        self._on_message = on_message
        self._dial_timeout_s = dial_timeout_s
        self._hold_s = hold_s
        self._limit = queue_limit
        self._rpc_timeout_s = rpc_timeout_s
        self._stub: pb_grpc.TaskNetStub | None = None
        self._transfer = None  # TransferMessage on the current channel, taking the message's wire bytes
        self._call = None
        self._down_reason = ""
        self._tasks: Tasks | None = None
        self._deliveries: set[asyncio.Task] = set()
        self._write_lock = asyncio.Lock()
        self._listener: asyncio.Task | None = None  # reads the current down stream
        self._checks: set[str] = set()  # uuids of this link's own down-stream checks in flight

    # --- used by the proxy -------------------------------------------------------------------

    def start(self, tasks: Tasks) -> None:
        """Run the link under its proxy's supervision (a bug restarts it, and shows on /readyz)."""
        self._tasks = tasks
        tasks.start(f"manager/{self.job}", self._run)

    async def close(self) -> None:
        if self._tasks is not None:
            await self._tasks.cancel(f"manager/{self.job}")
        for task in list(self._deliveries):
            task.cancel()
        while self.held:
            entry = self.held.popleft()
            if not entry.future.done():
                entry.future.set_exception(NotDelivered(Code.SERVER_ERR, "the node proxy is stopping"))

    async def send(self, message: bytes) -> pb.Ack:
        """Deliver a message (its wire bytes) to the manager: the manager's ack; raises
        grpc.aio.AioRpcError (the manager's own error) or NotDelivered."""
        if self.connected and not self.held:
            try:
                return await self._transfer(message, timeout=self._rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self._lost(f"send failed: {exc.details()}")
        return await self._hold(message)

    async def announce(self, request: pb.PathDiscoveryReq, positions: list[Position]) -> None:
        """Forward a worker's path discovery; when the manager is away it is replayed on reconnect."""
        for pos in positions:
            self.known[pos] = None
        if not self.connected:
            return  # the join in progress, or the next one, announces it
        announced = self._announced  # this connection's: a reconnect meanwhile starts a new set
        try:
            await self._stub.PathDiscovery(self._discovery(request.uuid, positions), timeout=self._rpc_timeout_s)
            announced.update(positions)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._lost(f"path discovery failed: {exc.details()}")
            else:
                raise

    def forget(self, positions: list[Position]) -> None:
        for pos in positions:
            self.known.pop(pos, None)

    # --- holding -------------------------------------------------------------------------------

    async def _hold(self, message: bytes) -> pb.Ack:
        if len(self.held) >= self._limit:
            raise NotDelivered(Code.RECV_BUF_BUSY, f"{len(self.held)} messages already wait for the manager "
                                                   f"{self.address} of job {self.job}")
        entry = Held(message, asyncio.get_running_loop().create_future())
        self.held.append(entry)
        try:
            return await asyncio.wait_for(asyncio.shield(entry.future), self._hold_s)
        except asyncio.TimeoutError:
            if entry.sending:  # on the wire right now: its outcome is the answer
                return await entry.future
            self._drop(entry)
            raise NotDelivered(Code.NETWORK_SEND_LOST, f"the manager {self.address} of job {self.job} was "
                                                       f"unreachable for {self._hold_s:g} s") from None
        except asyncio.CancelledError:
            if not entry.sending:
                self._drop(entry)
            raise

    def _drop(self, entry: Held) -> None:
        try:
            self.held.remove(entry)
        except ValueError:
            pass

    async def _flush(self, stub: pb_grpc.TaskNetStub, transfer) -> None:
        """Held messages go first and in order; messages sent meanwhile queue up behind them. Returns
        with nothing held and every known position announced."""
        while True:
            self._check_way_down()  # a manager's answer to any of them needs the stream
            # A worker's path before its messages: the manager answers along it.
            await self._announce_known(stub)
            if not self.held:
                return
            entry = self.held[0]
            entry.sending = True
            try:
                ack = await transfer(entry.message, timeout=self._rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                entry.sending = False
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    raise
                outcome: object = exc
            else:
                outcome = ack
                self.counters.held_delivered += 1
            if self.held and self.held[0] is entry:
                self.held.popleft()
            if not entry.future.done():
                if isinstance(outcome, BaseException):
                    entry.future.set_exception(outcome)
                else:
                    entry.future.set_result(outcome)

    # --- the connection ------------------------------------------------------------------------

    def _discovery(self, uid: str, positions: list[Position]) -> pb.PathDiscoveryReq:
        # What TaskD's proxy forwards: itself as the next hop and appended to the path.
        return pb.PathDiscoveryReq(uuid=uid, proxyPos=self.me.pb(), path=[p.pb() for p in positions] + [self.me.pb()])

    async def _announce_known(self, stub: pb_grpc.TaskNetStub) -> None:
        """Announce every known position this connection's manager has not acknowledged yet,
        including those that arrive while this runs."""
        while pending := [pos for pos in self.known if pos not in self._announced]:
            for pos in pending:
                await stub.PathDiscovery(self._discovery(str(uuid.uuid4()), [pos]), timeout=self._rpc_timeout_s)
                self._announced.add(pos)

    def _check_message(self, uid: str) -> bytes:
        # To this proxy itself: the manager can deliver it only down this proxy's stream.
        header = pb.MessageHeader(uuid=uid, mtype="default", sync=True, src=self.me.pb(), dst=self.me.pb())
        return pb.Message(header=header).SerializeToString()

    async def _confirm_way_down(self, stub: pb_grpc.TaskNetStub, transfer) -> int:
        """Return once the manager has installed this proxy's down stream (how many checks it took);
        LinkDown when it has not within STREAM_OPEN_S."""
        if not self._announced:  # the manager routes to this proxy only once a path has named it
            await stub.PathDiscovery(self._discovery(str(uuid.uuid4()), []), timeout=self._rpc_timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STREAM_OPEN_S
        delay, checks = STREAM_RETRY_MIN_S, 0
        while True:
            checks += 1
            uid = str(uuid.uuid4())
            self._checks.add(uid)
            try:
                ack = await transfer(self._check_message(uid), timeout=max(0.5, deadline - loop.time()))
                if ack.code == Code.OK:
                    return checks
                why = f"answered code {ack.code}"
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    raise
                why = _describe(exc)  # "stream not inited" (6002) while the manager has none yet
            finally:
                self._checks.discard(uid)
            self._check_way_down()
            if loop.time() + delay > deadline:
                raise LinkDown(f"the manager did not open its stream to this proxy within {STREAM_OPEN_S:g} s "
                               f"({checks} checks, the last {why})")
            await asyncio.sleep(delay)  # backoff between checks
            delay = min(delay * 2, STREAM_RETRY_MAX_S)

    def _check_way_down(self) -> None:
        """LinkDown (or the stream's own error) if the down stream has ended."""
        listener = self._listener
        if listener is not None and listener.done():
            if listener.cancelled():
                raise LinkDown("the stream from the manager was cancelled")
            listener.result()  # raises why it ended
            raise LinkDown("the manager closed the stream")

    def _lost(self, why: str) -> None:
        """A send saw the manager gone: drop the stream so the link reconnects and flushes."""
        if self.connected:
            self.connected = False
            self._down_reason = why
            if self._call is not None:
                self._call.cancel()

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        was_up = True  # so the first failure is logged
        while True:
            channel = grpc.aio.insecure_channel(self.address, options=CLIENT_OPTIONS)
            try:
                checks = await self._join(channel)
                log.info("connected to the TaskD manager", extra={
                    "job": self.job, "manager": self.address, "proxy_position": str(self.me),
                    "workers_announced": len(self.known), "held_delivered": self.counters.held_delivered,
                    "stream_checks": checks})
                was_up, backoff = True, BACKOFF_MIN_S
                await self._listener
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, LinkDown) as exc:
                reason = self._down_reason or _describe(exc)
                if was_up:
                    log.warning("TaskD manager unreachable; holding messages for it", extra={
                        "job": self.job, "manager": self.address, "reason": reason, "held": len(self.held),
                        "retry_every_s": BACKOFF_MAX_S})
                was_up = False
            finally:
                self.connected = False
                await self._stop_listener()
                self._stub = self._call = self._transfer = None
                self._down_reason = ""
                self._checks.clear()
                await channel.close(grace=None)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _join(self, channel: grpc.aio.Channel) -> int:
        """Register, announce, open the down stream and see it work, flush; the checks it took."""
        await asyncio.wait_for(channel.channel_ready(), self._dial_timeout_s)
        stub = pb_grpc.TaskNetStub(channel)
        ack = await stub.Register(pb.RegisterReq(uuid=str(uuid.uuid4()), pos=self.me.pb()),
                                  timeout=self._rpc_timeout_s)
        if ack.code != Code.OK:
            raise LinkDown(f"the manager refused the registration with code {ack.code}")
        self._announced = set()  # a new manager, or a restarted one, knows nobody
        await self._announce_known(stub)
        me = self.me
        # Messages in both directions stay in their wire form (frames.py): the link parses none but
        # its own checks' headers, and only while a check is out.
        transfer = channel.unary_unary("/TaskNet/TransferMessage", request_serializer=None,
                                       response_deserializer=pb.Ack.FromString)
        down = channel.stream_stream("/TaskNet/InitServerDownStream", request_serializer=pb.Ack.SerializeToString,
                                     response_deserializer=None)
        self._call = down(metadata=(("role", me.role), ("serverrank", me.server_rank),
                                    ("processrank", me.process_rank)))
        # Per connection, awaited by _run (a bug in it surfaces there). It reads from now on: the
        # check below comes back on the stream, and so do the manager's answers to the flush.
        self._listener = asyncio.create_task(self._listen(), name=f"manager/{self.job}/stream")
        checks = await self._confirm_way_down(stub, transfer)
        await self._flush(stub, transfer)
        # No await from the flush's last look to here: nothing can slip in unannounced or unsent.
        self._stub, self._transfer = stub, transfer
        self.connected = True
        self.counters.connects += 1
        return checks

    async def _stop_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        listener.cancel()
        await asyncio.wait({listener})
        if not listener.cancelled():
            listener.exception()  # retrieved: why it ended was already reported, or is moot now

    async def _listen(self) -> None:
        call = self._call
        try:
            while True:
                raw = await call.read()
                if raw is grpc.aio.EOF:
                    raise LinkDown("the manager closed the stream")
                task = asyncio.create_task(self._deliver(call, raw))
                self._deliveries.add(task)
                task.add_done_callback(self._deliveries.discard)
        except asyncio.CancelledError:
            if not asyncio.current_task().cancelling():  # the call, by _lost; not this task, by _run
                raise LinkDown(self._down_reason or "the stream from the manager was cancelled") from None
            raise
        finally:
            self.connected = False  # the way down is closed: nothing more goes up directly

    def _check_ack(self, raw: bytes) -> pb.Ack | None:
        """The ack of this link's own down-stream check; None for any other message."""
        if not self._checks:
            return None
        try:
            uid = Frame(raw).uuid
        except Malformed:
            return None
        return pb.Ack(uuid=uid, code=Code.OK, src=self.me.pb()) if uid in self._checks else None

    async def _deliver(self, call, raw: bytes) -> None:
        ack = self._check_ack(raw)
        if ack is None:
            ack = await self._on_message(raw)  # the ack of a sync message, None otherwise
        if ack is None:
            return
        try:
            async with self._write_lock:
                await asyncio.wait_for(call.write(ack), ACK_WRITE_TIMEOUT_S)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            log.debug("ack to the manager not written", extra={"job": self.job, "error": _describe(exc)})


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer in time (dial timeout)"
    return str(exc)
