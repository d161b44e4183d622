"""TaskD's manager-driven profiling switch: the worker's TaskNet client (level 1, role "Worker").

When the training process belongs to a TaskD job with a manager (`enabled`), the worker joins the
job's TaskNet tree through the node's TaskD proxy, registers with the manager, and from then on
the manager, not the switch file, turns profiling on and off:

* **join** (TaskD's level-1 client): `Register` (its Ack code must be 0), `PathDiscovery
  {proxyPos=self, path=[self]}` repeated every second while the call fails (the Ack code is not
  looked at), then the `InitServerDownStream` stream with the metadata role/serverrank/processrank;
  any error: one second's pause and a new join. Every call has a deadline; a stream that ends or
  fails is rebuilt the same way.
* **REGISTER** (once per process, never again after a rebuild): a sync `TransferMessage` to the
  manager `{Mgr,"0","-1"}`, tried after pauses of 0, 1, 2 ... 9 s (at about 0, 1, 3, 6, 10, 15, 21,
  28, 36, 45 s); a try succeeds when the call returns without a gRPC error, and fails at once while
  the stream is not up. Not registered within 180 s of the start: given up for good (the client
  closes; the switch file stays in charge).
* **down messages**: only those addressed to this process (a level-1 role, server and process rank
  each exactly its own or "All") are taken; others are dropped, a sync one answered `Ack 5002`.
  Taken sync messages are acked on the stream (`Ack 0`, or 5001 when the 8-deep inbox stayed full
  for 10 ms); an ack that cannot be handed to gRPC within 10 s rebuilds the connection.
* **ACTION** 700/710/701/711 -> `(default_on, comm_on)`, applied through the worker's switch;
  when applied, one sync STATUS `1400 + 10*d + c` (d, c: 0 off, 1 on, 2 exception) goes to the
  manager, without retry. Anything else is counted, logged (rate-limited) and ignored.

The gRPC calls are made with the synchronous API on two daemon threads: "net" (join, read the
stream, ack) and "business" (REGISTER, then the inbox). The pure parts (environment, position,
codes, bodies, the receive rule) are module functions.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid as uuidlib
from typing import Callable, Iterator, Mapping, NamedTuple, Protocol

from agent.worker.switch import _fold

log = logging.getLogger("agent.worker")

DEFAULT_PROXY = "127.0.0.1:9602"  # TaskD's worker dials this, hard-coded
REGISTER_DELAYS = tuple(float(i) for i in range(10))  # pause before each REGISTER try
REGISTER_GIVE_UP_S = 180.0
RETRY_S = 1.0  # TaskD's pause after a failed join step
JOIN_CALL_TIMEOUT_S = 5.0  # Register, PathDiscovery
# TransferMessage (REGISTER, STATUS): TaskD sets no deadline; this one outlasts the node agent's
# default hold of a message for an unreachable manager (60 s), so a held message is not given up early.
SEND_CALL_TIMEOUT_S = 70.0
ACK_SEND_TIMEOUT_S = 10.0
INBOX_SIZE = 8  # TaskD's worker receive buffer
INBOX_WAIT_S = 0.01
LOG_EVERY_S = 30.0
MAX_MESSAGE = 8 * 1024 * 1024

WORKER = "Worker"
ALL = "All"

# TaskNet codes (TaskD's net layer)
OK = 0
RECV_BUF_BUSY = 5001
NO_ROUTE = 5002

# Business codes
REGISTER_CODE = 101
ACTIONS = {700: (False, False), 710: (True, False), 701: (False, True), 711: (True, True)}
STATUS_BASE = 1400
SWITCH_OFF, SWITCH_ON, SWITCH_EXCEPTION = 0, 1, 2


class Position(NamedTuple):
    role: str
    server_rank: str
    process_rank: str

    def __str__(self) -> str:
        return f"{self.role}/{self.server_rank}/{self.process_rank}"


MGR = Position("Mgr", "0", "-1")


# -- the environment (pure) ---------------------------------------------------------------------------

def enabled(env: Mapping[str, str]) -> bool:
    """Whether this process is in a TaskD job with a manager, and the manager mode is not turned off.

    `MINDX_TASK_ID` and a manager host (`MASTER_ADDR`, `MS_SCHED_HOST`, or `LOCAL_PROXY_ENABLE=on`)
    are needed; `NPU_AGENT_TASKD_MANAGER=off` turns it off."""
    if env.get("NPU_AGENT_TASKD_MANAGER", "").strip().lower() == "off":
        return False
    if not env.get("MINDX_TASK_ID"):
        return False
    return bool(env.get("MASTER_ADDR") or env.get("MS_SCHED_HOST") or env.get("LOCAL_PROXY_ENABLE") == "on")


def proxy_address(env: Mapping[str, str]) -> str:
    """`NPU_AGENT_TASKD_PROXY` (host:port), else TaskD's fixed 127.0.0.1:9602."""
    return env.get("NPU_AGENT_TASKD_PROXY", "").strip() or DEFAULT_PROXY


