"""A TaskD manager's net layer (role Mgr, level 3): the top of the TaskNet tree.

Re-implemented from ``/work/shared/reference/taskd.md`` §3.3-3.7, server side only (the Mgr has no
upstream).  What it keeps is what TaskD's downstream endpoint keeps:

* ``entries``: one per registered position; holds that client's down stream once it is open.
  Re-registering a position cancels the old entry (which ends its stream) and starts a new one.
* ``routes``: ``routeTable[p] = proxyPos`` for every ``p`` of every PathDiscovery; never pruned.

Messages addressed to the Mgr are reported on stdout and acked; nothing is routed onward, because
the Mgr has no upstream and this fake only sends downward when told to by a command.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from agent._proto import tasknet_pb2 as pb
from agent._proto import tasknet_pb2_grpc as pb_grpc

from .wire import (ACK_TIMEOUT_S, EXCEED_MAX_REGISTRY_NUM, MAX_REGISTRATIONS, MGR, NET_STREAM_NOT_INITED,
                   NETWORK_ACK_LOST, NETWORK_SEND_LOST, NO_ROUTE, OK, SERVER_ERR, TASKD_CODE_KEY, Emitter, Pos,
                   build_message, is_broadcast, log, message_event, pos_json, ranks_match, start_command_reader)

# Like TaskD's server (§3.2): 8 MiB each way, keepalive 5 s with a 1 s timeout; and, like the
# ClusterD stand-in, no SO_REUSEPORT, so a second server cannot silently share the port.
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    ("grpc.max_send_message_length", 8 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 5_000),
    ("grpc.keepalive_timeout_ms", 1_000),
    ("grpc.so_reuseport", 0),
]

# Sent as soon as a down stream is accepted, so a client can tell "accepted" from "not yet
# refused" without waiting (TaskD itself sends no early headers; this is harmless to clients).
ACCEPTED_METADATA = (("tasknet-stream", "accepted"),)


@dataclass(eq=False)
class DownStream:
    """One open InitServerDownStream call, as seen by the server."""
    context: grpc.aio.ServicerContext
    acks: asyncio.Queue = field(default_factory=asyncio.Queue)
    alive: bool = True


@dataclass(eq=False)
class Entry:
    """TaskD's entryMap value: a registered position and (later) its stream."""
    pos: Pos
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # set when re-registered away
    stream: DownStream | None = None
    # TaskD holds one per-entry mutex across send and ack wait, so sync sends through one
    # next hop are serialized (§3.6); so do we.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Manager(pb_grpc.TaskNetServicer):
    def __init__(self, emit: Emitter):
        self.pos = MGR
        self.emit = emit
        self.entries: dict[Pos, Entry] = {}
        self.routes: dict[Pos, Pos] = {}
        # Knobs for tests of the proxy's upward path ({"op":"config"}): the code the Mgr answers
        # TransferMessage with, and a delay before answering.
        self.transfer_code = OK
        self.transfer_delay = 0.0

    # ---- RPCs -----------------------------------------------------------------------------------

    async def Register(self, request: pb.RegisterReq, context) -> pb.Ack:
        pos = Pos.of_pb(request.pos)
        old = self.entries.pop(pos, None)
        if old is not None:
            old.closed.set()  # ends the old stream, like cancelling the old entry's context
        elif len(self.entries) >= MAX_REGISTRATIONS:
            return pb.Ack(uuid=request.uuid, code=EXCEED_MAX_REGISTRY_NUM, src=self.pos.pb())
        self.entries[pos] = Entry(pos)
        self.emit(event="registered", pos=pos.json(), replaced=old is not None)
        return pb.Ack(uuid=request.uuid, code=OK, src=self.pos.pb())

    async def PathDiscovery(self, request: pb.PathDiscoveryReq, context) -> pb.Ack:
        proxy = Pos.of_pb(request.proxyPos)
        path = [Pos.of_pb(p) for p in request.path]
        for p in path:
            self.routes[p] = proxy  # "reach p through this child"
        self.emit(event="path", proxy_pos=proxy.json(), path=[p.json() for p in path])
        return pb.Ack(uuid=request.uuid, code=OK, src=self.pos.pb())

    async def TransferMessage(self, request: pb.Message, context) -> pb.Ack:
        dst = Pos.of_pb(request.header.dst)
        if not self._is_self(dst):
            self.emit(event="transfer_refused", uuid=request.header.uuid, dst=dst.json(), code=NO_ROUTE)
            await context.abort(grpc.StatusCode.UNKNOWN, f"manager does not route to {dst}",
                                trailing_metadata=((TASKD_CODE_KEY, str(NO_ROUTE)),))
        self.emit(**message_event(request))
        if self.transfer_delay > 0:
            await asyncio.sleep(self.transfer_delay)  # simulated slowness, not synchronisation
        return pb.Ack(uuid=request.header.uuid, code=self.transfer_code, src=self.pos.pb())

    async def InitServerDownStream(self, request_iterator, context) -> None:
        md = {m.key: m.value for m in context.invocation_metadata() or ()}
        pos = Pos(md.get("role", ""), md.get("serverrank", ""), md.get("processrank", ""))
        entry = self.entries.get(pos)
        if entry is None:
            self.emit(event="stream_refused", pos=pos.json())
            await context.abort(grpc.StatusCode.UNKNOWN, "un registry error")
        stream = DownStream(context)
        entry.stream = stream
        await context.send_initial_metadata(ACCEPTED_METADATA)
        self.emit(event="stream", pos=pos.json())
        reader = asyncio.create_task(self._read_acks(request_iterator, entry, stream))
        replaced = asyncio.create_task(entry.closed.wait())
        try:
            await asyncio.wait({reader, replaced}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also reached when the client cancels and grpc cancels this handler
            reader.cancel()
            replaced.cancel()
            stream.alive = False  # the entry keeps the dead stream: sends to it fail with 6000
            self.emit(event="stream_closed", pos=pos.json())

    async def _read_acks(self, request_iterator, entry: Entry, stream: DownStream) -> None:
        try:
            async for ack in request_iterator:
                self.emit(event="ack", pos=entry.pos.json(), uuid=ack.uuid, code=ack.code,
                          src=pos_json(ack.src) if ack.HasField("src") else None)
                stream.acks.put_nowait(ack)
        except Exception as exc:  # the client went away
            log.info("stream of %s ended: %r", entry.pos, exc)

    def _is_self(self, dst: Pos) -> bool:
        # DstCase "self": the same level with matching (or All) ranks; the Mgr's processRank is -1.
        return dst.role == self.pos.role and ranks_match(dst.server_rank, self.pos.server_rank)

    # ---- commands -------------------------------------------------------------------------------

    async def send(self, cmd: dict) -> None:
        uuid = str(cmd.get("uuid", ""))
        result = {"code": OK, "ack_src": None, "error": None}
        try:
            dst = Pos.of_json(cmd["dst"])
            if dst.role != "Worker":
                dst = dst._replace(process_rank="-1")  # TaskD normalises non-Worker destinations
            cmd = {**cmd, "dst": dst.json()}
            if is_broadcast(dst):
                result.update(await self._broadcast(cmd, dst))
            else:
                result.update(await self._unicast(cmd, dst))
        except Exception as exc:
            log.exception("send %s failed", uuid)
            result.update(code=SERVER_ERR, error=repr(exc))
        self.emit(event="sent", uuid=uuid, **result)

    async def _unicast(self, cmd: dict, dst: Pos) -> dict:
        hop = self.routes.get(dst)
        if hop is None:
            return {"code": NO_ROUTE, "error": f"no route to {dst}"}
        entry = self.entries.get(hop)
        if entry is None:
            return {"code": NO_ROUTE, "error": f"next hop {hop} is not registered"}
        return await self._send_to(entry, build_message(cmd, self.pos), wait_ack=bool(cmd.get("sync")))

    async def _broadcast(self, cmd: dict, dst: Pos) -> dict:
        hops: list[Pos] = []
        for target, hop in list(self.routes.items()):
            if (target.role == dst.role and ranks_match(dst.server_rank, target.server_rank)
                    and ranks_match(dst.process_rank, target.process_rank) and hop not in hops):
                hops.append(hop)
        msg = build_message(cmd, self.pos, sync=False)  # broadcast is never sync

        async def one(hop: Pos) -> dict:
            entry = self.entries.get(hop)
            if entry is None:
                return {"code": NO_ROUTE, "error": f"next hop {hop} is not registered"}
            return await self._send_to(entry, msg, wait_ack=False)

        results = await asyncio.gather(*(one(h) for h in hops))
        failed = [{"hop": h.json(), **r} for h, r in zip(hops, results) if r["code"] != OK]
        # Like TaskD, the broadcast itself reports OK; the per-hop outcome is extra detail.
        return {"code": OK, "hops": [h.json() for h in hops], "failed": failed}

    async def _send_to(self, entry: Entry, msg: pb.Message, wait_ack: bool) -> dict:
        async with entry.lock:
            stream = entry.stream
            if stream is None:
                return {"code": NET_STREAM_NOT_INITED, "error": f"{entry.pos} has no stream"}
            if not stream.alive:
                return {"code": NETWORK_SEND_LOST, "error": f"stream of {entry.pos} is closed"}
            try:
                await stream.context.write(msg)
            except Exception as exc:
                return {"code": NETWORK_SEND_LOST, "error": repr(exc)}
            if not wait_ack:
                return {"code": OK}
            uuid = msg.header.uuid
            loop = asyncio.get_running_loop()
            deadline = loop.time() + ACK_TIMEOUT_S
            while True:
                try:
                    ack = await asyncio.wait_for(stream.acks.get(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    return {"code": NETWORK_ACK_LOST, "error": f"no ack for {uuid} within {ACK_TIMEOUT_S}s"}
                # TaskD takes any ack; we match the uuid and drop late acks of earlier messages.
                if ack.uuid == uuid:
                    return {"code": ack.code, "ack_src": pos_json(ack.src) if ack.HasField("src") else None}
                log.warning("dropping ack %s while waiting for %s", ack.uuid, uuid)

    def route_list(self) -> list:
        return [[dst.json(), hop.json()] for dst, hop in self.routes.items()]

    def entry_list(self) -> list:
        return [{"pos": e.pos.json(), "stream": None if e.stream is None else ("open" if e.stream.alive else "closed")}
                for e in self.entries.values()]


async def run(listen: str) -> int:
    emit = Emitter()
    manager = Manager(emit)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_TaskNetServicer_to_server(manager, server)
    log.info("manager binding %s", listen)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as exc:
        emit(event="error", error=f"cannot listen on {listen}: {exc}")
        return 2
    await server.start()
    log.info("manager listening on port %s", port)
    emit(event="ready", port=port)

    commands = start_command_reader(asyncio.get_running_loop())
    in_flight: set[asyncio.Task] = set()
    while (cmd := await commands.get()) is not None:
        op = cmd.get("op")
        if op == "quit":
            break
        if op == "send":
            task = asyncio.create_task(manager.send(cmd))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        elif op == "routes":
            emit(event="routes", routes=manager.route_list())
        elif op == "entries":
            emit(event="entries", entries=manager.entry_list())
        elif op == "config":
            manager.transfer_code = int(cmd.get("transfer_code", manager.transfer_code))
            manager.transfer_delay = float(cmd.get("transfer_delay", manager.transfer_delay))
            emit(event="configured")
        else:
            emit(event="error", error=f"unknown op {op!r}")
    await server.stop(0)
    return 0
