"""A TaskD worker's or agent's net layer (level 1): a client of the proxy, never a server.

Re-implemented from ``/work/shared/reference/taskd.md`` §3.4-3.7 (``NET/upstream_endpoint.go``):

* join: dial, ``Register`` (ack code must be 0), ``PathDiscovery{proxyPos=self, path=[self]}``
  retried until OK, then ``InitServerDownStream`` with metadata role/serverrank/processrank;
* then read the stream forever, acking sync messages on it;
* any stream error -> rebuild: close everything and join again, sleeping ``retry_interval``
  between failed attempts (TaskD sleeps 1 s; tests pass something shorter).

Upward messages are unary ``TransferMessage`` calls on the current connection; while there is no
connection they fail at once with ServerErr 5999, as TaskD's do (no queueing anywhere).
"""

from __future__ import annotations

import asyncio
import uuid as uuidlib

import grpc

from agent._proto import tasknet_pb2 as pb
from agent._proto import tasknet_pb2_grpc as pb_grpc

from .wire import (OK, SERVER_ERR, TASKD_CODE_KEY, Emitter, Pos, build_message, log, message_event, pos_json,
                   start_command_reader)

ACK_SEND_TIMEOUT_S = 10.0  # TaskD's receiver gives up sending an ack after 10 s and reconnects
CALL_TIMEOUT_S = 5.0       # for Register / PathDiscovery, so a half-dead proxy cannot wedge a join


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
            await self._close()  # first, so a send after "stream_lost" sees no upstream
            self.emit(event="stream_lost", error=error)

    async def _join(self) -> bool:
        """Dial, register, discover, open the stream; retry until all of it worked."""
        while True:
            channel = grpc.aio.insecure_channel(self.proxy, options=self.options)
            stub = pb_grpc.TaskNetStub(channel)
            try:
                ack = await stub.Register(pb.RegisterReq(uuid=str(uuidlib.uuid4()), pos=self.pos.pb()),
                                          timeout=CALL_TIMEOUT_S)
                if ack.code != OK:
                    raise JoinError(f"Register answered code {ack.code}")
                await self._discover(stub)
                call = stub.InitServerDownStream(metadata=(
                    ("role", self.pos.role), ("serverrank", self.pos.server_rank),
                    ("processrank", self.pos.process_rank)))
                confirmed = await self._stream_accepted(call)
                self.channel, self.stub, self.call = channel, stub, call
                return confirmed
            except (grpc.aio.AioRpcError, JoinError) as exc:
                error = rpc_error_text(exc) if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.info("join via %s failed: %s", self.proxy, error)
                self.emit(event="join_failed", error=error)
                await channel.close()
                await asyncio.sleep(self.retry_interval)

    async def _discover(self, stub: pb_grpc.TaskNetStub) -> None:
        request = pb.PathDiscoveryReq(uuid=str(uuidlib.uuid4()), proxyPos=self.pos.pb(), path=[self.pos.pb()])
        while True:
            try:
                ack = await stub.PathDiscovery(request, timeout=CALL_TIMEOUT_S)
                if ack.code == OK:
                    return
                log.info("PathDiscovery answered code %s; retrying", ack.code)
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
                raise
            except Exception as exc:  # e.g. the call was cancelled locally after a failed ack
                return repr(exc)
            if msg is grpc.aio.EOF:
                return "EOF: " + await call_status(call)
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
            await self.channel.close()
            self.channel = None

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


async def call_status(call) -> str:
    """"CODE: details" of a finished call."""
    return f"{(await call.code()).name}: {await call.details()}"


async def run(proxy: str, pos: Pos, retry_interval: float, stream_grace: float) -> int:
    emit = Emitter()
    worker = Worker(proxy, pos, emit, retry_interval, stream_grace)
    net = asyncio.create_task(worker.run_net())
    commands = start_command_reader(asyncio.get_running_loop())
    in_flight: set[asyncio.Task] = set()
    while (cmd := await commands.get()) is not None:
        op = cmd.get("op")
        if op == "quit":
            break
        if op == "send":
            task = asyncio.create_task(worker.send(cmd))  # sends overlap; replies may interleave
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        elif op == "config":
            worker.auto_ack = bool(cmd.get("auto_ack", worker.auto_ack))
            worker.ack_code = int(cmd.get("ack_code", worker.ack_code))
            worker.ack_delay = float(cmd.get("ack_delay", worker.ack_delay))
            emit(event="configured")
        else:
            emit(event="error", error=f"unknown op {op!r}")
    net.cancel()
    await asyncio.gather(net, return_exceptions=True)
    await worker._close()  # cancels the stream, so the server sees it end
    return 0
