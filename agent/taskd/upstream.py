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
from agent.taskd.routes import Code, Position
from agent.lifecycle import Tasks

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 5.0
ACK_WRITE_TIMEOUT_S = 10.0  # TaskD's receiver gives up on an ack after 10 s
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
        self._kicked = False
        self._down_reason = ""
        self._tasks: Tasks | None = None
        self._deliveries: set[asyncio.Task] = set()
        self._write_lock = asyncio.Lock()

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

    async def _flush(self, transfer) -> None:
        """Held messages go first and in order; messages sent meanwhile queue up behind them."""
        while self.held:
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

    def _lost(self, why: str) -> None:
        """A send saw the manager gone: drop the stream so the link reconnects and flushes."""
        if self.connected:
            self.connected = False
            self._down_reason = why
            self._kicked = True
            if self._call is not None:
                self._call.cancel()

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        was_up = True  # so the first failure is logged
        while True:
            channel = grpc.aio.insecure_channel(self.address, options=CLIENT_OPTIONS)
            try:
                await self._join(channel)
                log.info("connected to the TaskD manager", extra={
                    "job": self.job, "manager": self.address, "proxy_position": str(self.me),
                    "workers_announced": len(self.known), "held_delivered": self.counters.held_delivered})
                was_up, backoff = True, BACKOFF_MIN_S
                await self._listen()
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, LinkDown) as exc:
                reason = self._down_reason or _describe(exc)
                if was_up:
                    log.warning("TaskD manager unreachable; holding messages for it", extra={
                        "job": self.job, "manager": self.address, "reason": reason, "held": len(self.held),
                        "retry_every_s": BACKOFF_MAX_S})
                was_up = False
            finally:
                self.connected = False
                self._stub = self._call = self._transfer = None
                self._kicked, self._down_reason = False, ""
                await channel.close(grace=None)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _join(self, channel: grpc.aio.Channel) -> None:
        await asyncio.wait_for(channel.channel_ready(), self._dial_timeout_s)
        stub = pb_grpc.TaskNetStub(channel)
        ack = await stub.Register(pb.RegisterReq(uuid=str(uuid.uuid4()), pos=self.me.pb()),
                                  timeout=self._rpc_timeout_s)
        if ack.code != Code.OK:
            raise LinkDown(f"the manager refused the registration with code {ack.code}")
        self._announced = set()  # a new manager, or a restarted one, knows nobody
        await self._announce_known(stub)
        me = self.me
        # Messages in both directions stay in their wire form (frames.py): the link parses none.
        transfer = channel.unary_unary("/TaskNet/TransferMessage", request_serializer=None,
                                       response_deserializer=pb.Ack.FromString)
        down = channel.stream_stream("/TaskNet/InitServerDownStream", request_serializer=pb.Ack.SerializeToString,
                                     response_deserializer=None)
        self._call = down(metadata=(("role", me.role), ("serverrank", me.server_rank),
                                    ("processrank", me.process_rank)))
        await self._flush(transfer)
        self._stub, self._transfer = stub, transfer
        self.connected = True
        # Workers that joined while the stream opened and the held messages went out.
        await self._announce_known(stub)
        self.counters.connects += 1

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
            if self._kicked and not asyncio.current_task().cancelling():  # by _lost, not by close()
                raise LinkDown(self._down_reason) from None
            raise

    async def _deliver(self, call, raw: bytes) -> None:
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
