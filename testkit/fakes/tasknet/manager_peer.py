"""A TaskD manager (role Mgr, level 3): the top of the TaskNet tree, plus the slice of its business
layer that tracks workers for the profiling switch.

Re-implemented from TaskD's net layer as its code behaves, server side only (the Mgr has no upstream).
What it keeps is what TaskD's downstream endpoint keeps:

* ``entries``: one per registered position; holds that client's down stream once it is open.
  Re-registering a position cancels the old entry (which ends its stream) and starts a new one that
  still points at the old, dead stream until the new one is installed, as TaskD's entry does: sends
  in between fail with NetworkSendLost 6000.
* opening a down stream takes a moment: TaskD's handler stores the stream in the entry when it gets
  to run, and until then a send to that position answers NetStreamNotInited 6002 ("stream not
  inited"); a manager that answers at once (a REGISTER with an ACTION) loses its answer that way.
  The ``stream_delay`` knob stretches that moment (a busy manager).  The early headers this manager
  sends say the call was taken, not that the stream is installed (TaskD sends none at all), so a
  client cannot use them to know the way down is open.
* ``routes``: ``routeTable[p] = proxyPos`` for every ``p`` of every PathDiscovery (overwritten, never
  pruned, no check that anyone registered).

Sending down (the ``send`` and ``action`` commands, and messages from a direct level-1 client whose
destination is below the Mgr):

* unicast: the exact routeTable key, then that hop's entry and stream; a miss (a rank list such as
  "0,1" is never a key) is NoRoute 5002 made by the Mgr itself.  Sync sends wait up to 3 s for the
  next Ack on that stream; the Ack that comes back (code and src) is the result, whatever its code.
* broadcast (a rank containing "All"): ONE COPY PER MATCHING routeTable ENTRY, no dedup of next hops,
  so two workers behind one proxy mean two copies to that proxy.  An entry matches when its role is
  the destination's and its serverRank (for Workers also its processRank) equals the destination's
  or the destination's is "All".  Sync is forced off; the broadcast itself is always code 0.

Messages for the Mgr are acked ``{code 0, src=Mgr}`` once taken, before the business layer looks at
them (so a REGISTER or STATUS is acked 0 even when the business layer then drops it).  The business
layer here knows two body types (JSON MsgBody): REGISTER (a worker named "Worker"+src.processRank at
position src; with the ``register_reply`` knob answered at once with that ACTION, one sync unicast,
``register_reply_tries`` tries 3 s apart) and STATUS (that worker's profiling state).  The ``action``
command plays the profiling plugin: one sync unicast ACTION per registered worker, retried only on a
local failure, because TaskD's callers check only the Go error (an Ack 5001/5002 from a later hop
counts as delivered).

Nothing survives a restart: a new process starts with no entries, routes or workers.
"""

from __future__ import annotations

import asyncio
import uuid as uuidlib
from dataclasses import dataclass, field

import grpc

from agent._proto import tasknet_pb2 as pb
from agent._proto import tasknet_pb2_grpc as pb_grpc

from .wire import (ACK_TIMEOUT_S, ALL, EXCEED_MAX_REGISTRY_NUM, MAX_REGISTRATIONS, MGR, NET_STREAM_NOT_INITED,
                   NETWORK_ACK_LOST, NETWORK_SEND_LOST, NO_ROUTE, OK, SERVER_ERR, Emitter, Pos, build_message,
                   is_broadcast, level, log, message_event, msg_body, normalise_rank, parse_msg_body, pos_json,
                   ranks_match, start_command_reader)

# Like TaskD's server: 8 MiB each way, keepalive 5 s with a 1 s timeout; and, like the ClusterD
# stand-in, no SO_REUSEPORT, so a second server cannot silently share the port.
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    ("grpc.max_send_message_length", 8 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 5_000),
    ("grpc.keepalive_timeout_ms", 1_000),
    ("grpc.so_reuseport", 0),
]