def _natural(value: str | None) -> int | None:
    value = (value or "").strip()
    return int(value) if value.isascii() and value.isdigit() else None


def node_rank(env: Mapping[str, str]) -> str:
    """RANK // LOCAL_WORLD_SIZE (PyTorch) when both are valid, else MS_NODE_RANK (MindSpore), else "0"."""
    rank, local = _natural(env.get("RANK")), _natural(env.get("LOCAL_WORLD_SIZE"))
    if rank is not None and local:
        return str(rank // local)
    ms = _natural(env.get("MS_NODE_RANK"))
    return str(ms) if ms is not None else "0"


def own_position(rank_id: int, env: Mapping[str, str]) -> Position:
    return Position(WORKER, node_rank(env), str(rank_id))


# -- messages (pure) --------------------------------------------------------------------------------

def body(msg_type: str, code: int) -> str:
    """TaskD's MsgBody as Go marshals it: compact, fields in declaration order, no omitempty."""
    return json.dumps({"msg_type": msg_type, "code": code, "message": "", "extension": None},
                      separators=(",", ":"))


def status_code(results: tuple[int, int]) -> int:
    """STATUS code of the per-domain results (0 off, 1 on, 2 exception): 1400 + 10*default + comm."""
    default, comm = results
    return STATUS_BASE + 10 * default + comm


def action_state(code: int) -> tuple[bool, bool] | None:
    """(default_on, comm_on) of an ACTION code, or None for a code that is not one."""
    return ACTIONS.get(code)


class _Object(list):
    """A JSON object's (key, value) pairs, in order."""


def parse_body(text: str) -> tuple[str, int] | None:
    """(msg_type, code) of a MsgBody, or None when Go's json.Unmarshal into it fails.

    `MsgBody{msg_type string, code int32, message string, extension map[string]string}`: keys match
    case-insensitively (a later duplicate wins), null leaves a field as it is, unknown keys are
    ignored; a value of the wrong type (a code that is not an int32, e.g. 700.0) is an error."""
    try:
        doc = json.loads(text, object_pairs_hook=_Object)
    except (ValueError, RecursionError):
        return None
    if doc is None:
        return "", 0
    if not isinstance(doc, _Object):
        return None
    msg_type, code = "", 0
    for key, value in doc:
        folded = _fold(key)
        if value is None:
            continue
        if folded == "MSG_TYPE":
            if not isinstance(value, str):
                return None
            msg_type = value
        elif folded == "CODE":
            if not isinstance(value, int) or isinstance(value, bool) or not -2**31 <= value < 2**31:
                return None
            code = value
        elif folded == "MESSAGE":
            if not isinstance(value, str):
                return None
        elif folded == "EXTENSION":
            if not isinstance(value, _Object) or not all(isinstance(v, str) or v is None for _, v in value):
                return None
    return msg_type, code


def level(role: str) -> int:
    """TaskNet's level of a role; an unknown role is -1."""
    return {"Mgr": 3, "Proxy": 2, "Agent": 1, "Worker": 1}.get(role, -1)


def accepts(own: Position, dst: Position) -> bool:
    """TaskD's receive rule for a level-1 process: a level-1 destination whose server and process
    ranks are each exactly the own one or "All" (a list such as "0,1" matches nothing)."""
    return (level(dst.role) == 1 and dst.server_rank in (own.server_rank, ALL)
            and dst.process_rank in (own.process_rank, ALL))


# -- the client ----------------------------------------------------------------------------------------

class Switch(Protocol):
    """What the client drives (agent.worker.runtime.Worker)."""

    def manager_registered(self) -> None: ...

    def manager_action(self, state: tuple[bool, bool]) -> tuple[int, int] | None: ...


class _Limited:
    """Log a kind of message at most once per `every` seconds."""

    def __init__(self, every: float = LOG_EVERY_S, monotonic=time.monotonic):
        self._every = every
        self._monotonic = monotonic
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, kind: str, level_: int, message: str, *args) -> None:
        now = self._monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._every:
                return
            self._last[kind] = now
        log.log(level_, message, *args)


