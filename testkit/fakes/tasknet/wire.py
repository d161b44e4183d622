"""Pieces both TaskNet peers share: positions, TaskD's net codes, and the JSON-lines plumbing.

Positions travel as ``{"role", "server_rank", "process_rank"}`` in JSON (the spelling of TaskD's
own ``TaskNetConfig``), as ``pb.Position`` on the wire, and as ``Pos`` tuples inside the peers.
Nothing here imports the product code: the peers must stay an independent re-implementation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
from typing import Any, NamedTuple

from agent._proto import tasknet_pb2 as pb

log = logging.getLogger("tasknet-peer")

# TaskD's net return codes (NET/common/code.go), the ones the peers use.
OK = 0
RECV_BUF_BUSY = 5001
NO_ROUTE = 5002
EXCEED_MAX_REGISTRY_NUM = 5003
SERVER_ERR = 5999
NETWORK_SEND_LOST = 6000
NETWORK_ACK_LOST = 6001
NET_STREAM_NOT_INITED = 6002

ALL = "All"
ACK_TIMEOUT_S = 3.0       # TaskD's AckTimeout for downward sync sends
MAX_REGISTRATIONS = 5000  # per server
TASKD_CODE_KEY = "taskd-code"  # trailing-metadata key the proxy under test uses for TaskD codes


class Pos(NamedTuple):
    role: str
    server_rank: str
    process_rank: str

    @classmethod
    def of_pb(cls, p: pb.Position) -> "Pos":
        return cls(p.role, p.serverRank, p.processRank)

    @classmethod
    def of_json(cls, d: dict) -> "Pos":
        return cls(str(d["role"]), str(d["server_rank"]), str(d.get("process_rank", "-1")))

    def pb(self) -> pb.Position:
        return pb.Position(role=self.role, serverRank=self.server_rank, processRank=self.process_rank)

    def json(self) -> dict:
        return {"role": self.role, "server_rank": self.server_rank, "process_rank": self.process_rank}

    def __str__(self) -> str:
        return f"{self.role}/{self.server_rank}/{self.process_rank}"


MGR = Pos("Mgr", "0", "-1")


def pos_json(p: pb.Position | None) -> dict | None:
    return Pos.of_pb(p).json() if p is not None else None


def message_event(msg: pb.Message) -> dict:
    """The "received" event both peers emit for a message that reached them."""
    h = msg.header
    return {"event": "received", "uuid": h.uuid, "mtype": h.mtype, "sync": h.sync,
            "src": pos_json(h.src), "dst": pos_json(h.dst), "body": msg.body}


def command_body(cmd: dict) -> str:
    """A send command's body: ``"x" * body_size`` when given (big bodies stay off stdin), else ``body``."""
    if cmd.get("body_size") is not None:
        return "x" * int(cmd["body_size"])
    return str(cmd.get("body", ""))


def build_message(cmd: dict, src: Pos, sync: bool | None = None) -> pb.Message:
    header = pb.MessageHeader(uuid=str(cmd["uuid"]), mtype=str(cmd.get("mtype", "DEFAULT")),
                              sync=bool(cmd.get("sync", False)) if sync is None else sync,
                              src=src.pb(), dst=Pos.of_json(cmd["dst"]).pb())
    return pb.Message(header=header, body=command_body(cmd))


# TaskD's levels by role; any other role is level -1 (TaskD then takes the destination as "lower").
LEVELS = {"Mgr": 3, "Proxy": 2, "Agent": 1, "Worker": 1}


def level(role: str) -> int:
    return LEVELS.get(role, -1)


def normalise_rank(rank: str) -> str:
    """What an originator does to a destination rank: anything containing "All" becomes "All"."""
    return ALL if ALL in rank else rank


def is_broadcast(dst: Pos) -> bool:
    return ALL in dst.server_rank or ALL in dst.process_rank


def ranks_match(pattern: str, rank: str) -> bool:
    """A destination rank field against one concrete rank, as TaskD compares them: the same string,
    or "All".  Comma lists are never split: "0,1" matches neither "0" nor "1"."""
    return ALL in pattern or pattern == rank


def msg_body(msg_type: str, code: int, message: str = "", extension: dict | None = None) -> str:
    """A business body as TaskD's Go code marshals its MsgBody: compact, fields in this order, no omitempty."""
    return json.dumps({"msg_type": msg_type, "code": code, "message": message, "extension": extension},
                      separators=(",", ":"), ensure_ascii=False)


def parse_msg_body(body: str) -> dict | None:
    """The MsgBody in a message body, or None when it is not one (TaskD logs and ignores such bodies)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("msg_type", ""), str):
        return None
    code = parsed.get("code", 0)
    if isinstance(code, bool) or not isinstance(code, int):
        return None
    return {"msg_type": parsed.get("msg_type", ""), "code": code, "message": parsed.get("message", ""),
            "extension": parsed.get("extension")}


class Emitter:
    """One JSON object per stdout line, flushed; safe from any thread."""

    def __init__(self):
        self._lock = threading.Lock()

    def __call__(self, **event: Any) -> None:
        line = json.dumps(event, separators=(",", ":"))
        with self._lock:
            try:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
            except (BrokenPipeError, ValueError):  # the driver has gone; nothing left to tell
                pass


def start_command_reader(loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
    """Read stdin JSON lines on a daemon thread; the queue yields dicts, then None at EOF."""
    queue: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            try:
                cmd = json.loads(line)
            except ValueError:
                log.error("ignoring a command that is not JSON: %r", line)
                continue
            loop.call_soon_threadsafe(queue.put_nowait, cmd)
        loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=read, name="stdin", daemon=True).start()
    return queue