# Sent as soon as a down stream is accepted, so a client can tell "accepted" from "not yet
# refused" without waiting (TaskD itself sends no early headers; this is harmless to clients).
# They come before the stream is installed: they do not mean sends to the client work yet.
ACCEPTED_METADATA = (("tasknet-stream", "accepted"),)

PROFILING_CODES = (700, 701, 710, 711)  # all off, comm on, default on, both on


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
    # next hop are serialized; so do we.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class WorkerRecord:
    """The business layer's view of one worker: where it said REGISTER from, and its last STATUS."""
    pos: Pos
    status: int | None = None


class Manager(pb_grpc.TaskNetServicer):
    def __init__(self, emit: Emitter):
        self.pos = MGR
        self.emit = emit
        self.entries: dict[Pos, Entry] = {}
        self.routes: dict[Pos, Pos] = {}
        self.workers: dict[str, WorkerRecord] = {}
        # Knobs ({"op":"config"}) for tests of the proxy: the code the Mgr answers TransferMessage
        # with, and delays before it answers TransferMessage, Register and PathDiscovery (a slow or
        # busy manager; simulated slowness, not synchronisation).
        self.transfer_code = OK
        self.transfer_delay = 0.0
        self.register_delay = 0.0
        self.path_delay = 0.0
        # How long an accepted down stream takes to be installed in its entry (TaskD: until its
        # handler runs; long on a busy manager); sends to the position meanwhile answer 6002.
        self.stream_delay = 0.0
        # The ACTION code to answer each REGISTER with at once (None: no answer), and its tries.
        self.register_reply: int | None = None
        self.register_reply_tries = 1
        self.replies: set[asyncio.Task] = set()

    # ---- RPCs -----------------------------------------------------------------------------------

    async def Register(self, request: pb.RegisterReq, context) -> pb.Ack:
        if self.register_delay > 0:
            await asyncio.sleep(self.register_delay)
        pos = Pos.of_pb(request.pos)
        old = self.entries.pop(pos, None)
        if old is not None:
            old.closed.set()  # ends the old stream, like cancelling the old entry's context
        elif len(self.entries) >= MAX_REGISTRATIONS:
            return pb.Ack(uuid=request.uuid, code=EXCEED_MAX_REGISTRY_NUM, src=self.pos.pb())
        # TaskD keeps the entry, stream included: until a new stream is installed, sends go to the
        # ending one and fail with 6000, not 6002.
        self.entries[pos] = Entry(pos, stream=old.stream if old is not None else None)
        self.emit(event="registered", pos=pos.json(), replaced=old is not None)
        return pb.Ack(uuid=request.uuid, code=OK, src=self.pos.pb())

    async def PathDiscovery(self, request: pb.PathDiscoveryReq, context) -> pb.Ack:
        if self.path_delay > 0:
            await asyncio.sleep(self.path_delay)
        proxy = Pos.of_pb(request.proxyPos)
        path = [Pos.of_pb(p) for p in request.path]
        for p in path:
            self.routes[p] = proxy  # "reach p through this child"
        self.emit(event="path", uuid=request.uuid, proxy_pos=proxy.json(), path=[p.json() for p in path])
        return pb.Ack(uuid=request.uuid, code=OK, src=self.pos.pb())

    async def TransferMessage(self, request: pb.Message, context) -> pb.Ack:
        h = request.header
        dst = Pos.of_pb(h.dst)
        if level(dst.role) < level(self.pos.role):
            return await self._route_from_below(request, dst, context)
        if not self._is_self(dst):
            # Same level, another Mgr: TaskD would send it upstream, and a Mgr has no upstream.
            self.emit(event="transfer_refused", uuid=h.uuid, dst=dst.json(), code=SERVER_ERR)
            await context.abort(grpc.StatusCode.UNKNOWN,
                                f"client not inited, role={self.pos.role}, srvRank={self.pos.server_rank}, "
                                f"processRank={self.pos.process_rank}")
        self.emit(**message_event(request))
        if self.transfer_code == OK:  # taken: the business layer sees it (after the ack, in TaskD)
            asyncio.get_running_loop().call_soon(self._handle_business, request)
        if self.transfer_delay > 0:
            await asyncio.sleep(self.transfer_delay)  # simulated slowness, not synchronisation
        return pb.Ack(uuid=h.uuid, code=self.transfer_code, src=self.pos.pb())

    async def _route_from_below(self, request: pb.Message, dst: Pos, context) -> pb.Ack:
        """A direct level-1 client's message for a position below the Mgr: routed down like TaskD does.

        A failure the Mgr makes itself is a Go error in TaskD, so the caller gets a bare UNKNOWN
        status with text and no code; an Ack from a later hop is passed back as it is.
        """
        h = request.header
        if is_broadcast(dst):
            result = await self._broadcast(request, dst)
        else:
            result = await self._unicast(request, dst, wait_ack=h.sync)
        self.emit(event="routed", uuid=h.uuid, src=pos_json(h.src), dst=dst.json(), **result)
        if result.get("ack_src") is not None:
            return pb.Ack(uuid=h.uuid, code=result["code"], src=Pos.of_json(result["ack_src"]).pb())
        if result["code"] != OK:
            await context.abort(grpc.StatusCode.UNKNOWN, result["error"] or "not delivered")
        return pb.Ack(uuid=h.uuid, code=OK, src=self.pos.pb())

    async def InitServerDownStream(self, request_iterator, context) -> None:
        md = {m.key: m.value for m in context.invocation_metadata() or ()}
        pos = Pos(md.get("role", ""), md.get("serverrank", ""), md.get("processrank", ""))
        entry = self.entries.get(pos)
        if entry is None:
            self.emit(event="stream_refused", pos=pos.json())
            await context.abort(grpc.StatusCode.UNKNOWN, "un registry error")
        stream = DownStream(context)
        await context.send_initial_metadata(ACCEPTED_METADATA)
        if self.stream_delay > 0:
            await asyncio.sleep(self.stream_delay)  # simulated slowness, not synchronisation
            entry = self.entries.get(pos, entry)  # TaskD installs it in the position's entry of now
        entry.stream = stream
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
        return level(dst.role) == level(self.pos.role) and ranks_match(dst.server_rank, self.pos.server_rank)

    # ---- business layer (workers and the profiling switch) --------------------------------------

    def _handle_business(self, msg: pb.Message) -> None:
        body = parse_msg_body(msg.body)
        if body is None:
            return  # TaskD logs an unmarshal error and drops the message
        src = Pos.of_pb(msg.header.src)
        name = "Worker" + src.process_rank
        if body["msg_type"] == "REGISTER":
            self.workers[name] = WorkerRecord(src)  # a re-REGISTER overwrites and clears the status
            self.emit(event="worker_registered", name=name, pos=src.json())
            if self.register_reply is not None:
                task = asyncio.create_task(self._send_action(name, self.register_reply, self.register_reply_tries,
                                                             3.0, reply_to=msg.header.uuid))
                self.replies.add(task)
                task.add_done_callback(self.replies.discard)
        elif body["msg_type"] == "STATUS":
            record = self.workers.get(name)
            if record is None:  # TaskD: "worker name is unregistered", after having acked 0
                self.emit(event="status_dropped", name=name, code=body["code"])
            else:
                record.status = body["code"]
                self.emit(event="status", name=name, code=body["code"])

    async def action(self, cmd: dict) -> None:
        """Send ACTION `code` to every registered worker, each on its own task, like the profiling plugin."""
        code = int(cmd["code"])
        tries = max(1, int(cmd.get("tries", 1)))
        interval = float(cmd.get("retry_interval", 3.0))
        names = sorted(self.workers)
        await asyncio.gather(*(self._send_action(n, code, tries, interval) for n in names))
        self.emit(event="action_done", code=code, workers=names)

    async def _send_action(self, name: str, code: int, tries: int, interval: float, **extra) -> None:
        """One worker's ACTION: a sync unicast to where it said REGISTER from, retried on a local failure."""
        target = self.workers[name].pos
        body = msg_body("ACTION", code)
        used = []
        for attempt in range(1, tries + 1):
            uuid = str(uuidlib.uuid4())  # a fresh message per try, as each send builds a new frame
            used.append(uuid)
            msg = build_message({"uuid": uuid, "dst": target.json(), "mtype": "default", "body": body},
                                self.pos, sync=True)
            result = await self._unicast(msg, target, wait_ack=True)
            # Only a Go error is a failure; an Ack (whatever its code) came from a later hop.
            failed = result["code"] != OK and result.get("ack_src") is None
            if not failed or attempt == tries:
                break
            await asyncio.sleep(interval)  # the caller's retry policy, not synchronisation
        self.emit(event="action_sent", name=name, uuid=uuid, uuids=used, code=result["code"],
                  ack_src=result.get("ack_src"), error=result.get("error"), tries=attempt, **extra)

    def worker_map(self) -> dict:
        return {name: {"pos": r.pos.json(), "status": r.status} for name, r in sorted(self.workers.items())}

    # ---- sending down ---------------------------------------------------------------------------

    async def send(self, cmd: dict) -> None:
        uuid = str(cmd.get("uuid", ""))
        result = {"code": OK, "ack_src": None, "error": None}
        try:
            dst = Pos.of_json(cmd["dst"])
            # What TaskD does to a destination before sending: "All" in a rank means "All", and a
            # non-Worker has no process rank.
            dst = Pos(dst.role, normalise_rank(dst.server_rank),
                      normalise_rank(dst.process_rank) if dst.role == "Worker" else "-1")
            cmd = {**cmd, "dst": dst.json()}
            if is_broadcast(dst):
                result.update(await self._broadcast(build_message(cmd, self.pos, sync=False), dst))
            else:
                sync = bool(cmd.get("sync"))
                result.update(await self._unicast(build_message(cmd, self.pos, sync=sync), dst, wait_ack=sync))
        except Exception as exc:
            log.exception("send %s failed", uuid)
            result.update(code=SERVER_ERR, error=repr(exc))
        self.emit(event="sent", uuid=uuid, **result)

    async def _unicast(self, msg: pb.Message, dst: Pos, wait_ack: bool) -> dict:
        hop = self.routes.get(dst)  # exact key: a rank list is never one
        if hop is None:
            return {"code": NO_ROUTE, "ack_src": None, "error": f"no route to {dst}"}
        entry = self.entries.get(hop)
        if entry is None:
            return {"code": NO_ROUTE, "ack_src": None, "error": f"next hop {hop} is not registered"}
        return await self._send_to(entry, msg, wait_ack=wait_ack)

    def _broadcast_hops(self, dst: Pos) -> list[Pos]:
        """One next hop per matching routeTable entry; several entries through one hop give it several copies."""
        hops = []
        for target, hop in list(self.routes.items()):
            if target.role != dst.role:
                continue
            if not (dst.server_rank == ALL or dst.server_rank == target.server_rank):
                continue
            if dst.role == "Worker" and not (dst.process_rank == ALL or dst.process_rank == target.process_rank):
                continue
            hops.append(hop)
        return hops

    async def _broadcast(self, msg: pb.Message, dst: Pos) -> dict:
        hops = self._broadcast_hops(dst)
        copy = pb.Message()
        copy.CopyFrom(msg)
        copy.header.sync = False  # a broadcast is never sync

        async def one(hop: Pos) -> dict:
            entry = self.entries.get(hop)
            if entry is None:
                return {"code": NO_ROUTE, "error": f"next hop {hop} is not registered"}
            return await self._send_to(entry, copy, wait_ack=False)

        results = await asyncio.gather(*(one(h) for h in hops))
        failed = [{"hop": h.json(), **r} for h, r in zip(hops, results) if r["code"] != OK]
        # Like TaskD, the broadcast itself reports OK (also with zero hops); the rest is detail.
        return {"code": OK, "ack_src": None, "error": None, "hops": [h.json() for h in hops], "failed": failed}

    async def _send_to(self, entry: Entry, msg: pb.Message, wait_ack: bool) -> dict:
        async with entry.lock:
            stream = entry.stream
            if stream is None:  # TaskD's own words (a Go error: the caller gets only this text)
                return {"code": NET_STREAM_NOT_INITED, "ack_src": None, "error": "stream not inited"}
            if not stream.alive:
                return {"code": NETWORK_SEND_LOST, "ack_src": None, "error": f"stream of {entry.pos} is closed"}
            try:
                await stream.context.write(msg)
            except Exception as exc:
                return {"code": NETWORK_SEND_LOST, "ack_src": None, "error": repr(exc)}
            if not wait_ack:
                return {"code": OK, "ack_src": None, "error": None}
            uuid = msg.header.uuid
            loop = asyncio.get_running_loop()
            deadline = loop.time() + ACK_TIMEOUT_S
            while True:
                try:
                    ack = await asyncio.wait_for(stream.acks.get(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    return {"code": NETWORK_ACK_LOST, "ack_src": None, "error": "ack time out"}
                # TaskD takes any ack; we match the uuid and drop late acks of earlier messages.
                if ack.uuid == uuid:
                    return {"code": ack.code, "ack_src": pos_json(ack.src) if ack.HasField("src") else None,
                            "error": None}
                log.warning("dropping ack %s while waiting for %s", ack.uuid, uuid)

    def route_list(self) -> list:
        return [[dst.json(), hop.json()] for dst, hop in self.routes.items()]

    def entry_list(self) -> list:
        return [{"pos": e.pos.json(), "stream": None if e.stream is None else ("open" if e.stream.alive else "closed")}
                for e in self.entries.values()]

    def configure(self, cmd: dict) -> None:
        for knob in ("transfer_delay", "register_delay", "path_delay", "stream_delay"):
            if knob in cmd:
                setattr(self, knob, float(cmd[knob]))
        if "transfer_code" in cmd:
            self.transfer_code = int(cmd["transfer_code"])
        if "register_reply" in cmd:
            reply = cmd["register_reply"]
            if reply is not None and int(reply) not in PROFILING_CODES:
                raise ValueError(f"register_reply must be one of {PROFILING_CODES} or null: {reply!r}")
            self.register_reply = None if reply is None else int(reply)
        if "register_reply_tries" in cmd:
            self.register_reply_tries = max(1, int(cmd["register_reply_tries"]))


async def run(listen: str, config: dict | None = None) -> int:
    emit = Emitter()
    manager = Manager(emit)
    manager.configure(config or {})  # knobs in force from the first call (a restarted manager's too)
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

    def spawn(coro) -> None:
        task = asyncio.create_task(coro)
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)

    while (cmd := await commands.get()) is not None:
        op = cmd.get("op")
        try:
            if op == "quit":
                break
            if op == "send":
                spawn(manager.send(cmd))
            elif op == "action":
                if int(cmd.get("code", -1)) not in PROFILING_CODES:
                    emit(event="error", error=f"action code must be one of {PROFILING_CODES}: {cmd.get('code')!r}")
                else:
                    spawn(manager.action(cmd))
            elif op == "workers":
                emit(event="workers", workers=manager.worker_map())
            elif op == "routes":
                emit(event="routes", routes=manager.route_list())
            elif op == "entries":
                emit(event="entries", entries=manager.entry_list())
            elif op == "config":
                manager.configure(cmd)
                emit(event="configured")
            else:
                emit(event="error", error=f"unknown op {op!r}")
        except (TypeError, ValueError, KeyError) as exc:
            emit(event="error", error=f"bad command {cmd!r}: {exc!r}")
    for task in list(in_flight):
        task.cancel()
    await server.stop(0)
    return 0
