"""A stand-in for ClusterD's public-fault gRPC API (``/PubFault/SendPublicFault``).

It speaks the real protocol over a real socket and applies ClusterD's real rules
(rate limit, validation, silent drops, assertion semantics, cache cap), so the
agent's real client can be tested against it.  The rules are described in
``/work/shared/reference/clusterd.md`` §4; this file re-implements them from
that description.

Time: every time-dependent rule (token refill, the 5 s recover delay, add times)
reads the injected ``clock``, so a test can drive it with a fake clock.  The
delayed deletions that ClusterD runs on a background queue are applied lazily
here, at the start of each call and in every query method, so there are no
timer threads to race against.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import grpc

from agent._proto import pubfault_pb2 as pb
from agent._proto import pubfault_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# ClusterD's shipped publicFaultConfiguration.json, plus the entries this project
# adds in its own publicCustomization.json (which replaces the whole file on a
# real cluster, so the shipped lists must be repeated there too).
DEFAULT_CONFIG: dict[str, Any] = {
    "publicFaultCode": {
        "NotHandleFaultCodes": ["200001006", "200001010", "200001011", "200001012", "100001011"],
        "SubHealthFaultCodes": ["010001001", "010001004", "310001005", "210001007", "210001008", "210001009",
                                "110001010", "110001020", "110001021", "010001002",
                                "010011001"],  # npu-node-agent
        "SeparateNPUCodes": ["220001001", "220001002", "220001003", "220001004", "220001005", "220001006",
                             "220001007", "120001001", "020001001", "020001004", "020001003", "120001002",
                             "120001003",
                             "020011001", "020011002"],  # npu-node-agent
        "PreSeparateNPUCodes": ["110001022", "110001023",
                                "010011002"],  # npu-node-agent
    },
    "publicFaultResource": ["CCAE", "fd-online", "pingmesh", "Netmind", "dpcStorage", "dtfsStorage",
                            "npu-node-agent"],  # npu-node-agent
}

# Config list -> level, most severe first: a code listed twice gets the first match.
_LEVELS = (
    ("SeparateNPUCodes", "SeparateNPU"),
    ("PreSeparateNPUCodes", "PreSeparateNPU"),
    ("SubHealthFaultCodes", "SubHealthFault"),
    ("NotHandleFaultCodes", "NotHandleFault"),
)

OK, INVALID_PARAM, INVALID_RATE = 0, 409, 410
OK_INFO = "public fault send successfully"
RATE_INFO = "limiter work by resource failed"

MAX_CACHED_FAULTS = 50_000
MIN_TIME_MS = 1735689600000  # 2025-01-01T00:00:00Z

# ClusterD's regexes are Go RE2 anchored with ^...$, i.e. whole-string matches; we
# use re.fullmatch because Python's `$` would also accept a trailing newline.
# Go's `[a-zA-Z0-9-_.]` is the set alnum, '-', '_', '.'; spelled unambiguously here.
_ID = re.compile(r"[A-Za-z0-9_.-]{8,128}")
_MS = re.compile(r"[0-9]{13}")
_NODE = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?")
# Go's `[\S ]` is "anything but \t \n \f \r" (RE2's \s is exactly [\t\n\f\r ]);
# Python's \S would also exclude Unicode spaces, so spell the Go set out.
_DESCRIPTION = re.compile(r"[^\t\n\f\r]{0,512}")

_FAULT_TYPES = {"NPU", "Node", "Network", "Storage"}
_ASSERTIONS = {"occur", "recover", "once"}

# Like ClusterD's gRPC server: 4 MiB in, 8 MiB out, 64 streams, pings every
# 1 min, and clients may ping every 3 s even without calls (faster -> GOAWAY).
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 4 * 1024 * 1024),
    ("grpc.max_send_message_length", 8 * 1024 * 1024),
    ("grpc.max_concurrent_streams", 64),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 3_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Go servers don't share ports; without this a second stand-in could bind
    # the same port and steal half the connections.
    ("grpc.so_reuseport", 0),
]


@dataclass(frozen=True)
class Received:
    """One SendPublicFault call that reached the handler, and what it answered."""
    at: float
    request: pb.PublicFaultRequest
    code: int
    info: str
    dropped: list[tuple[str, str]]  # (faultId, reason) of silently dropped faults


@dataclass(frozen=True)
class StoredFault:
    """One cache entry: ClusterD keeps a copy per influenced node."""
    fault: pb.Fault
    added_at: float
    level: str


class _TokenBucket:
    """golang.org/x/time/rate.Limiter.Allow(): starts full, refills continuously."""

    def __init__(self, rate_per_s: float, burst: int, now: float):
        self.rate, self.burst = rate_per_s, burst
        self.tokens, self.last = float(burst), now

    def allow(self, now: float) -> bool:
        # max(0, ...): a clock that steps back must not drain the bucket.
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.last) * self.rate)
        self.last = max(self.last, now)
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


def _load_config(config: Mapping[str, Any] | str | os.PathLike) -> tuple[dict[str, str], set[str]]:
    """Return (code -> level, allowed resources) from a config dict or JSON file path."""
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    codes = config.get("publicFaultCode", {})
    levels: dict[str, str] = {}
    for key, level in reversed(_LEVELS):  # least severe first, so more severe lists overwrite
        for code in codes.get(key, []):
            levels[code] = level
    return levels, set(config.get("publicFaultResource", []))


class ClusterdStandIn(pb_grpc.PubFaultServicer):
    """ClusterD's PubFault service on a local port, with knobs for outage tests.

    Restart semantics (``stop()`` then ``start()``), like a real ClusterD pod
    restart: cached faults survive (ClusterD persists them in a ConfigMap),
    while the in-memory delayed deletions are lost and the rate-limit buckets
    start full again.
    """

    def __init__(self, config: Mapping[str, Any] | str | os.PathLike = DEFAULT_CONFIG, *,
                 recover_defer_s: float = 5.0, rate_per_s: float = 1.0, burst: int = 100,
                 clock: Callable[[], float] = time.time, host: str = "127.0.0.1", port: int = 0,
                 node_sns: Mapping[str, str] | None = None, max_cached_faults: int = MAX_CACHED_FAULTS):
        self._levels, self._resources = _load_config(config)
        self._recover_defer_s = recover_defer_s
        self._rate_per_s, self._burst = rate_per_s, burst
        self._clock = clock
        self._host = host
        self.port = port
        # node SN -> node name; ClusterD learns it from the node annotation
        # product-serial-number. Empty by default, so SN-only influences fail.
        self.node_sns: dict[str, str] = dict(node_sns or {})
        self._max_cached = max_cached_faults

        self._lock = threading.Lock()
        self._buckets: dict[str, _TokenBucket] = {}
        self._cache: dict[tuple[str, str, str], StoredFault] = {}
        self._pending: list[tuple[float, tuple[str, str, str]]] = []  # (due, cache key)
        self._requests: list[Received] = []
        self._assertions: list[tuple[str, str]] = []  # (faultId, assertion), accepted faults only
        self._unavailable = False
        self._delay = 0.0
        self._stopped = threading.Event()  # wakes handlers sleeping in delay() on stop()
        self._server: grpc.Server | None = None
        self._reset_buckets()

    # ----- lifecycle -----

    def start(self) -> "ClusterdStandIn":
        if self._server is not None:
            raise RuntimeError("ClusterdStandIn already started")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="clusterd-standin"),
                             options=SERVER_OPTIONS)
        pb_grpc.add_PubFaultServicer_to_server(self, server)
        host = f"[{self._host}]" if ":" in self._host else self._host
        try:
            bound = server.add_insecure_port(f"{host}:{self.port}")
        except RuntimeError as e:  # grpcio raises on bind failure; older versions returned 0
            raise OSError(f"clusterd stand-in cannot bind {host}:{self.port}: {e}") from None
        if bound == 0:
            raise OSError(f"clusterd stand-in cannot bind {host}:{self.port}")
        self.port = bound  # remembered, so a restart comes back on the same port
        self._stopped.clear()
        server.start()
        self._server = server
        return self

    def stop(self, grace: float | None = 0) -> None:
        if self._server is None:
            return
        self._stopped.set()
        # Wait until the listener is really closed, so start() can rebind the port.
        self._server.stop(grace).wait()
        self._server = None
        with self._lock:
            # Whatever was due by now has happened; the rest of the queue dies with the process.
            self._apply_due_deletions(self._clock())
            self._pending.clear()
            self._reset_buckets()

    def __enter__(self) -> "ClusterdStandIn":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----- fault injection -----

    def unavailable(self, on: bool = True) -> None:
        """While on, every call fails with UNAVAILABLE before touching tokens or state."""
        with self._lock:
            self._unavailable = on

    def delay(self, seconds: float) -> None:
        """Sleep this long in each call before processing (to trip client deadlines)."""
        with self._lock:
            self._delay = seconds

    def refill_now(self) -> None:
        with self._lock:
            for bucket in self._buckets.values():
                bucket.tokens = float(bucket.burst)

    # ----- observation -----

    @property
    def requests(self) -> list[Received]:
        with self._lock:
            return list(self._requests)

    def active(self) -> dict[tuple[str, str, str], StoredFault]:
        """Cached faults keyed by (node, resource, faultId), after due deletions."""
        with self._lock:
            self._apply_due_deletions(self._clock())
            return dict(self._cache)

    def assertions(self, fault_id: str) -> list[str]:
        with self._lock:
            return [a for fid, a in self._assertions if fid == fault_id]

    def dropped_faults(self) -> list[tuple[str, str]]:
        with self._lock:
            return [d for r in self._requests for d in r.dropped]

    def wait_for(self, predicate: Callable[["ClusterdStandIn"], Any], timeout: float = 5.0,
                 interval: float = 0.01) -> Any:
        """Poll predicate(self) until it is truthy and return its value; AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate(self)
            if value:
                return value
            if time.monotonic() >= deadline:
                raise AssertionError(f"clusterd stand-in: condition not met within {timeout}s "
                                     f"({len(self.requests)} requests received)")
            time.sleep(interval)

    # ----- the RPC -----

    def SendPublicFault(self, request: pb.PublicFaultRequest, context: grpc.ServicerContext) -> pb.RespStatus:
        with self._lock:
            unavailable, delay = self._unavailable, self._delay
        if unavailable:
            context.abort(grpc.StatusCode.UNAVAILABLE, "clusterd stand-in: unavailable")
        if delay > 0 and self._stopped.wait(delay):
            context.abort(grpc.StatusCode.UNAVAILABLE, "clusterd stand-in: stopped")
        # Like ClusterD, the handler doesn't look at the client's deadline: a call
        # the client already gave up on is still applied.
        with self._lock:
            now = self._clock()
            self._apply_due_deletions(now)
            code, info, dropped = self._process(request, now)
            kept = pb.PublicFaultRequest()
            kept.CopyFrom(request)
            self._requests.append(Received(now, kept, code, info, dropped))
        return pb.RespStatus(code=code, info=info)

    # ----- ClusterD's rules (all called with the lock held) -----

    def _reset_buckets(self) -> None:
        now = self._clock()
        self._buckets = {r: _TokenBucket(self._rate_per_s, self._burst, now) for r in self._resources}

    def _process(self, req: pb.PublicFaultRequest, now: float) -> tuple[int, str, list[tuple[str, str]]]:
        # 1. Rate limit before anything else, so invalid requests spend tokens too.
        bucket = self._buckets.get(req.resource)
        if bucket is None or not bucket.allow(now):
            log.info("clusterd stand-in: 410 for resource %r", req.resource)
            return INVALID_RATE, RATE_INFO, []
        # 2. Request-level validation.
        reason = self._check_request(req)
        if reason:
            return *self._invalid(reason), []
        # 3. Fault-level validation: bad faults are dropped, the rest go on.
        valid, dropped = [], []
        for fault in req.faults:
            reason = self._check_fault(fault)
            if reason:
                log.info("clusterd stand-in: dropped fault %r: %s", fault.faultId, reason)
                dropped.append((fault.faultId, reason))
            else:
                valid.append(fault)
        if not valid:
            return *self._invalid("there is no valid fault"), dropped
        # 4. Apply each fault to each influenced node.
        for fault in valid:
            self._assertions.append((fault.faultId, fault.assertion))
            for influence in fault.influence:
                node = influence.nodeName or self.node_sns[influence.nodeSN]
                self._apply(fault, (node, req.resource, fault.faultId), now)
        return OK, OK_INFO, dropped

    @staticmethod
    def _invalid(reason: str) -> tuple[int, str]:
        return INVALID_PARAM, f"check public fault info failed, error: {reason}"

    def _check_request(self, req: pb.PublicFaultRequest) -> str | None:
        if not _ID.fullmatch(req.id):
            return "invalid id"
        if not _valid_ms(req.timestamp):
            return "invalid timestamp"
        if req.version != "1.0":
            return "invalid version"
        if req.resource not in self._resources:
            return "invalid resource"
        if not 1 <= len(req.faults) <= 100:
            return "invalid faults length"
        return None

    def _check_fault(self, fault: pb.Fault) -> str | None:
        if not _ID.fullmatch(fault.faultId):
            return "invalid fault id"
        if fault.faultType not in _FAULT_TYPES:
            return "invalid fault type"
        if len(fault.faultCode.encode()) != 9:
            return "invalid fault code"
        if fault.faultCode not in self._levels:
            return "invalid fault code, not exist in the configuration file"
        if not _valid_ms(fault.faultTime):
            return "invalid fault time"
        if fault.assertion not in _ASSERTIONS:
            return "invalid fault assertion"
        if len(fault.faultLocation) > 10:
            return "invalid fault location length"
        for key, value in fault.faultLocation.items():
            if len(key.encode()) > 16 or len(value.encode()) > 128:
                return "invalid fault location key or value length"
        if not 1 <= len(fault.influence) <= 1000:
            return "invalid influence length"
        for influence in fault.influence:  # one bad entry drops the whole fault
            reason = self._check_influence(influence)
            if reason:
                return reason
        if not _DESCRIPTION.fullmatch(fault.description):
            return "invalid fault description"
        return None

    def _check_influence(self, influence: pb.PubFaultInfo) -> str | None:
        if influence.nodeName:
            if not _NODE.fullmatch(influence.nodeName):
                return "invalid node name"
        elif influence.nodeSN not in self.node_sns:
            return "invalid node name or node sn"
        ids = list(influence.deviceIds)
        if not 1 <= len(ids) <= 32:
            return "invalid device id length"
        if len(set(ids)) != len(ids):
            return "invalid device id, duplicate ids"
        if any(not 0 <= i <= 31 for i in ids):
            return "invalid device id"
        return None

    def _apply(self, fault: pb.Fault, key: tuple[str, str, str], now: float) -> None:
        stored = self._cache.get(key)
        if fault.assertion == "occur":
            if stored is None:  # an existing occur is kept as is: time and code not updated
                self._add(fault, key, now)
        elif fault.assertion == "recover":
            if stored is None:
                # Recover before occur: an occur arriving within the window is still removed.
                self._pending.append((now + self._recover_defer_s, key))
            elif now - stored.added_at >= self._recover_defer_s:
                del self._cache[key]
            else:
                # Too young: every fault stays visible for at least the defer time.
                self._pending.append((stored.added_at + self._recover_defer_s, key))
        elif fault.assertion == "once" and stored is None:
            self._add(fault, key, now)
            self._pending.append((now + self._recover_defer_s, key))

    def _add(self, fault: pb.Fault, key: tuple[str, str, str], now: float) -> None:
        if len(self._cache) >= self._max_cached:  # ClusterD only logs it; the reply stays 0
            log.warning("clusterd stand-in: cache full (%d), fault %r on %r not added",
                        self._max_cached, fault.faultId, key[0])
            return
        kept = pb.Fault()
        kept.CopyFrom(fault)
        kept.assertion = "occur"  # `once` is stored as an occur
        self._cache[key] = StoredFault(kept, now, self._levels[fault.faultCode])

    def _apply_due_deletions(self, now: float) -> None:
        due = [key for when, key in self._pending if when <= now]
        if due:
            self._pending = [(when, key) for when, key in self._pending if when > now]
            for key in due:
                self._cache.pop(key, None)


def _valid_ms(value: int) -> bool:
    """ClusterD: the decimal string is 13 digits (milliseconds) and not before 2025-01-01."""
    return bool(_MS.fullmatch(str(value))) and value >= MIN_TIME_MS
