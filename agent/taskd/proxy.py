"""The node-level TaskD proxy: TaskD's TaskNet for every training process on the
node, one manager link per job.

Workers do not say which job they belong to, and the same position ("Worker 0 3") exists in every
job, so each call is attributed to a job by its connection (`peers.py`) and routed only within that
job's table (`routes.py`); a message never reaches another job's manager or workers.

Errors are answered the way TaskD's proxy answers them (a gRPC error, status UNKNOWN), with the TaskD
code in the details and in the trailing metadata key `taskd-code`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import grpc

from agent._proto import tasknet_pb2 as pb
from agent.common.executor import CallTimeout, Lane
from agent.common.grpcutil import EXCLUSIVE, bind
from agent.taskd.budget import ByteBudget
from agent.taskd.frames import Frame, Malformed
from agent.taskd.peers import Peer, PeerRefused, PeerResolver
from agent.taskd.routes import (Code, Invalid, Position, RouteTable, checked_destination, checked_own_position,
                                is_broadcast)
from agent.taskd.upstream import MAX_MESSAGE, ManagerLink, NotDelivered
from agent.lifecycle import Tasks

log = logging.getLogger(__name__)

ACK_TIMEOUT_S = 3.0  # TaskD's AckTimeout for a sync message sent down
DOWN_QUEUE = 256  # messages waiting for one worker's stream
MAX_REGISTRATIONS = 5000  # per job (TaskD: per proxy)
IDLE_JOB_S = 60.0  # a job with no connected process and nothing held is dropped after this
JANITOR_S = 5.0
BROADCAST_MEMORY_S = 5.0  # copies of one broadcast (same uuid) within this time are one message
BROADCAST_MEMORY = 4096  # uuids remembered per job
OVERFLOW_LOG_S = 60.0
RESOLVE_TIMEOUT_S = 5.0  # telling which job a connecting process belongs to (/proc walks); refused after
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 5_000),  # TaskD's server keepalive: 5 s, 1 s timeout
    ("grpc.keepalive_timeout_ms", 1_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_concurrent_streams", 64),  # per connection: a flooding process waits, others do not
    *EXCLUSIVE,
]


@dataclass(eq=False)
class Downstream:
    """A connected worker's InitServerDownStream: messages queued for it, sync acks awaited.

    Queued messages count against the job's byte budget until they are handed to gRPC."""
    pos: Position
    pid: int
    job: str
    budget: ByteBudget
    queue: deque = field(default_factory=deque)  # wire bytes of the messages, in order
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    acks: dict[str, asyncio.Future] = field(default_factory=dict)
    closed: bool = False

    def put(self, data: bytes) -> str:
        """"" when queued; otherwise why not (TaskD's RecvBufBusy for the caller)."""
        if len(self.queue) >= DOWN_QUEUE:
            return f"{DOWN_QUEUE} messages already wait for the stream of {self.pos}"
        why = self.budget.take(self.job, len(data))
        if not why:
            self.queue.append(data)
            self.wake.set()
        return why

    async def next(self) -> bytes | None:
        """The next message to send down, or None once closed."""
        while not self.queue:
            if self.closed:
                return None
            self.wake.clear()
            await self.wake.wait()
        data = self.queue.popleft()
        self.budget.give(self.job, len(data))
        return data

    def close(self) -> None:
        self.closed = True
        for future in self.acks.values():
            if not future.done():
                future.set_result(None)
        while self.queue:
            self.budget.give(self.job, len(self.queue.popleft()))
        self.wake.set()


@dataclass(eq=False)
class Job:
    name: str
    manager: str
    routes: RouteTable
    link: ManagerLink
    registered: set[Position] = field(default_factory=set)
    downstreams: dict[Position, Downstream] = field(default_factory=dict)
    broadcasts: OrderedDict = field(default_factory=OrderedDict)  # uuid -> when first seen
    idle_since: float | None = None

    @property
    def me(self) -> Position:
        return self.routes.me


