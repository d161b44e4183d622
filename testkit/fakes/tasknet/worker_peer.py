"""A TaskD worker's or agent's net layer (level 1): a client of the proxy, never a server.

Re-implemented from TaskD's net layer as its code behaves (its upstream endpoint):

* join: dial, ``Register`` (ack code must be 0, else the join is retried), then
  ``PathDiscovery{new uuid, proxyPos=self, path=[self]}`` once, repeated every ``retry_interval`` only
  while the call itself fails with a gRPC error (its Ack code is not looked at), then
  ``InitServerDownStream`` with metadata role/serverrank/processrank.  Like TaskD, neither Register nor
  PathDiscovery has a deadline: a manager or proxy that holds them holds the join.
* then read the stream forever.  Every message comes "from upper" and is judged the way TaskD's
  DstCase judges it against this peer's own position:

  - it is for this peer only when the destination's LEVEL is 1 and the ranks match by exact string
    or "All": a Worker needs serverRank in {own, All} and processRank in {own, All}; an Agent takes
    any level-1 destination whose serverRank is own or All (``Worker/0/0`` is "self" at ``Agent/0/-1``).
    Such a message is reported ("received") and, when sync, acked on the stream (code 0, or the
    configured ``ack_code``; ``auto_ack``/``ack_delay`` shape that ack).
  - anything else (another rank of the same level, an upper level, a rank list such as "0,1", an
    unknown role) is dropped ("dropped"); a sync one is answered ``Ack{5002, src=self}`` at once,
    whatever the knobs say, an async one gets nothing on the wire.
  - not modelled: TaskD's 8-deep receive buffer, which answers 5001 after staying full for 10 ms.
    Messages here are handed over at once.
* any stream error (or the ``drop`` command, a simulated network blip) -> rebuild: close everything
  and join again, with a new Register and PathDiscovery, sleeping ``retry_interval`` between failed
  attempts (TaskD sleeps 1 s; tests pass something shorter).

Upward messages are unary ``TransferMessage`` calls on the current connection; while there is no
connection they fail at once with ServerErr 5999, as TaskD's do (no queueing anywhere).
"""

from __future__ import annotations

import asyncio
import uuid as uuidlib

import grpc

from agent._proto import tasknet_pb2 as pb
from agent._proto import tasknet_pb2_grpc as pb_grpc

from .wire import (NO_ROUTE, OK, SERVER_ERR, TASKD_CODE_KEY, Emitter, Pos, build_message, level, log, message_event,
                   pos_json, ranks_match, start_command_reader)

ACK_SEND_TIMEOUT_S = 10.0  # TaskD's receiver gives up sending an ack after 10 s and reconnects


class JoinError(Exception):
    pass


def rpc_error_text(exc: grpc.aio.AioRpcError) -> str:
    return f"{exc.code().name}: {exc.details()}"


def taskd_code(exc: grpc.aio.AioRpcError) -> int | None:
    """The TaskD code the proxy under test put in the trailing metadata, if any."""
    for key, value in exc.trailing_metadata() or ():
        if key == TASKD_CODE_KEY:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def drop_reason(me: Pos, dst: Pos) -> str | None:
    """None when a message from upstream addressed to `dst` is for `me` (TaskD's DstCase "self");
    otherwise why a level-1 peer drops it."""
    dst_level = level(dst.role)
    if dst_level < 0:
        return f"unknown role {dst.role!r} (lower than a level-1 peer, which has no downstream)"
    if dst_level != level(me.role):  # above: a level-1 peer never sends a message from upper back up
        return "from is upper is not allowed (destination of an upper level)"
    if not ranks_match(dst.server_rank, me.server_rank):
        return "from is upper is not allowed (same level, other server rank)"
    if me.role == "Worker" and not ranks_match(dst.process_rank, me.process_rank):
        return "from is upper is not allowed (same level, other process rank)"
    return None


