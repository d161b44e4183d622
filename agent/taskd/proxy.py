"""The node-level TaskD proxy: TaskNet (`reference/taskd.md` §3) for every training process on the
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
from collections import Counter
from dataclasses import dataclass, field

import grpc

from agent._proto import tasknet_pb2 as pb
from agent._proto import tasknet_pb2_grpc as pb_grpc
from agent.taskd.peers import Peer, PeerRefused, PeerResolver
from agent.taskd.routes import (Code, Invalid, Position, RouteTable, checked_destination, checked_own_position,
                                is_group)
from agent.taskd.upstream import MAX_MESSAGE, ManagerLink, NotDelivered

log = logging.getLogger(__name__)

ACK_TIMEOUT_S = 3.0  # TaskD's AckTimeout for a sync message sent down
DOWN_QUEUE = 256  # messages waiting for one worker's stream
MAX_REGISTRATIONS = 5000  # per job (TaskD: per proxy)
IDLE_JOB_S = 60.0  # a job with no connected process and nothing held is dropped after this
JANITOR_S = 5.0
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 5_000),  # TaskD's server keepalive: 5 s, 1 s timeout
    ("grpc.keepalive_timeout_ms", 1_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_concurrent_streams", 64),  # per connection: a flooding process waits, others do not
]


@dataclass(eq=False)
class Downstream:
    """A connected worker's InitServerDownStream: messages queued for it, sync acks awaited."""
    pos: Position
    pid: int
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(DOWN_QUEUE))
    acks: dict[str, asyncio.Future] = field(default_factory=dict)
    closed: bool = False

    def close(self) -> None:
        self.closed = True
        for future in self.acks.values():
            if not future.done():
                future.set_result(None)
        try:
            self.queue.put_nowait(None)
        except asyncio.QueueFull:
            self.queue.get_nowait()
            self.queue.put_nowait(None)


@dataclass(eq=False)
class Job:
    name: str
    manager: str
    routes: RouteTable
    link: ManagerLink
    registered: set[Position] = field(default_factory=set)
    downstreams: dict[Position, Downstream] = field(default_factory=dict)
    idle_since: float | None = None

    @property
    def me(self) -> Position:
        return self.routes.me