class TaskdProxy:
    name = "taskd_proxy"

    def __init__(self, listen: str, manager_port: int, *, peers: Lane, dial_timeout_s: float = 5.0,
                 hold_s: float = 60.0, queue_limit: int = 1024, job_bytes: int = 32 << 20, node_bytes: int = 64 << 20,
                 resolver: PeerResolver | None = None, clock=time.monotonic):
        self._listen = listen
        self._manager_port = manager_port
        self._link_options = dict(dial_timeout_s=dial_timeout_s, hold_s=hold_s, queue_limit=queue_limit)
        self.budget = ByteBudget(job_bytes, node_bytes)
        self.overflows: Counter[str] = Counter()  # job -> messages refused for want of room
        self._overflow_logged: dict[str, float] = {}
        self._resolver = resolver or PeerResolver()
        self._peers = peers  # the executor's lane for the /proc walks that identify a connecting process
        self._clock = clock
        self.jobs: dict[str, Job] = {}
        self.messages: Counter[tuple[str, str]] = Counter()  # (direction, result)
        self.refused: Counter[str] = Counter()
        self._logged: set[tuple] = set()
        self._server: grpc.aio.Server | None = None
        self.tasks = Tasks("taskd-proxy")
        self.port = 0

    # --- component ---------------------------------------------------------------------------

    async def start(self) -> None:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers((self._handlers(),))
        self.port = bind(server, self._listen, "taskd_proxy.listen",
                         " (is a TaskD proxy of a hostNetwork training pod already listening there?)")
        await server.start()
        self._server = server
        self.tasks.start("janitor", self._sweep)
        log.info("TaskD proxy listening", extra={"address": self._listen.rsplit(":", 1)[0] + f":{self.port}",
                                                 "manager_port": self._manager_port})

    async def stop(self) -> None:
        await self.tasks.stop(timeout=1.0)
        for job in list(self.jobs.values()):
            for downstream in job.downstreams.values():
                downstream.close()
            await job.link.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)

    def _handlers(self) -> grpc.GenericRpcHandler:
        # TaskNet's methods, with messages kept in their wire form (frames.py) in both directions.
        ack = pb.Ack.SerializeToString
        return grpc.method_handlers_generic_handler("TaskNet", {
            "Register": grpc.unary_unary_rpc_method_handler(
                self.Register, request_deserializer=pb.RegisterReq.FromString, response_serializer=ack),
            "PathDiscovery": grpc.unary_unary_rpc_method_handler(
                self.PathDiscovery, request_deserializer=pb.PathDiscoveryReq.FromString, response_serializer=ack),
            "TransferMessage": grpc.unary_unary_rpc_method_handler(
                self.TransferMessage, request_deserializer=None, response_serializer=ack),
            "InitServerDownStream": grpc.stream_stream_rpc_method_handler(
                self.InitServerDownStream, request_deserializer=pb.Ack.FromString, response_serializer=None),
        })

    def readiness(self) -> tuple[bool, str]:
        return (self._server is not None, "" if self._server is not None else "not listening")

    # --- TaskNet -------------------------------------------------------------------------------

    async def Register(self, request: pb.RegisterReq, context) -> pb.Ack:
        try:
            pos = checked_own_position(Position.of(request.pos))
        except Invalid as exc:
            await _fail(context, exc.code, f"register: {exc}")
        job, peer = await self._job_of(context, pos.server_rank)
        old = job.downstreams.pop(pos, None)
        if old is not None:  # TaskD: registering again ends the position's old stream
            old.close()  # out of the table first, so its ending cannot undo this join's routes
            if not job.downstreams and job.idle_since is None:
                job.idle_since = self._clock()  # idle until the new stream opens
        if pos not in job.registered and len(job.registered) >= MAX_REGISTRATIONS:
            await _fail(context, Code.EXCEED_MAX_REGISTRY_NUM, f"job {job.name} has {MAX_REGISTRATIONS} registrations")
        if pos not in job.registered:
            log.info("TaskD process registered", extra={"job": job.name, "position": str(pos), "pid": peer.pid})
        job.registered.add(pos)
        return pb.Ack(uuid=request.uuid, code=Code.OK, src=job.me.pb())

    async def PathDiscovery(self, request: pb.PathDiscoveryReq, context) -> pb.Ack:
        try:
            path = [checked_own_position(Position.of(p)) for p in request.path]
            if not path or not request.HasField("proxyPos"):
                raise Invalid(Code.NIL_POSITION, "path discovery without a path or a proxy position")
        except Invalid as exc:
            await _fail(context, exc.code, f"path discovery: {exc}")
        job, _ = await self._job_of(context, path[0].server_rank)
        job.routes.learn(Position.of(request.proxyPos), path)
        try:
            await job.link.announce(request, path)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details(), exc.trailing_metadata() or ())
        return pb.Ack(uuid=request.uuid, code=Code.OK, src=job.me.pb())

    async def TransferMessage(self, raw: bytes, context) -> pb.Ack:
        try:
            frame = Frame(raw)
            dst = checked_destination(frame.header)
        except Malformed as exc:
            self.messages["up", "invalid"] += 1
            await _fail(context, Code.NIL_MESSAGE, f"message does not parse: {exc}")
        except Invalid as exc:
            self.messages["up", "invalid"] += 1
            await _fail(context, exc.code, f"message {frame.uuid}: {exc}")
        header = frame.header
        job, _ = await self._job_of(context, header.src.serverRank)
        header.dst.CopyFrom(dst.pb())
        decision = job.routes.decide(dst, from_upper=False)
        if decision.action != "up":
            ack = await self._route_down(job, frame, dst, decision, "local")
            if ack.code != Code.OK and ack.src == job.me.pb():
                await _fail(context, Code(ack.code), f"message {header.uuid} to {dst}: not delivered")
            return ack
        data = frame.wire()
        why = self.budget.take(job.name, len(data))  # held until the manager answered
        if why:
            self._overflow(job, "up", why)
            reason = f"message {header.uuid} not taken: {why}"
            raw = frame = data = None  # noqa: F841 - the abort's traceback must not keep megabytes alive
            await _fail(context, Code.RECV_BUF_BUSY, reason)
        try:
            ack = await job.link.send(data)
        except NotDelivered as exc:
            self.messages["up", "not_delivered"] += 1
            if exc.code == Code.RECV_BUF_BUSY:
                self._overflow(job, "up", str(exc))
            await _fail(context, exc.code, f"message {header.uuid} not delivered: {exc}")
        except grpc.aio.AioRpcError as exc:  # the manager's own answer, passed on as it is
            self.messages["up", "refused"] += 1
            await context.abort(exc.code(), exc.details(), exc.trailing_metadata() or ())
        finally:
            self.budget.give(job.name, len(data))
        self.messages["up", "delivered"] += 1
        return ack

    async def InitServerDownStream(self, request_iterator, context):
        metadata = {key: value for key, value in context.invocation_metadata()}
        pos = Position(metadata.get("role", ""), metadata.get("serverrank", ""), metadata.get("processrank", ""))
        job, peer = await self._job_of(context, pos.server_rank)
        if pos not in job.registered:
            await context.abort(grpc.StatusCode.UNKNOWN, "un registry error")  # TaskD's words
        old = job.downstreams.get(pos)
        if old is not None:
            old.close()
        downstream = Downstream(pos, peer.pid, job.name, self.budget)
        job.downstreams[pos] = downstream
        await context.send_initial_metadata((("tasknet-stream", "accepted"),))  # lets the worker know now
        job.idle_since = None
        reader = asyncio.create_task(self._read_acks(downstream, request_iterator))
        try:
            while (message := await downstream.next()) is not None:
                yield message
        finally:
            reader.cancel()
            downstream.close()
            if job.downstreams.get(pos) is downstream:  # not already replaced by a new join
                del job.downstreams[pos]
                gone = job.routes.forget(pos)
                job.link.forget(gone + [pos])
                if not job.downstreams:
                    job.idle_since = self._clock()
                log.info("TaskD process disconnected; its routes removed", extra={
                    "job": job.name, "position": str(pos), "pid": downstream.pid, "routes_removed": len(gone)})

    async def _read_acks(self, downstream: Downstream, acks) -> None:
        try:
            async for ack in acks:
                future = downstream.acks.pop(ack.uuid, None)  # matched by uuid, unlike TaskD
                if future is not None and not future.done():
                    future.set_result(ack)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            downstream.close()  # the worker closed its side or went away

    # --- routing -------------------------------------------------------------------------------

    async def _from_manager(self, job: Job, raw: bytes) -> pb.Ack | None:
        """Route a message the manager sent down: the ack to write back on its stream, for a sync
        message; None otherwise (TaskD answers only those)."""
        try:
            frame = Frame(raw)
        except Malformed as exc:
            self.messages["down", "invalid"] += 1
            if ("malformed", job.name) not in self._logged:
                self._logged.add(("malformed", job.name))
                log.warning("message from the TaskD manager does not parse; dropped (logged once per job)",
                            extra={"job": job.name, "error": str(exc), "bytes": len(raw)})
            return None
        ack = await self._route_from_manager(job, frame)
        return ack if frame.header is not None and frame.header.sync else None  # a broadcast is async by now

    async def _route_from_manager(self, job: Job, frame: Frame) -> pb.Ack | None:
        uid = frame.uuid
        try:
            dst = checked_destination(frame.header)
        except Invalid as exc:
            self.messages["down", "invalid"] += 1
            return pb.Ack(uuid=uid, code=exc.code, src=job.me.pb())
        if is_broadcast(dst) and self._seen_broadcast(job, uid):
            # TaskD's manager sends a broadcast once per matching route, so N workers behind this
            # proxy bring N copies; each worker gets the message once.
            self.messages["down", "duplicate"] += 1
            return None
        frame.header.dst.CopyFrom(dst.pb())
        return await self._route_down(job, frame, dst, job.routes.decide(dst, from_upper=True), "down")

    def _seen_broadcast(self, job: Job, uid: str) -> bool:
        now, seen = self._clock(), job.broadcasts
        while seen and (len(seen) >= BROADCAST_MEMORY or now - next(iter(seen.values())) > BROADCAST_MEMORY_S):
            seen.popitem(last=False)
        if uid in seen:
            return True
        seen[uid] = now
        return False

    async def _route_down(self, job: Job, frame: Frame, dst: Position, decision, direction: str) -> pb.Ack:
        uid = frame.uuid
        if decision.action == "self":
            self.messages[direction, "delivered"] += 1
            return pb.Ack(uuid=uid, code=Code.OK, src=job.me.pb())
        if decision.action == "reject":
            self.messages[direction, "no_route"] += 1
            return pb.Ack(uuid=uid, code=decision.code, src=job.me.pb())
        if is_broadcast(dst):
            frame.header.sync = False  # TaskD: broadcasts are never synchronous
            data = frame.wire()  # one copy for every hop
            codes = [self._push(job, hop, data, direction) for hop in decision.hops]
            failed = [c for c in codes if c != Code.OK]
            self.messages[direction, "delivered"] += len(codes) - len(failed)
            self.messages[direction, "not_delivered"] += len(failed)
            return pb.Ack(uuid=uid, code=failed[0] if failed else Code.OK, src=job.me.pb())
        hop = decision.hops[0]
        code = self._push(job, hop, frame.wire(), direction)
        if code != Code.OK or not frame.header.sync:
            self.messages[direction, "delivered" if code == Code.OK else "not_delivered"] += 1
            return pb.Ack(uuid=uid, code=code, src=job.me.pb())
        downstream = job.downstreams[hop]
        future = asyncio.get_running_loop().create_future()
        downstream.acks[uid] = future
        try:
            ack = await asyncio.wait_for(future, ACK_TIMEOUT_S)
        except asyncio.TimeoutError:
            ack = None
        finally:
            downstream.acks.pop(uid, None)
        if ack is None:
            self.messages[direction, "not_delivered"] += 1
            code = Code.NETWORK_SEND_LOST if downstream.closed else Code.NETWORK_ACK_LOST
            return pb.Ack(uuid=uid, code=code, src=job.me.pb())
        self.messages[direction, "delivered"] += 1
        return ack

    def _push(self, job: Job, hop: Position, data: bytes, direction: str) -> Code:
        downstream = job.downstreams.get(hop)
        if downstream is None or downstream.closed:
            return Code.NET_STREAM_NOT_INITED if hop in job.registered else Code.NO_ROUTE
        why = downstream.put(data)
        if why:
            self._overflow(job, direction, why)
            return Code.RECV_BUF_BUSY
        return Code.OK

    def _overflow(self, job: Job, direction: str, why: str) -> None:
        self.overflows[job.name] += 1
        now = self._clock()
        last = self._overflow_logged.get(job.name)
        if last is None or now - last >= OVERFLOW_LOG_S:
            self._overflow_logged[job.name] = now
            log.warning("TaskD proxy refused a message: no room (RecvBufBusy 5001)", extra={
                "job": job.name, "direction": direction, "reason": why,
                "refused_so_far": self.overflows[job.name]})

    # --- which job -----------------------------------------------------------------------------

    async def _job_of(self, context, server_rank: str) -> tuple[Job, Peer]:
        text = context.peer()
        peer = self._resolver.cached(text)
        if peer is None:
            try:
                peer = await self._peers.run(self._resolver.resolve, text, self.port, timeout=RESOLVE_TIMEOUT_S)
            except (PeerRefused, CallTimeout) as exc:
                self._refuse(text, str(exc))
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"npu-node-agent TaskD proxy: {exc}")
        host = f"[{peer.manager_host}]" if ":" in peer.manager_host else peer.manager_host
        manager = f"{host}:{self._manager_port}"
        job = self.jobs.get(peer.job)
        if job is None:
            job = self._new_job(peer.job, manager, server_rank)
        elif job.manager != manager:
            reason = (f"pid {peer.pid} of job {peer.job} names the manager {manager}, the job's other processes "
                      f"{job.manager}")
            self._refuse(text, reason)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"npu-node-agent TaskD proxy: {reason}")
        return job, peer

    def _new_job(self, name: str, manager: str, server_rank: str) -> Job:
        rank = server_rank if server_rank.isdigit() else "0"
        # TaskD's proxy position: the node rank, and its start time as the process rank.
        me = Position("Proxy", rank, str(int(time.time())))
        link = ManagerLink(name, manager, me, on_message=lambda m: self._from_manager(job, m),
                           **self._link_options)
        job = Job(name, manager, RouteTable(me), link, idle_since=self._clock())
        self.jobs[name] = job
        link.start(self.tasks)
        log.info("TaskD job seen on this node; connecting to its manager", extra={
            "job": name, "manager": manager, "proxy_position": str(me)})
        return job

    def _refuse(self, peer: str, reason: str) -> None:
        self.refused["unidentified"] += 1
        key = (peer.rsplit(":", 1)[0], reason.split(":", 1)[0])
        if key not in self._logged and len(self._logged) < 1024:
            self._logged.add(key)
            log.warning("TaskD proxy refused a connection", extra={"peer": peer, "reason": reason})

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(JANITOR_S)
            await self._drop_idle_jobs()

    async def _drop_idle_jobs(self) -> None:
        now = self._clock()
        for job in list(self.jobs.values()):
            if job.downstreams or job.link.held or job.idle_since is None or now - job.idle_since < IDLE_JOB_S:
                continue
            del self.jobs[job.name]
            self._overflow_logged.pop(job.name, None)
            await job.link.close()
            log.info("TaskD job gone from this node; manager link closed", extra={"job": job.name})
        self._resolver.forget_closed()


async def _fail(context, code: Code, reason: str):
    await context.abort(grpc.StatusCode.UNKNOWN, f"{reason} (TaskD code {int(code)} {code.name})",
                        (("taskd-code", str(int(code))),))