class Worker:
    def __init__(self, proxy: str, pos: Pos, emit: Emitter, retry_interval: float, stream_grace: float):
        self.proxy = proxy
        self.pos = pos
        self.emit = emit
        self.retry_interval = retry_interval
        self.stream_grace = stream_grace
        self.options = [
            ("grpc.enable_http_proxy", 0),  # never send 127.0.0.x through a proxy from the environment
            ("grpc.max_receive_message_length", 8 * 1024 * 1024),
            ("grpc.max_send_message_length", 8 * 1024 * 1024),
            ("grpc.initial_reconnect_backoff_ms", int(retry_interval * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(retry_interval * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(retry_interval * 1000)),
        ]
        self.channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.TaskNetStub | None = None  # set only while joined ("upClientInited")
        self.call = None
        self.stopping = False
        self.write_lock = asyncio.Lock()
        # Knobs ({"op":"config"}) for tests of the proxy's downward sync path.
        self.auto_ack = True
        self.ack_code = OK
        self.ack_delay = 0.0

    # ---- joining --------------------------------------------------------------------------------

    async def run_net(self) -> None:
        joined_before = False
        while True:
            confirmed = await self._join()
            self.emit(event="rejoined" if joined_before else "ready", pos=self.pos.json(), confirmed=confirmed)
            joined_before = True
            error = await self._recv_loop()
            if self.stopping:
                return
            await self._close()  # first, so a send after "stream_lost" sees no upstream
            self.emit(event="stream_lost", error=error)

    async def _join(self) -> bool:
        """Dial, register, discover, open the stream; retry until all of it worked."""
        while True:
            channel = self.channel = grpc.aio.insecure_channel(self.proxy, options=self.options)
            stub = pb_grpc.TaskNetStub(channel)
            try:
                ack = await stub.Register(pb.RegisterReq(uuid=str(uuidlib.uuid4()), pos=self.pos.pb()))
                if ack.code != OK:
                    raise JoinError(f"Register answered code {ack.code}")
                await self._discover(stub)
                call = stub.InitServerDownStream(metadata=(
                    ("role", self.pos.role), ("serverrank", self.pos.server_rank),
                    ("processrank", self.pos.process_rank)))
                confirmed = await self._stream_accepted(call)
                self.stub, self.call = stub, call
                return confirmed
            except (grpc.aio.AioRpcError, JoinError) as exc:
                error = rpc_error_text(exc) if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.info("join via %s failed: %s", self.proxy, error)
                self.emit(event="join_failed", error=error)
                await self._close()
                await asyncio.sleep(self.retry_interval)

    async def _discover(self, stub: pb_grpc.TaskNetStub) -> None:
        """One PathDiscovery per join, repeated only while the call fails; TaskD ignores the Ack's code."""
        request = pb.PathDiscoveryReq(uuid=str(uuidlib.uuid4()), proxyPos=self.pos.pb(), path=[self.pos.pb()])
        while True:
            try:
                ack = await stub.PathDiscovery(request)
                if ack.code != OK:
                    log.info("PathDiscovery answered code %s; carrying on, as TaskD does", ack.code)
                return
            except grpc.aio.AioRpcError as exc:
                log.info("PathDiscovery failed: %s; retrying", rpc_error_text(exc))
            await asyncio.sleep(self.retry_interval)

    async def _stream_accepted(self, call) -> bool:
        """Whether the server took the stream: True if it said so with early headers.

        A refusal ("un registry error") ends the call at once; an accepted stream just stays open,
        which a client can only tell by waiting.  A server that sends non-empty headers on
        accepting (our manager does) is confirmed at once; otherwise the stream counts as accepted
        once ``stream_grace`` seconds pass without it ending (returns False: unconfirmed).
        """
        ended = asyncio.ensure_future(call.code())
        headers = asyncio.ensure_future(call.initial_metadata())
        try:
            pending = {ended, headers}
            deadline = asyncio.get_running_loop().time() + self.stream_grace
            while pending:
                remaining = deadline - asyncio.get_running_loop().time()
                done, pending = await asyncio.wait(pending, timeout=max(0.0, remaining),
                                                   return_when=asyncio.FIRST_COMPLETED)
                if ended in done or call.done():
                    raise JoinError(f"stream refused: {await call_status(call)}")
                if headers in done and len(headers.result() or ()) > 0:
                    return True
                if not done:
                    return False  # grace passed, still open
            return False
        except BaseException:
            call.cancel()
            raise
        finally:
            ended.cancel()
            headers.cancel()

    async def _recv_loop(self) -> str:
        """Read the down stream until it fails; returns why it ended."""
        call = self.call
        while True:
            try:
                msg = await call.read()
            except grpc.aio.AioRpcError as exc:
                return rpc_error_text(exc)
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # this task is being stopped
                return "stream cancelled locally"  # the drop command, or a failed ack
            except Exception as exc:
                return repr(exc)
            if msg is grpc.aio.EOF:
                return "EOF: " + await call_status(call)
            dst = Pos.of_pb(msg.header.dst)
            why = drop_reason(self.pos, dst)
            if why is not None:
                self.emit(event="dropped", uuid=msg.header.uuid, dst=dst.json(), sync=msg.header.sync, reason=why)
                if msg.header.sync:  # async drops are silent on the wire
                    await self._ack(call, pb.Ack(uuid=msg.header.uuid, code=NO_ROUTE, src=self.pos.pb()), 0.0)
                continue
            self.emit(**message_event(msg))
            if msg.header.sync and self.auto_ack:
                ack = pb.Ack(uuid=msg.header.uuid, code=self.ack_code, src=self.pos.pb())
                if self.ack_delay > 0:
                    asyncio.create_task(self._ack(call, ack, self.ack_delay))
                else:
                    await self._ack(call, ack, 0.0)

    async def _ack(self, call, ack: pb.Ack, delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)  # simulated slowness, not synchronisation
        try:
            async with self.write_lock:
                await asyncio.wait_for(call.write(ack), ACK_SEND_TIMEOUT_S)
        except Exception as exc:  # TaskD resets the connection when an ack cannot be sent
            log.warning("ack %s not sent (%r); resetting the stream", ack.uuid, exc)
            call.cancel()

    async def _close(self) -> None:
        self.stub = None
        if self.call is not None:
            self.call.cancel()
            self.call = None
        if self.channel is not None:
            channel, self.channel = self.channel, None
            await channel.close()

    async def drop(self) -> None:
        """A network blip: end the stream and the connection; the net task then rebuilds as after any failure."""
        joined = self.call is not None
        self.emit(event="dropping", joined=joined)
        if joined:
            await self._close()

    # ---- commands -------------------------------------------------------------------------------

    async def send(self, cmd: dict) -> None:
        uuid = str(cmd.get("uuid", ""))
        stub = self.stub
        if stub is None:
            self.emit(event="sent", uuid=uuid, code=SERVER_ERR, ack_src=None, error="upstream not inited")
            return
        try:
            msg = build_message(cmd, self.pos)
            ack = await stub.TransferMessage(msg, timeout=cmd.get("timeout"))
        except grpc.aio.AioRpcError as exc:
            self.emit(event="sent", uuid=uuid, code=taskd_code(exc), ack_src=None, error=rpc_error_text(exc))
            return
        except Exception as exc:  # a malformed command, or the channel closed under us
            self.emit(event="sent", uuid=uuid, code=None, ack_src=None, error=repr(exc))
            return
        self.emit(event="sent", uuid=uuid, code=ack.code,
                  ack_src=pos_json(ack.src) if ack.HasField("src") else None, error=None)

    def configure(self, cmd: dict) -> None:
        self.auto_ack = bool(cmd.get("auto_ack", self.auto_ack))
        self.ack_code = int(cmd.get("ack_code", self.ack_code))
        self.ack_delay = float(cmd.get("ack_delay", self.ack_delay))


async def call_status(call) -> str:
    """"CODE: details" of a finished call."""
    return f"{(await call.code()).name}: {await call.details()}"


async def run(proxy: str, pos: Pos, retry_interval: float, stream_grace: float) -> int:
    emit = Emitter()
    # grpc.aio shuts its I/O engine down when the last channel closes and starts it again with the
    # next one; a call made right after that restart can hang for good (seen here when the proxy
    # restarts: every channel closed between two joins). One idle channel for the life of the
    # process keeps the engine up; TaskD's Go worker has nothing of the kind to work around.
    anchor = grpc.aio.insecure_channel("127.0.0.1:9")
    worker = Worker(proxy, pos, emit, retry_interval, stream_grace)
    net = asyncio.create_task(worker.run_net())
    commands = start_command_reader(asyncio.get_running_loop())
    in_flight: set[asyncio.Task] = set()
    while (cmd := await commands.get()) is not None:
        op = cmd.get("op")
        try:
            if op == "quit":
                break
            if op == "send":
                task = asyncio.create_task(worker.send(cmd))  # sends overlap; replies may interleave
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            elif op == "drop":
                await worker.drop()
            elif op == "config":
                worker.configure(cmd)
                emit(event="configured")
            else:
                emit(event="error", error=f"unknown op {op!r}")
        except (TypeError, ValueError, KeyError) as exc:
            emit(event="error", error=f"bad command {cmd!r}: {exc!r}")
    # End the stream and the connection first (the server sees the stream end), then the net task.
    # In that order: a task cancelled while grpc.aio waits in a stream read can hang; a read of a
    # cancelled call returns at once.
    worker.stopping = True
    await worker._close()
    net.cancel()
    await asyncio.gather(net, return_exceptions=True)
    await anchor.close()
    return 0
