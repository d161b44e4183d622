"""TaskNet positions, message validation and routing decisions (pure; as TaskD's net layer decides them).

One `RouteTable` per job: the node proxy plays a TaskD proxy for each job separately, so a
position ("Worker 0 3") only ever means something inside its own job.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from agent._proto import tasknet_pb2 as pb

LEVELS = {"Mgr": 3, "Proxy": 2, "Agent": 1, "Worker": 1}
PROXY_LEVEL = 2
ALL = "All"


class Code(IntEnum):
    """TaskD's net return codes (NET/common/code.go)."""
    OK = 0
    NIL_MESSAGE = 4000
    NIL_HEADER = 4001
    NIL_POSITION = 4002
    DST_ROLE_ILLEGAL = 4003
    DST_SRV_RANK_ILLEGAL = 4004
    DST_PROCESS_RANK_ILLEGAL = 4005
    DST_TYPE_ILLEGAL = 4006
    CLIENT_ERR = 4999
    RECV_BUF_BUSY = 5001
    NO_ROUTE = 5002
    EXCEED_MAX_REGISTRY_NUM = 5003
    SERVER_ERR = 5999
    NETWORK_SEND_LOST = 6000
    NETWORK_ACK_LOST = 6001
    NET_STREAM_NOT_INITED = 6002


@dataclass(frozen=True, slots=True)
class Position:
    role: str
    server_rank: str
    process_rank: str

    @classmethod
    def of(cls, message: pb.Position) -> "Position":
        return cls(message.role, message.serverRank, message.processRank)

    def pb(self) -> pb.Position:
        return pb.Position(role=self.role, serverRank=self.server_rank, processRank=self.process_rank)

    @property
    def level(self) -> int:
        return LEVELS.get(self.role, -1)

    def __str__(self) -> str:
        return f"{self.role}/{self.server_rank}/{self.process_rank}"


class Invalid(ValueError):
    def __init__(self, code: Code, reason: str):
        super().__init__(reason)
        self.code = code


def _naturals(text: str) -> bool:
    return all(part.isdigit() and part.isascii() for part in text.split(","))


def _ranks(text: str, code: Code, what: str) -> str:
    if _naturals(text):
        return text
    if ALL in text:
        return ALL
    raise Invalid(code, f"destination {what} {text!r} is not a list of ranks or All")


def checked_destination(header: pb.MessageHeader | None) -> Position:
    """A message's destination as TaskD normalises it, or `Invalid` with TaskD's code."""
    if header is None:
        raise Invalid(Code.NIL_HEADER, "message has no header")
    if not header.HasField("src") or not header.HasField("dst"):
        raise Invalid(Code.NIL_POSITION, "message has no source or destination position")
    dst = Position.of(header.dst)
    if dst.level < 0:
        raise Invalid(Code.DST_ROLE_ILLEGAL, f"destination role {dst.role!r} is not Mgr, Proxy, Agent or Worker")
    server = _ranks(dst.server_rank, Code.DST_SRV_RANK_ILLEGAL, "server rank")
    if dst.role != "Worker":
        process = "-1"  # only a Worker has a process rank
    else:
        process = _ranks(dst.process_rank, Code.DST_PROCESS_RANK_ILLEGAL, "process rank")
    return Position(dst.role, server, process)


def checked_own_position(pos: Position) -> Position:
    """A position a worker or agent registers with (TaskD's CheckConfig, for level-1 roles)."""
    if pos.level != 1:
        raise Invalid(Code.CLIENT_ERR, f"role {pos.role!r} cannot register at a node proxy (Worker or Agent only)")
    if not (pos.server_rank.isdigit() and pos.server_rank.isascii()):
        raise Invalid(Code.CLIENT_ERR, f"server rank {pos.server_rank!r} is not a natural number")
    if pos.role == "Worker" and not (pos.process_rank.isdigit() and pos.process_rank.isascii()):
        raise Invalid(Code.CLIENT_ERR, f"process rank {pos.process_rank!r} is not a natural number")
    return pos


def _matches(pattern: str, rank: str) -> bool:
    # TaskD compares ranks as whole strings or "All"; no hop splits a list: "0,1" matches no rank.
    return pattern == ALL or pattern == rank


def is_broadcast(dst: Position) -> bool:
    """`All` in either rank: one copy to every matching route, never synchronously (TaskD §3.5)."""
    return ALL in (dst.server_rank, dst.process_rank)


@dataclass(frozen=True, slots=True)
class Decision:
    action: str  # "self", "up", "down" or "reject"
    hops: tuple[Position, ...] = ()
    code: Code = Code.OK


class RouteTable:
    """Where each position below the proxy is reached: TaskD's routeTable (position -> next hop)."""

    def __init__(self, me: Position):
        self.me = me
        self.routes: dict[Position, Position] = {}

    def learn(self, proxy_pos: Position, path: list[Position]) -> None:
        for pos in path:
            self.routes[pos] = proxy_pos

    def forget(self, hop: Position) -> list[Position]:
        """Drop every route through `hop` (a downstream that went away); the positions dropped."""
        gone = [pos for pos, via in self.routes.items() if via == hop or pos == hop]
        for pos in gone:
            del self.routes[pos]
        return gone

    def decide(self, dst: Position, from_upper: bool) -> Decision:
        me = self.me
        if dst == me or (dst.role == "Proxy" and _matches(dst.server_rank, me.server_rank)):
            return Decision("self")
        if dst.level >= PROXY_LEVEL:  # a manager, or another proxy (TaskD's sameLevel): only up
            if from_upper:
                return Decision("reject", code=Code.NO_ROUTE)  # never back to where it came from
            return Decision("up")
        if is_broadcast(dst):
            hops = {via: None for pos, via in self.routes.items() if pos.role == dst.role
                    and _matches(dst.server_rank, pos.server_rank)
                    and (pos.role != "Worker" or _matches(dst.process_rank, pos.process_rank))}
            if not hops:  # TaskD answers 0 for a broadcast that reaches nobody; we do not
                return Decision("reject", code=Code.NO_ROUTE)
            return Decision("down", tuple(hops))
        # A unicast, or a rank list, which TaskD looks up as one key: a list finds no route.
        via = self.routes.get(dst)
        if via is None:
            return Decision("reject", code=Code.NO_ROUTE)
        return Decision("down", (via,))