class _Acks:
    """The request side of the down stream: Acks handed to gRPC one by one."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self.call = None  # the stream these acks go on, once it is open

    def __iter__(self) -> Iterator:
        while not self._closed.is_set():
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is None:
                return
            ack, taken = item
            taken.set()
            yield ack

    def send(self, ack, timeout: float) -> bool:
        """Queue `ack`; True once gRPC has taken it, False after `timeout` seconds or as soon as the
        stream has ended or these acks are closed."""
        taken = threading.Event()
        self._queue.put((ack, taken))
        deadline = time.monotonic() + timeout
        while not taken.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            call = self.call
            if self._closed.is_set() or time.monotonic() >= deadline or (call is not None and call.done()):
                return False
        return True

    def close(self) -> None:
        self._closed.set()
        self._queue.put(None)


class _JoinError(Exception):
    pass


class ManagerClient:
    """The worker's TaskNet client; `start(switch)` runs it, `stop()` ends it."""

    def __init__(self, position: Position, address: str, *, register_delays=REGISTER_DELAYS,
                 give_up_s: float = REGISTER_GIVE_UP_S, retry_s: float = RETRY_S,
                 join_timeout_s: float = JOIN_CALL_TIMEOUT_S, send_timeout_s: float = SEND_CALL_TIMEOUT_S,
                 monotonic=time.monotonic):
        self.position = position
        self.address = address
        self.register_delays = tuple(register_delays)
        self.give_up_s = give_up_s
        self.retry_s = retry_s
        self.join_timeout_s = join_timeout_s
        self.send_timeout_s = send_timeout_s
        self._monotonic = monotonic
        self._switch: Switch | None = None
        self._stop = threading.Event()
        self._up = threading.Event()  # the down stream is open ("upClientInited")
        self._lock = threading.Lock()  # the current connection
        self._channel = None
        self._stub = None
        self._call = None
        self._acks: _Acks | None = None
        self._started = monotonic()  # set again by start()
        self._threads: list[threading.Thread] = []
        self._inbox: queue.Queue = queue.Queue(INBOX_SIZE)
        self._limited = _Limited(monotonic=monotonic)
        self.registered = False
        self.given_up = False
        self.stopped = False
        self.counters = dict.fromkeys(
            ("joins", "join_errors", "stream_errors", "register_tries", "messages", "messages_dropped",
             "messages_busy", "messages_ignored", "acks_sent", "actions", "actions_applied",
             "statuses_sent", "status_errors"), 0)
        self._counter_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self, switch: Switch) -> bool:
        """Start both threads; False (logged) when gRPC is not available."""
        if self._threads or self.stopped:
            return bool(self._threads) and not self.stopped
        try:
            import grpc  # noqa: F401
            from agent._proto import tasknet_pb2, tasknet_pb2_grpc  # noqa: F401
        except Exception as exc:  # ImportError, or a protobuf version clash
            log.error("TaskD manager mode unavailable (%s: %s); the switch file stays in charge",
                      type(exc).__name__, exc)
            return False
        self._switch = switch
        self._started = self._monotonic()
        for name, target in (("npu-agent-tasknet", self._net_loop), ("npu-agent-tasknet-biz", self._business)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            self._threads.append(thread)
            thread.start()
        log.info("TaskD manager mode: joining via %s as %s", self.address, self.position)
        return True

    def stop(self, timeout: float = 2.0) -> None:
        """End both threads and close the connection; never raises."""
        try:
            self.stopped = True
            self._stop.set()
            self._close_connection()
            deadline = time.monotonic() + timeout
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join(max(0.0, deadline - time.monotonic()))
        except BaseException:
            pass

    def after_fork_in_child(self) -> None:
        """In a forked child: the connection and the threads are the parent's; never started or
        stopped here, and the locks are new so that `stats()` cannot hang on one held at the fork."""
        self.stopped = True
        self._lock = threading.Lock()
        self._counter_lock = threading.Lock()

    @property
    def joined(self) -> bool:
        return self._up.is_set()

    def stats(self) -> dict:
        with self._counter_lock:
            out = {f"manager_{k}": v for k, v in self.counters.items()}
        out.update(manager_registered=self.registered, manager_joined=self.joined,
                   manager_given_up=self.given_up, manager_running=any(t.is_alive() for t in self._threads))
        # the short names asked for most often
        out["actions"] = out["manager_actions"]
        out["statuses_sent"] = out["manager_statuses_sent"]
        return out

    def _count(self, name: str, n: int = 1) -> None:
        with self._counter_lock:
            self.counters[name] += n

    # -- the connection ("net" thread) ---------------------------------------------------------------

    def _options(self) -> list:
        retry_ms = max(100, int(self.retry_s * 1000))
        return [("grpc.enable_http_proxy", 0),  # a loopback proxy address is never sent to an HTTP proxy
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE),
                ("grpc.initial_reconnect_backoff_ms", retry_ms),
                ("grpc.min_reconnect_backoff_ms", retry_ms),
                ("grpc.max_reconnect_backoff_ms", retry_ms)]

    def _net_loop(self) -> None:
        import grpc
        from agent._proto import tasknet_pb2_grpc as pb_grpc

        while not self._stop.is_set():
            channel = grpc.insecure_channel(self.address, options=self._options())
            acks = _Acks()
            with self._lock:
                if self._stop.is_set():
                    channel.close()
                    return
                self._channel, self._acks = channel, acks
            try:
                stub = pb_grpc.TaskNetStub(channel)
                call = self._join(stub, acks)
            except (grpc.RpcError, _JoinError, ValueError) as exc:
                self._count("join_errors")
                if not self._stop.is_set():
                    self._limited("join", logging.INFO, "TaskD manager mode: joining via %s failed (%s); retrying",
                                  self.address, _describe(exc))
                self._drop_connection(acks)
                self._stop.wait(self.retry_s)
                continue
            with self._lock:
                self._stub, self._call = stub, call
            self._count("joins")
            self._up.set()
            opened = self._monotonic()
            error = self._read(call, acks)
            self._drop_connection(acks)
            if self._stop.is_set():
                return
            self._count("stream_errors")
            self._limited("stream", logging.WARNING, "TaskD manager mode: stream from %s ended (%s); joining again",
                          self.address, error)
            if self._monotonic() - opened < self.retry_s:
                self._stop.wait(self.retry_s)  # a stream that dies at once is not retried in a tight loop

    def _join(self, stub, acks: _Acks):
        import grpc
        from agent._proto import tasknet_pb2 as pb

        me = _pb_position(self.position)
        ack = stub.Register(pb.RegisterReq(uuid=_uuid(), pos=me), timeout=self.join_timeout_s, wait_for_ready=True)
        if ack.code != OK:
            raise _JoinError(f"Register answered code {ack.code}")
        discovery = pb.PathDiscoveryReq(uuid=_uuid(), proxyPos=me, path=[me])
        while True:
            if self._stop.is_set():
                raise _JoinError("stopped")
            try:
                stub.PathDiscovery(discovery, timeout=self.join_timeout_s)
                break
            except grpc.RpcError as exc:
                self._limited("path", logging.INFO, "TaskD manager mode: PathDiscovery failed (%s); retrying",
                              _describe(exc))
            self._stop.wait(self.retry_s)
        metadata = (("role", self.position.role), ("serverrank", self.position.server_rank),
                    ("processrank", self.position.process_rank))
        acks.call = stub.InitServerDownStream(iter(acks), metadata=metadata)
        return acks.call

    def _read(self, call, acks: _Acks) -> str:
        """Take messages from the down stream until it ends; returns why it ended."""
        import grpc

        try:
            for msg in call:
                if not self._receive(msg, acks):
                    call.cancel()
                    return f"an ack could not be sent within {ACK_SEND_TIMEOUT_S:g} s"
        except grpc.RpcError as exc:
            return _describe(exc)
        except Exception as exc:  # noqa: BLE001 - the thread must survive anything
            return f"{type(exc).__name__}: {exc}"
        return "closed by the server"

    def _receive(self, msg, acks: _Acks) -> bool:
        """Route one down message; False when its ack could not be sent (the link is then rebuilt)."""
        self._count("messages")
        header = msg.header
        dst = Position(header.dst.role, header.dst.serverRank, header.dst.processRank)
        if accepts(self.position, dst):
            try:
                self._inbox.put(msg, timeout=INBOX_WAIT_S)
                code = OK
            except queue.Full:
                code = RECV_BUF_BUSY
                self._count("messages_busy")
                self._limited("busy", logging.WARNING, "TaskD manager mode: inbox full, message %s dropped",
                              header.uuid)
        else:
            code = NO_ROUTE
            self._count("messages_dropped")
            self._limited("dropped", logging.WARNING,
                          "TaskD manager mode: dropped message %s addressed to %s (this process is %s)",
                          header.uuid, dst, self.position)
        if not header.sync:
            return True
        from agent._proto import tasknet_pb2 as pb

        ack = pb.Ack(uuid=header.uuid, code=code, src=_pb_position(self.position))
        if not acks.send(ack, ACK_SEND_TIMEOUT_S):
            return False
        self._count("acks_sent")
        return True

    def _drop_connection(self, acks: _Acks) -> None:
        self._up.clear()
        acks.close()
        with self._lock:
            call, channel = self._call, self._channel
            self._call = self._stub = self._channel = self._acks = None
        _quietly(call.cancel if call is not None else None)
        _quietly(channel.close if channel is not None else None)

    def _close_connection(self) -> None:
        """From another thread (stop): end whatever the net thread is waiting on; it cleans up."""
        with self._lock:
            call, channel, acks = self._call, self._channel, self._acks
        _quietly(acks.close if acks is not None else None)
        _quietly(call.cancel if call is not None else None)
        _quietly(channel.close if channel is not None else None)

    # -- upward messages ------------------------------------------------------------------------------

    def _send(self, msg_type: str, code: int) -> str | None:
        """One sync TransferMessage to the manager; None when it returned without a gRPC error, else why not."""
        import grpc
        from agent._proto import tasknet_pb2 as pb

        with self._lock:
            stub = self._stub if self._up.is_set() else None
        if stub is None:
            return "not joined"
        header = pb.MessageHeader(uuid=_uuid(), mtype="default", sync=True, src=_pb_position(self.position),
                                  dst=_pb_position(MGR))
        try:
            stub.TransferMessage(pb.Message(header=header, body=body(msg_type, code)), timeout=self.send_timeout_s)
        except grpc.RpcError as exc:
            return _describe(exc)
        except ValueError as exc:  # the channel was closed under the call
            return str(exc)
        return None

    # -- REGISTER, then the inbox ("business" thread) ----------------------------------------------------

    def _business(self) -> None:
        try:
            if not self._register():
                return
            self._switch.manager_registered()
            while not self._stop.is_set():
                try:
                    msg = self._inbox.get(timeout=0.5)
                except queue.Empty:
                    continue
                try:
                    self._handle(msg)
                except Exception as exc:  # noqa: BLE001 - one bad message must not end manager mode
                    self._limited("handle", logging.ERROR, "TaskD manager mode: handling message %s failed: %s: %s",
                                  msg.header.uuid, type(exc).__name__, exc)
        except Exception as exc:  # noqa: BLE001 - logged; the switch file is the fallback
            log.error("TaskD manager mode failed: %s: %s", type(exc).__name__, exc)

    def _register(self) -> bool:
        """REGISTER once the worker has joined; True when the manager took it. Gives up (and stops
        the client) after the last try, or when the deadline passes first."""
        deadline = self._started + self.give_up_s
        why = f"not joined via {self.address}"
        if self._wait_joined(deadline):
            for delay in self.register_delays:
                if self._stop.wait(delay):
                    return False
                if self._monotonic() > deadline:
                    break
                self._count("register_tries")
                why = self._send("REGISTER", REGISTER_CODE)
                if why is None:
                    self.registered = True
                    log.info("TaskD manager mode: registered with the manager via %s as %s; it drives the "
                             "profiling switch from now on", self.address, self.position)
                    return True
                log.info("TaskD manager mode: REGISTER failed (%s)", why)
        if self._stop.is_set():
            return False
        self.given_up = True
        log.warning("TaskD manager mode: not registered with the manager (%s, %d tries in %.0f s); giving up, "
                    "the switch file stays in charge", why, self.counters["register_tries"],
                    self._monotonic() - self._started)
        self.stop_async()
        return False

    def _wait_joined(self, deadline: float) -> bool:
        """Until the stream is up (True), the deadline passes or the client stops (False)."""
        while not self._stop.is_set():
            remaining = deadline - self._monotonic()
            if remaining <= 0:
                return self._up.is_set()
            if self._up.wait(min(remaining, 0.2)):
                return True
        return False

    def stop_async(self) -> None:
        """Stop from a client thread: the other thread ends by itself."""
        self._stop.set()
        self._close_connection()

    def _handle(self, msg) -> None:
        parsed = parse_body(msg.body)
        if parsed is None:
            self._ignored("unparsable", "a message body that is not a MsgBody: %.200r", msg.body)
            return
        msg_type, code = parsed
        if msg_type != "ACTION":
            self._ignored("type", "a %r message (code %s)", msg_type, code)
            return
        state = action_state(code)
        if state is None:
            self._ignored("code", "an ACTION with the unknown code %s", code)
            return
        self._count("actions")
        results = self._switch.manager_action(state)
        if results is None:
            return  # the command already in force: TaskD sends no STATUS
        self._count("actions_applied")
        status = status_code(results)
        why = self._send("STATUS", status)
        if why is None:
            self._count("statuses_sent")
            log.info("TaskD manager mode: ACTION %s applied, STATUS %s sent", code, status)
        else:
            self._count("status_errors")
            log.warning("TaskD manager mode: ACTION %s applied, STATUS %s not sent (%s)", code, status, why)

    def _ignored(self, kind: str, message: str, *args) -> None:
        self._count("messages_ignored")
        self._limited(kind, logging.WARNING, "TaskD manager mode: ignoring " + message, *args)


def client_from_env(rank_id: int, env: Mapping[str, str] | None = None, **kwargs) -> ManagerClient | None:
    """The client for this process when `enabled`, else None."""
    env = os.environ if env is None else env
    if not enabled(env):
        return None
    return ManagerClient(own_position(rank_id, env), proxy_address(env), **kwargs)


def _pb_position(p: Position):
    from agent._proto import tasknet_pb2 as pb

    return pb.Position(role=p.role, serverRank=p.server_rank, processRank=p.process_rank)


def _uuid() -> str:
    return str(uuidlib.uuid4())


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    details = getattr(exc, "details", None)
    if callable(code) and callable(details):
        try:
            return f"{code().name}: {details()}"
        except Exception:  # noqa: BLE001
            pass
    return f"{type(exc).__name__}: {exc}"


def _quietly(fn: Callable[[], object] | None) -> None:
    if fn is None:
        return
    try:
        fn()
    except Exception:  # noqa: BLE001
        pass