class TaskdProxy(pb_grpc.TaskNetServicer):
    name = "taskd_proxy"

    def __init__(self, listen: str, manager_port: int, *, dial_timeout_s: float = 5.0, hold_s: float = 60.0,
                 queue_limit: int = 1024, resolver: PeerResolver | None = None, clock=time.monotonic):
        self._listen = listen
        self._manager_port = manager_port
        self._link_options = dict(dial_timeout_s=dial_timeout_s, hold_s=hold_s, queue_limit=queue_limit)
        self._resolver = resolver or PeerResolver()
        self._clock = clock
        self.jobs: dict[str, Job] = {}
        self.messages: Counter[tuple[str, str]] = Counter()  # (direction, result)
        self.refused: Counter[str] = Counter()
        self._logged: set[tuple] = set()
        self._server: grpc.aio.Server | None = None
        self._janitor: asyncio.Task | None = None
        self.port = 0

    # --- component ---------------------------------------------------------------------------

    async def start(self) -> None:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_TaskNetServicer_to_server(self, server)
        self.port = server.add_insecure_port(self._listen)
        if self.port == 0:
            raise OSError(f"taskd_proxy.listen {self._listen}: cannot bind (is a TaskD proxy of a hostNetwork "
                          "training pod already listening there?)")
        await server.start()
        self._server = server
        self._janitor = asyncio.create_task(self._sweep(), name="taskd-proxy-janitor")
        log.info("TaskD proxy listening", extra={"address": self._listen.rsplit(":", 1)[0] + f":{self.port}",
                                                 "manager_port": self._manager_port})

    async def stop(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()
        for job in list(self.jobs.values()):
            for downstream in job.downstreams.values():
                downstream.close()
            await job.link.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)

    def readiness(self) -> tuple[bool, str]:
        return (self._server is not None, "" if self._server is not None else "not listening")

    # --- TaskNet -------------------------------------------------------------------------------

    async def Register(self, request: pb.RegisterReq, context) -> pb.Ack:
        try:
            pos = checked_own_position(Position.of(request.pos))
        except Invalid as exc:
            await _fail(context, exc.code, f"register: {exc}")
        job, peer = await self._job_of(context, pos.server_rank)
        old = job.downstreams.get(pos)
        if old is not None:  # TaskD: registering again ends the position's old stream
            old.close()
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

    async def TransferMessage(self, request: pb.Message, context) -> pb.Ack:
        try:
            dst = checked_destination(request)
        except Invalid as exc:
            self.messages["up", "invalid"] += 1
            await _fail(context, exc.code, f"message {request.header.uuid}: {exc}")
        job, _ = await self._job_of(context, request.header.src.serverRank)
        request.header.dst.CopyFrom(dst.pb())
        decision = job.routes.decide(dst, from_upper=False)
        if decision.action == "up":
            try:
                ack = await job.link.send(request)
            except NotDelivered as exc:
                self.messages["up", "not_delivered"] += 1
                await _fail(context, exc.code, f"message {request.header.uuid} not delivered: {exc}")
            except grpc.aio.AioRpcError as exc:  # the manager's own answer, passed on as it is
                self.messages["up", "refused"] += 1
                await context.abort(exc.code(), exc.details(), exc.trailing_metadata() or ())
            self.messages["up", "delivered"] += 1
            return ack
        ack = await self._route_down(job, request, dst, decision, "local")
        if ack.code != Code.OK and ack.src == job.me.pb():
            await _fail(context, Code(ack.code), f"message {request.header.uuid} to {dst}: not delivered")
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
        downstream = Downstream(pos, peer.pid)
        job.downstreams[pos] = downstream
        await context.send_initial_metadata((("tasknet-stream", "accepted"),))  # lets the worker know now
        job.idle_since = None
        reader = asyncio.create_task(self._read_acks(downstream, request_iterator))
        try:
            while True:
                message = await downstream.queue.get()
                if message is None:
                    break
                yield message
        finally:
            reader.cancel()
            downstream.close()
            if job.downstreams.get(pos) is downstream:
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

    async def _from_manager(self, job: Job, message: pb.Message) -> pb.Ack:
        uid = message.header.uuid
        try:
            dst = checked_destination(message)
        except Invalid as exc:
            self.messages["down", "invalid"] += 1
            return pb.Ack(uuid=uid, code=exc.code, src=job.me.pb())
        message.header.dst.CopyFrom(dst.pb())
        return await self._route_down(job, message, dst, job.routes.decide(dst, from_upper=True), "down")

    async def _route_down(self, job: Job, message: pb.Message, dst: Position, decision, direction: str) -> pb.Ack:
        uid = message.header.uuid
        if decision.action == "self":
            self.messages[direction, "delivered"] += 1
            return pb.Ack(uuid=uid, code=Code.OK, src=job.me.pb())
        if decision.action == "reject":
            self.messages[direction, "no_route"] += 1
            return pb.Ack(uuid=uid, code=decision.code, src=job.me.pb())
        if is_group(dst):
            message.header.sync = False  # TaskD: broadcasts are never synchronous
            codes = [self._push(job, hop, message) for hop in decision.hops]
            failed = [c for c in codes if c != Code.OK]
            self.messages[direction, "delivered"] += len(codes) - len(failed)
            self.messages[direction, "not_delivered"] += len(failed)
            return pb.Ack(uuid=uid, code=failed[0] if failed else Code.OK, src=job.me.pb())
        hop = decision.hops[0]
        code = self._push(job, hop, message)
        if code != Code.OK or not message.header.sync:
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

    def _push(self, job: Job, hop: Position, message: pb.Message) -> Code:
        downstream = job.downstreams.get(hop)
        if downstream is None or downstream.closed:
            return Code.NET_STREAM_NOT_INITED if hop in job.registered else Code.NO_ROUTE
        try:
            downstream.queue.put_nowait(message)
        except asyncio.QueueFull:
            return Code.RECV_BUF_BUSY
        return Code.OK

    # --- which job -----------------------------------------------------------------------------

    async def _job_of(self, context, server_rank: str) -> tuple[Job, Peer]:
        text = context.peer()
        peer = self._resolver.cached(text)
        if peer is None:
            try:
                peer = await asyncio.to_thread(self._resolver.resolve, text)
            except PeerRefused as exc:
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
        link.start()
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
            now = self._clock()
            for job in list(self.jobs.values()):
                if job.downstreams or job.link.held or job.idle_since is None or now - job.idle_since < IDLE_JOB_S:
                    continue
                del self.jobs[job.name]
                await job.link.close()
                log.info("TaskD job gone from this node; manager link closed", extra={"job": job.name})
            self._resolver.forget_closed()


async def _fail(context, code: Code, reason: str):
    await context.abort(grpc.StatusCode.UNKNOWN, f"{reason} (TaskD code {int(code)} {code.name})",
                        (("taskd-code", str(int(code))),))
