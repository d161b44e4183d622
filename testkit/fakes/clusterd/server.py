"""A stand-in for ClusterD's public-fault gRPC API (``/PubFault/SendPublicFault``).

It speaks the real protocol over a real socket and applies ClusterD's rules (rate
limit, validation, silent drops, assertion semantics, cache cap, the delete queue
and the ConfigMap persistence), so the agent's real client can be tested
against it, failure modes included.

The cache holds one entry per (node, resource, faultId); its add time is the
whole second of the insert.  Per key:

* ``occur`` adds the entry if the key is absent; if present, nothing happens
  (no update, nothing queued).
* ``recover`` deletes at once if the entry is at least 5 whole seconds old;
  a younger entry gets a deletion queued for add time + 5; an absent key gets
  one queued for floor(now) + 5, so an occur arriving before it runs is removed.
* ``once`` on an absent key adds it and queues a deletion for floor(now) + 5;
  on a present key nothing happens.

A queued deletion is only (deadline, key) and removes whatever entry holds the
key when it runs.  All deletions share one FIFO (every sender, resource and
node), drained by one loop: idle, it polls every 0.5 s; a head whose deadline
is <= floor(now) is deleted at once; otherwise the loop sleeps
deadline - floor(now) whole seconds and then deletes it.  A deletion therefore
lands at deadline + the sub-second phase at which the loop looked at the head;
entries drained back to back keep that phase, and a due entry waits behind a
head with a later deadline.

Persistence: after each accepted request and each queued deletion, a writer
stores a snapshot of the whole cache (without assertion, add time, location
and description) at once if idle, then sleeps ``write_interval_s``; changes
meanwhile are written together when the sleep ends.  Above 4500 cached faults
the stored list is no longer updated.  On start, once ``reload_delay_s`` after
serving begins, the stored entries are inserted as occur with the reload time
as add time (replacing an entry of the same key); requests before that see a
cache without them.  The writer starts with the reload, so a notify before it
is written then and cannot overwrite the stored entries before they are read.
A restart loses the queue, the cache changes not yet written, and the limiter
buckets.

Where the snapshot lives: by default in the stand-in itself.  Given a
Kubernetes API stand-in (``kube``), where ClusterD keeps it: the ConfigMap
``cluster-system/statistic-fault-info`` (label ``mc-statistic-fault=true``),
so anything reading it through the API sees what ClusterD would show.  A write
replaces the ConfigMap's whole ``data`` (update, or create if missing) with
two JSON strings:

* ``PublicFaults``: node name -> one entry per cached fault of that node
  (nodes without faults absent), each with ``resource``, ``devIds``,
  ``faultId``, ``type``, ``faultCode``, ``level``, ``faultTime`` (the
  request's, in ms), every field left out when empty or zero (Go's omitempty);
* ``FaultNum``: ``{"publicFaultNum": N}``, N the number of cached faults.

Above 4500 faults the write is a patch of ``FaultNum`` and a ``Description``
saying the detail is incomplete; ``PublicFaults`` keeps its last content (a
missing ConfigMap is then not created).  Back at or under 4500, the full write
replaces ``data`` again and the ``Description`` is gone.  The reload reads the
ConfigMap: missing, without ``PublicFaults``, or holding JSON that ClusterD's
decoder rejects (a wrong type anywhere, NaN, trailing data), it loads nothing;
an entry's missing field loads as empty or zero.  The stand-in also keeps
ClusterD's pod there (``mindx-dl``, label ``app=clusterd``, see
``_ClusterdPod``): a stop is its container dying, a start its restart in the
same pod, ``replace_pod`` a new pod.

In front of the handler, like ClusterD's server: a unary-call limiter of 1,000
calls/s (burst 1,000) that every unary method but HealthCheck shares, answered
with gRPC UNKNOWN "qps exceeded, method=..." (``other_calls_per_s`` spends part
of it on the cluster's other clients), and, with ``listener_cap``, the
connection-limited listener (1,024 connections in all, 512 per client IP; see
``listener.py``).

Time: every rule reads the injected ``clock``.  The background loops (delete
queue, writer, reload) are a discrete-event simulation that is advanced to the
clock's now at the start of every call and every query, so a test can drive it
with a fake clock and there are no timer threads to race against.  Events at
the same instant as a request happen before it.  Each event happens at its own
simulated time whenever the simulation reaches it, so advancing more often
changes nothing but when its effects become visible outside: with ``kube`` the
ConfigMap is read by others without asking the stand-in, so a ticker also
advances it every ``advance_every_s`` (with a fake clock, it only catches up
with the test's moves).  A change a test makes to the ConfigMap directly is
read by the next reload the simulation runs; a start runs its reload (with no
``reload_delay_s``) before it returns.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import threading
import time
import uuid
from collections import deque
from concurrent import futures
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Mapping

import grpc

from agent._proto import pubfault_pb2 as pb
from agent._proto import pubfault_pb2_grpc as pb_grpc
from testkit.fakes.clusterd.listener import PER_IP_LIMIT, TOTAL_LIMIT, ConnectionCap, CoreCap

CLUSTERD_LISTENER_CAP = (TOTAL_LIMIT, PER_IP_LIMIT)
from testkit.wait import wait_until

if TYPE_CHECKING:
    from testkit.fakes.kube import KubeStandIn

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
RECOVER_DELAY_S = 5  # whole seconds: every fault stays cached at least this long
IDLE_POLL_S = 0.5  # the delete loop's poll while its queue is empty
MAX_PERSISTED_FAULTS = 4500  # above this the persisted list stays stale
UNARY_QPS = 1000.0  # ClusterD's limitQPS interceptor: one bucket for every unary method but HealthCheck
METHOD = "/PubFault/SendPublicFault"

# Where ClusterD keeps its cache (with ``kube``): names, label and data keys as ClusterD writes them.
CONFIGMAP_NAMESPACE, CONFIGMAP_NAME = "cluster-system", "statistic-fault-info"
CONFIGMAP_LABELS = {"mc-statistic-fault": "true"}
PUBLIC_FAULTS_KEY, FAULT_NUM_KEY, DESCRIPTION_KEY = "PublicFaults", "FaultNum", "Description"
TOO_MANY_FAULTS = ("The current total number of faults is too large, "
                   "and only a portion of the detailed fault data is displayed")
# ClusterD's Deployment: one replica in mindx-dl, pods labelled app=clusterd, one container.
POD_NAMESPACE, POD_LABELS, CONTAINER = "mindx-dl", {"app": "clusterd"}, "clusterd"

Key = tuple[str, str, str]  # (node, resource, faultId)

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
    # The keys cached once it was applied. Between requests the cache only loses keys (deletions) or
    # gains reloaded ones, so these show every key a sender made ClusterD hold, however briefly.
    cached: frozenset[Key] = frozenset()


@dataclass(frozen=True)
class StoredFault:
    """One cache entry: ClusterD keeps a copy per influenced node."""
    fault: pb.Fault
    added_at: int  # whole Unix seconds
    level: str
    device_ids: tuple[int, ...] = ()  # this node's influence


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

    ``stop()`` then ``start()`` is a ClusterD pod restart: the new process
    starts with an empty cache, reloads what the ConfigMap holds, and has lost
    its delete queue, unwritten changes and rate-limit buckets.  With ``kube``
    the pod shows it: ``stop()`` is the container dying, ``start()`` its restart
    (restartCount + 1), ``replace_pod()`` a new pod (a rollout or reschedule).
    """

    def __init__(self, config: Mapping[str, Any] | str | os.PathLike = DEFAULT_CONFIG, *,
                 rate_per_s: float = 1.0, burst: int = 100, clock: Callable[[], float] = time.time,
                 host: str = "127.0.0.1", port: int = 0, node_sns: Mapping[str, str] | None = None,
                 max_cached_faults: int = MAX_CACHED_FAULTS, poll_phase: float | None = None,
                 write_interval_s: float = 1.0, reload_delay_s: float = 0.0, unary_qps: float = UNARY_QPS,
                 other_calls_per_s: float = 0.0,
                 listener_cap: tuple[int, int | None] | None = None, cap_in_grpc: bool = False,
                 kube: KubeStandIn | None = None, max_persisted_faults: int = MAX_PERSISTED_FAULTS,
                 advance_every_s: float = 0.1):
        """``listener_cap``: (total, per client IP or None) connections, e.g. (1024, 512) as ClusterD;
        None: no limit and no relay (the gRPC server listens itself). ``cap_in_grpc``: the total cap
        is kept by gRPC's own listener, without the relay (no per-IP cap; counts sampled, see
        ``CoreCap``): for a thousand clients, which the relay cannot keep up with.

        ``kube``: keep the saved cache in ConfigMap ``cluster-system/statistic-fault-info`` and the
        pod in ``mindx-dl`` there (the namespaces are made here, as the installation does), and
        advance the simulation every ``advance_every_s`` while serving (see the module docstring).
        ``max_persisted_faults``: the count above which the saved list goes stale (4500 in ClusterD)."""
        if cap_in_grpc and (listener_cap is None or listener_cap[1] is not None):
            raise ValueError("cap_in_grpc keeps a total cap only: listener_cap=(total, None)")
        self._cap_in_grpc = cap_in_grpc
        self._levels, self._resources = _load_config(config)
        self._unary_qps = unary_qps
        self._other_calls_per_s = other_calls_per_s  # other clients' unary calls, taken from the same bucket
        self._listener_cap = listener_cap
        self._cap: ConnectionCap | CoreCap | None = None
        self.qps_exceeded = 0
        self._rate_per_s, self._burst = rate_per_s, burst
        self._clock = clock
        self._host = host
        self.port = port
        # node SN -> node name; ClusterD learns it from the node annotation
        # product-serial-number. Empty by default, so SN-only influences fail.
        self.node_sns: dict[str, str] = dict(node_sns or {})
        self._max_cached = max_cached_faults
        if poll_phase is not None and not 0 <= poll_phase < 1:
            raise ValueError("poll_phase is a fraction of a second in [0, 1)")
        self._poll_phase = poll_phase
        self._write_interval_s = write_interval_s
        self._reload_delay_s = reload_delay_s
        self._max_persisted = max_persisted_faults
        self._kube = kube
        self._pod = _ClusterdPod(kube, host) if kube is not None else None
        self._advance_every_s = advance_every_s
        self._ticker: tuple[threading.Thread, threading.Event] | None = None
        if kube is not None:
            for namespace in (CONFIGMAP_NAMESPACE, POD_NAMESPACE):
                kube.add_namespace(namespace)

        self._lock = threading.Lock()
        self._requests: list[Received] = []
        self._assertions: list[tuple[str, str]] = []  # (faultId, assertion), accepted faults only
        self._unavailable = False
        self._delay = 0.0
        self._stopped = threading.Event()  # wakes handlers sleeping in delay() on stop()
        self._server: grpc.Server | None = None
        self._generation = 0  # one per process, so a handler from a previous one can't touch this one
        # The ConfigMap without ``kube``: outlives the process.
        self._persisted: dict[Key, dict[str, Any]] = {}
        # The process (see _boot and _die).
        self._running = False
        self._buckets: dict[str, _TokenBucket] = {}
        self._unary = _TokenBucket(max(0.0, unary_qps - other_calls_per_s), int(unary_qps), 0.0)
        self._cache: dict[Key, StoredFault] = {}
        self._queue: deque[tuple[int, Key]] = deque()  # (deadline, key), head first
        self._drain_at = 0.0  # when the delete loop next acts
        self._drain_sleeping = False  # True: at _drain_at it wakes and deletes the head; False: it looks at the head
        self._reload_at: float | None = None  # pending reload
        self._writer_live = False  # the writer starts with the reload; notifies before it wait in the flag
        self._writer_wake: float | None = None  # end of the writer's sleep; None: idle
        self._write_pending = False  # the 1-slot notify flag

    @property
    def address(self) -> str:
        return f"[{self._host}]:{self.port}" if ":" in self._host else f"{self._host}:{self.port}"

    # ----- lifecycle -----

    def start(self, persisted: bool = True, new_pod: bool = False) -> "ClusterdStandIn":
        """Start serving (on the same port after a stop).  ``persisted=False``: the ConfigMap is gone.
        With ``kube``: the first start creates the pod; a later one restarts its container, or with
        ``new_pod`` deletes it and runs in a new pod."""
        if self._server is not None:
            raise RuntimeError("ClusterdStandIn already started")
        relay = self._listener_cap is not None and not self._cap_in_grpc
        options = SERVER_OPTIONS
        if self._cap_in_grpc:
            options = [*SERVER_OPTIONS, CoreCap.option(self._listener_cap[0])]
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="clusterd-standin"),
                             options=options)
        pb_grpc.add_PubFaultServicer_to_server(self, server)
        backend = "127.0.0.1:0" if relay else self.address
        try:
            bound = server.add_insecure_port(backend)
        except RuntimeError as e:  # grpcio raises on bind failure; older versions returned 0
            raise OSError(f"clusterd stand-in cannot bind {backend}: {e}") from None
        if bound == 0:
            raise OSError(f"clusterd stand-in cannot bind {backend}")
        if not relay:
            self.port = bound  # remembered, so a restart comes back on the same port
            if self._cap_in_grpc:
                self._cap = CoreCap(bound)
        else:
            total, per_ip = self._listener_cap
            self._cap = ConnectionCap(self._host, bound, self.port, total, per_ip).start()
            self.port = self._cap.port
        with self._lock:
            now = self._clock()
            if not persisted:
                self._forget_saved()
            self._boot(now)
        self._stopped.clear()
        server.start()
        self._server = server
        if self._pod is not None:
            self._pod.running(now, new_pod)
            stop = threading.Event()
            ticker = threading.Thread(target=self._tick, args=(stop,), name="clusterd-standin-ticker", daemon=True)
            ticker.start()
            self._ticker = ticker, stop
        return self

    def stop(self, grace: float | None = 0) -> None:
        """ClusterD goes down; its listener is closed (``start()`` brings a new process on the same port)."""
        if self._server is None:
            return
        self._stopped.set()
        if self._ticker is not None:
            ticker, stop = self._ticker
            stop.set()
            ticker.join()
            self._ticker = None
        if self._cap is not None:  # the listener and every connection close with the process
            self._cap.stop()
            self._cap = None
        # Wait until the listener is really closed, so start() can rebind the port.
        self._server.stop(grace).wait()
        self._server = None
        with self._lock:
            now = self._clock()
            self._die(now)
        if self._pod is not None:
            self._pod.terminated(now)

    def restart(self, persisted: bool = True, new_pod: bool = False) -> "ClusterdStandIn":
        self.stop()
        return self.start(persisted, new_pod)

    def replace_pod(self, persisted: bool = True) -> "ClusterdStandIn":
        """ClusterD moves to a new pod (a rollout, an eviction): the old one is deleted, the new one has
        a new name and uid and restartCount 0."""
        return self.restart(persisted, new_pod=True)

    def forget_all(self) -> None:
        """ClusterD restarted with nothing saved, behind a proxy: the clients' connections stay up.
        With ``kube`` its container restarts in the same pod."""
        with self._lock:
            now = self._clock()
            self._die(now)
            self._forget_saved()
            self._boot(now)
        if self._pod is not None:
            self._pod.terminated(now)
            self._pod.running(now, new_pod=False)

    def _tick(self, stop: threading.Event) -> None:
        """Advance the simulation now and then, so the ConfigMap follows the clock for readers that only
        look at the Kubernetes API."""
        while not stop.wait(self._advance_every_s):
            try:
                with self._lock:
                    self._advance(self._clock())
            except Exception:  # noqa: BLE001 - a bug here must not stop the stand-in's clock silently
                log.exception("clusterd stand-in: advancing the simulation failed")

    def _boot(self, now: float) -> None:
        """A new ClusterD process starts serving at ``now`` (lock held)."""
        self._generation += 1
        self._running = True
        self._cache, self._queue = {}, deque()
        self._drain_at, self._drain_sleeping = self._first_poll(now), False
        self._reload_at = now + self._reload_delay_s
        self._writer_live, self._writer_wake, self._write_pending = False, None, False
        # Limiters are built fresh by the new process, full.
        self._buckets = {r: _TokenBucket(self._rate_per_s, self._burst, now) for r in self._resources}
        self._unary = _TokenBucket(max(0.0, self._unary_qps - self._other_calls_per_s), int(self._unary_qps), now)
        # A reload due now reads the saved copy as it is at this start, not whenever the next call comes.
        self._advance(now)

    def _die(self, now: float) -> None:
        """The process dies at ``now``: due events happen, the rest and unwritten changes are lost (lock held)."""
        self._advance(now)
        self._running = False
        self._cache, self._queue = {}, deque()
        self._reload_at, self._writer_wake, self._write_pending = None, None, False

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

    @property
    def connections(self) -> tuple[int, int, int]:
        """(open now, the most at once since reset_peak(), refused at the cap so far); zeros without a cap."""
        cap = self._cap
        if cap is None:
            return 0, 0, 0
        open_now = cap.open  # first: a sampled count updates the peak as it is read
        return open_now, cap.peak, cap.refused

    def reset_peak(self) -> None:
        if self._cap is not None:
            self._cap.reset_peak()

    def refill_now(self) -> None:
        with self._lock:
            for bucket in self._buckets.values():
                bucket.tokens = float(bucket.burst)

    def lose_persistence(self) -> None:
        """The ConfigMap is deleted; the running cache is untouched (the next write recreates it)."""
        with self._lock:
            self._advance(self._clock())
            self._forget_saved()

    # ----- observation -----

    @property
    def requests(self) -> list[Received]:
        with self._lock:
            return list(self._requests)

    def active(self) -> dict[Key, StoredFault]:
        """Cached faults keyed by (node, resource, faultId), now; empty while stopped."""
        with self._lock:
            self._advance(self._clock())
            return dict(self._cache)

    def holds(self, node: str, device: int, code: str | None = None) -> bool:
        """Whether a cached fault of ``node`` names physical ``device`` (with ``code``, if given)."""
        return any(key[0] == node and device in stored.device_ids
                   and (code is None or stored.fault.faultCode == code)
                   for key, stored in self.active().items())

    def queue(self) -> list[tuple[int, Key]]:
        """Pending deletions (deadline, key), head first."""
        with self._lock:
            self._advance(self._clock())
            return list(self._queue)

    def persisted(self) -> dict[Key, dict[str, Any]]:
        """What the ConfigMap holds now, per key: the stored fields only (with ``kube``: what a reload
        would load from it, a field left out as empty or zero; empty if it would load nothing)."""
        with self._lock:
            self._advance(self._clock())
            if self._kube is not None:
                return self._read_configmap(quiet=True)
            return {key: dict(rec, deviceIds=list(rec["deviceIds"])) for key, rec in self._persisted.items()}

    @property
    def pod_name(self) -> str | None:
        """The name of ClusterD's pod in the kube stand-in (None before the first start or without ``kube``)."""
        return None if self._pod is None else self._pod.name

    def assertions(self, fault_id: str) -> list[str]:
        with self._lock:
            return [a for fid, a in self._assertions if fid == fault_id]

    def dropped_faults(self) -> list[tuple[str, str]]:
        with self._lock:
            return [d for r in self._requests for d in r.dropped]

    def wait_for(self, predicate: Callable[["ClusterdStandIn"], Any], timeout: float = 5.0,
                 interval: float = 0.01) -> Any:
        """Poll predicate(self) until it is truthy and return its value; AssertionError on timeout."""
        return wait_until(lambda: predicate(self), timeout,
                          lambda: f"a clusterd stand-in condition ({len(self.requests)} requests received)", interval)

    # ----- the RPC -----

    def SendPublicFault(self, request: pb.PublicFaultRequest, context: grpc.ServicerContext) -> pb.RespStatus:
        with self._lock:
            unavailable, delay, generation = self._unavailable, self._delay, self._generation
            if not unavailable:
                admitted = self._unary_call(self._clock())
        if unavailable:
            context.abort(grpc.StatusCode.UNAVAILABLE, "clusterd stand-in: unavailable")
        if not admitted:  # ClusterD's interceptor returns a Go error: the client sees UNKNOWN
            context.abort(grpc.StatusCode.UNKNOWN, f"qps exceeded, method={METHOD}")
        if delay > 0 and self._stopped.wait(delay):
            context.abort(grpc.StatusCode.UNAVAILABLE, "clusterd stand-in: stopped")
        # Like ClusterD, the handler doesn't look at the client's deadline: a call
        # the client already gave up on is still applied.
        with self._lock:
            if not self._running or self._generation != generation:  # its process died meanwhile
                context.abort(grpc.StatusCode.UNAVAILABLE, "clusterd stand-in: stopped")
            now = self._clock()
            self._advance(now)
            code, info, dropped = self._process(request, now)
            if code == OK:
                self._notify(now)
            kept = pb.PublicFaultRequest()
            kept.CopyFrom(request)
            self._requests.append(Received(now, kept, code, info, dropped, frozenset(self._cache)))
        return pb.RespStatus(code=code, info=info)

    # ----- ClusterD's rules (all called with the lock held) -----

    def _unary_call(self, now: float) -> bool:
        """The interceptor's bucket (what the cluster's other clients take from it is not refilled)."""
        if self._unary.allow(now):
            return True
        self.qps_exceeded += 1
        return False

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
                self._apply(fault, (node, req.resource, fault.faultId), tuple(influence.deviceIds), now)
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

    def _apply(self, fault: pb.Fault, key: Key, device_ids: tuple[int, ...], now: float) -> None:
        second = math.floor(now)
        stored = self._cache.get(key)
        if fault.assertion == "occur":
            if stored is None:  # an existing occur is kept as is: time and code not updated
                self._add(fault, key, device_ids, second)
        elif fault.assertion == "recover":
            if stored is None:
                # Not a no-op: an occur of this key arriving before the deletion runs is removed by it.
                self._queue.append((second + RECOVER_DELAY_S, key))
            elif second - stored.added_at >= RECOVER_DELAY_S:
                del self._cache[key]
            else:  # too young: every fault stays visible for the recover delay
                self._queue.append((stored.added_at + RECOVER_DELAY_S, key))
        elif fault.assertion == "once" and stored is None:
            self._add(fault, key, device_ids, second)
            self._queue.append((second + RECOVER_DELAY_S, key))

    def _add(self, fault: pb.Fault, key: Key, device_ids: tuple[int, ...], second: int,
             level: str | None = None) -> None:
        if key not in self._cache and len(self._cache) >= self._max_cached:
            # ClusterD only logs it; the reply stays 0
            log.warning("clusterd stand-in: cache full (%d), fault %r on %r not added",
                        self._max_cached, fault.faultId, key[0])
            return
        kept = pb.Fault()
        kept.CopyFrom(fault)
        kept.assertion = "occur"  # `once` is stored as an occur
        # A reloaded entry keeps its saved level, even an empty one (the code is not looked up again).
        self._cache[key] = StoredFault(kept, second, self._levels[fault.faultCode] if level is None else level,
                                       device_ids)

    # ----- the background loops, as a discrete-event simulation (lock held) -----

    def _first_poll(self, start: float) -> float:
        if self._poll_phase is None:
            return start
        first = math.floor(start) + self._poll_phase
        return first if first >= start else first + 1

    def _advance(self, now: float) -> None:
        """Run every background event due by ``now``, earliest first."""
        if not self._running:
            return
        while True:
            # Same-instant ties go in a fixed order: writer, reload, delete loop.
            events = [(self._drain_at, 2, self._drain)]
            if self._writer_wake is not None:
                events.append((self._writer_wake, 0, self._writer_woke))
            if self._reload_at is not None:
                events.append((self._reload_at, 1, self._reload))
            at, _, handle = min(events, key=lambda e: e[:2])
            if at > now:
                return
            handle(at, now)

    def _drain(self, at: float, now: float) -> None:
        """The delete loop acts at ``at``: wakes from a sleep, or looks at the head."""
        if self._drain_sleeping:
            self._drain_sleeping = False
            self._delete_head(at)  # then looks at the next head at once (same _drain_at)
        elif not self._queue:
            # Only requests push, and none comes before `now`: the idle polls up to now find nothing.
            self._drain_at = at + IDLE_POLL_S * (math.floor((now - at) / IDLE_POLL_S) + 1)
        elif self._queue[0][0] <= math.floor(at):
            self._delete_head(at)
        else:
            # Whole seconds, measured from the whole second: it wakes at deadline + this instant's phase.
            self._drain_at = at + (self._queue[0][0] - math.floor(at))
            self._drain_sleeping = True

    def _delete_head(self, at: float) -> None:
        _, key = self._queue.popleft()
        self._cache.pop(key, None)  # whatever entry holds the key now
        self._notify(at)

    def _notify(self, at: float) -> None:
        if self._writer_live and self._writer_wake is None:
            self._write(at)
        else:
            self._write_pending = True

    def _writer_woke(self, at: float, now: float) -> None:
        if self._write_pending:
            self._write_pending = False
            self._write(at)
        else:
            self._writer_wake = None

    def _write(self, at: float) -> None:
        if self._kube is not None:
            self._write_configmap()
        elif len(self._cache) <= self._max_persisted:
            self._persisted = {key: _persisted_record(key, stored) for key, stored in self._cache.items()}
        self._writer_wake = at + self._write_interval_s

    def _reload(self, at: float, now: float) -> None:
        self._reload_at = None
        saved = self._persisted if self._kube is None else self._read_configmap()
        for key, rec in saved.items():
            fault = pb.Fault(faultId=rec["faultId"], faultType=rec["faultType"], faultCode=rec["faultCode"],
                             faultTime=rec["faultTime"], assertion="occur",
                             influence=[pb.PubFaultInfo(nodeName=rec["node"], deviceIds=rec["deviceIds"])])
            self._add(fault, key, tuple(rec["deviceIds"]), math.floor(at), rec["level"])
        self._writer_live = True
        self._writer_woke(at, now)  # a notify that came before the reload is written now

    # ----- the saved copy in the kube stand-in (lock held) -----

    def _forget_saved(self) -> None:
        if self._kube is None:
            self._persisted.clear()
        else:
            self._kube.delete("ConfigMap", CONFIGMAP_NAMESPACE, CONFIGMAP_NAME)

    def _write_configmap(self) -> None:
        """ClusterD's write: the whole data map, or above the limit a patch of the count alone."""
        count = len(self._cache)
        fault_num = json.dumps({"publicFaultNum": count}, separators=(",", ":"))
        current = self._kube.get("ConfigMap", CONFIGMAP_NAMESPACE, CONFIGMAP_NAME)
        if count > self._max_persisted:
            log.info("clusterd stand-in: %d public faults, over %d: only %s and %s of %s/%s are written",
                     count, self._max_persisted, FAULT_NUM_KEY, DESCRIPTION_KEY, CONFIGMAP_NAMESPACE, CONFIGMAP_NAME)
            if current is None:  # a patch does not create
                log.warning("clusterd stand-in: patching ConfigMap %s/%s failed: not found",
                            CONFIGMAP_NAMESPACE, CONFIGMAP_NAME)
                return
            wanted = dict(current, data={**(current.get("data") or {}), FAULT_NUM_KEY: fault_num,
                                         DESCRIPTION_KEY: TOO_MANY_FAULTS})
        else:
            wanted = {"kind": "ConfigMap",
                      "metadata": {"name": CONFIGMAP_NAME, "namespace": CONFIGMAP_NAMESPACE,
                                   "labels": dict(CONFIGMAP_LABELS)},
                      "data": {PUBLIC_FAULTS_KEY: _public_faults_json(self._cache), FAULT_NUM_KEY: fault_num}}
        if current is not None and _content(current) == _content(wanted):
            return  # the API server stores nothing for an update that changes nothing
        self._kube.put(wanted)

    def _read_configmap(self, quiet: bool = False) -> dict[Key, dict[str, Any]]:
        """ClusterD's load: the saved entries, or nothing (said why) if the ConfigMap or its key is missing
        or its JSON does not decode."""
        where = f"{CONFIGMAP_NAMESPACE}/{CONFIGMAP_NAME}"
        say = log.debug if quiet else log.warning
        cm = self._kube.get("ConfigMap", CONFIGMAP_NAMESPACE, CONFIGMAP_NAME)
        if cm is None:
            (log.debug if quiet else log.info)("clusterd stand-in: ConfigMap %s not found, nothing to reload", where)
            return {}
        text = (cm.get("data") or {}).get(PUBLIC_FAULTS_KEY)
        if text is None:
            say("clusterd stand-in: ConfigMap %s has no key %r, nothing reloaded", where, PUBLIC_FAULTS_KEY)
            return {}
        try:
            saved = _parse_public_faults(text)
        except ValueError as e:
            say("clusterd stand-in: %s of ConfigMap %s does not decode (%s), nothing reloaded",
                PUBLIC_FAULTS_KEY, where, e)
            return {}
        if not quiet:
            log.info("clusterd stand-in: reloaded %d public fault(s) from ConfigMap %s", len(saved), where)
        return saved


class _ClusterdPod:
    """ClusterD's pod in the kube stand-in, as the kubelet reports it: phase Running, one container
    ``clusterd`` whose death makes the pod not ready and whose restart counts in ``restartCount``.

    No readiness probe is modelled: the container is ready once it runs.  Times are the stand-in's
    clock, RFC 3339 UTC in whole seconds (the pod's creationTimestamp is the kube stand-in's own)."""

    HASH = "5c8d7b9f64"  # the ReplicaSet's pod-template-hash; pod names are clusterd-<hash>-<5 characters>
    EXIT = {"exitCode": 137, "reason": "Error"}  # killed: what a crash or a kill leaves
    _SUFFIX = "bcdfghjklmnpqrstvwxz2456789"  # the alphabet of generated names

    def __init__(self, kube: KubeStandIn, host: str):
        self._kube, self._host = kube, host
        self._replica_set_uid = str(uuid.uuid4())
        self.name: str | None = None
        self._created = self._transition = ""
        self._restarts = 0
        self._container_id = ""
        self._state: dict[str, Any] = {}
        self._last_state: dict[str, Any] = {}

    def running(self, now: float, new_pod: bool) -> None:
        """The container starts: in a new pod the first time or with ``new_pod``, else restarted in this one."""
        stamp = _rfc3339(now)
        if self.name is None or new_pod:
            if self.name is not None:
                self._kube.delete("Pod", POD_NAMESPACE, self.name)
            suffix = "".join(secrets.choice(self._SUFFIX) for _ in range(5))
            self.name = f"clusterd-{self.HASH}-{suffix}"
            self._created, self._restarts, self._last_state = stamp, 0, {}
        else:
            self._restarts += 1
            self._last_state = dict(self._state)  # the termination
        self._container_id = f"containerd://{secrets.token_hex(32)}"
        self._state = {"running": {"startedAt": stamp}}
        self._transition = stamp
        self._kube.put(self._object())

    def terminated(self, now: float) -> None:
        """The container died: the pod stays, not ready."""
        if "running" not in self._state:
            return
        stamp = _rfc3339(now)
        self._state = {"terminated": {**self.EXIT, "startedAt": self._state["running"]["startedAt"],
                                      "finishedAt": stamp, "containerID": self._container_id}}
        self._transition = stamp
        self._kube.put(self._object())

    def _object(self) -> dict[str, Any]:
        ready = "running" in self._state

        def condition(kind: str, status: bool, since: str) -> dict[str, Any]:
            found = {"type": kind, "status": "True" if status else "False", "lastProbeTime": None,
                     "lastTransitionTime": since}
            if not status:
                found.update(reason="ContainersNotReady", message=f"containers with unready status: [{CONTAINER}]")
            return found

        return {
            "kind": "Pod",
            "metadata": {
                "name": self.name, "namespace": POD_NAMESPACE, "labels": {**POD_LABELS, "pod-template-hash": self.HASH},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"clusterd-{self.HASH}",
                                     "uid": self._replica_set_uid, "controller": True, "blockOwnerDeletion": True}]},
            "spec": {"containers": [{"name": CONTAINER, "image": "clusterd:stand-in"}], "restartPolicy": "Always",
                     "serviceAccountName": "clusterd", "nodeSelector": {"masterselector": "dls-master-node"}},
            "status": {
                "phase": "Running", "startTime": self._created, "podIP": self._host,
                "conditions": [condition("Initialized", True, self._created),
                               condition("Ready", ready, self._transition),
                               condition("ContainersReady", ready, self._transition),
                               condition("PodScheduled", True, self._created)],
                "containerStatuses": [{
                    "name": CONTAINER, "ready": ready, "started": ready, "restartCount": self._restarts,
                    "state": self._state, "lastState": self._last_state, "image": "clusterd:stand-in",
                    "imageID": f"clusterd@sha256:{'0' * 64}", "containerID": self._container_id}]}}


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _content(cm: dict[str, Any]) -> tuple:
    """What an update of a ConfigMap sets (without what the API server assigns)."""
    meta = {k: v for k, v in (cm.get("metadata") or {}).items()
            if k not in ("uid", "resourceVersion", "creationTimestamp")}
    return meta, cm.get("data") or {}, cm.get("binaryData") or {}


def _public_faults_json(cache: Mapping[Key, StoredFault]) -> str:
    """``PublicFaults`` as ClusterD marshals it: nodes in key order, entry fields in the order its Go struct
    declares them, each left out when empty or zero (omitempty), compact, UTF-8 unescaped.  A node's entries
    are in cache order here; ClusterD's come in Go map order, which is arbitrary."""
    nodes: dict[str, list[dict[str, Any]]] = {}
    for (node, resource, fault_id), stored in cache.items():
        entry = {"resource": resource, "devIds": list(stored.device_ids), "faultId": fault_id,
                 "type": stored.fault.faultType, "faultCode": stored.fault.faultCode, "level": stored.level,
                 "faultTime": stored.fault.faultTime}
        nodes.setdefault(node, []).append({k: v for k, v in entry.items() if v})
    return json.dumps(dict(sorted(nodes.items())), separators=(",", ":"), ensure_ascii=False)


_ENTRY_STRINGS = {"resource": "resource", "faultId": "faultId", "type": "faultType", "faultCode": "faultCode",
                  "level": "level"}  # PublicFaults field -> record field


def _parse_public_faults(text: str) -> dict[Key, dict[str, Any]]:
    """``PublicFaults`` decoded as ClusterD's Go decoder does (node -> list of entries), as records keyed like
    the cache; ValueError for anything it rejects.  ``null`` is an empty map, list or field; unknown fields
    are ignored; a later entry of the same key replaces an earlier one."""
    def no_constants(name: str):
        raise ValueError(f"{name} is not JSON")

    decoded = json.loads(text, parse_constant=no_constants)  # json.JSONDecodeError is a ValueError
    if decoded is None:
        return {}
    if not isinstance(decoded, dict):
        raise ValueError(f"a {type(decoded).__name__}, not an object of nodes")
    saved: dict[Key, dict[str, Any]] = {}
    for node, entries in decoded.items():
        if entries is None:
            continue
        if not isinstance(entries, list):
            raise ValueError(f"node {node!r}: a {type(entries).__name__}, not a list of faults")
        for entry in entries:
            entry = {} if entry is None else entry
            if not isinstance(entry, dict):
                raise ValueError(f"node {node!r}: a {type(entry).__name__}, not a fault object")
            rec: dict[str, Any] = {"node": node, "deviceIds": []}
            for field, name in _ENTRY_STRINGS.items():
                value = entry.get(field)
                if value is not None and not isinstance(value, str):
                    raise ValueError(f"node {node!r}: {field} is not a string: {value!r}")
                rec[name] = value or ""
            rec["faultTime"] = _go_int(entry.get("faultTime"), 64, node, "faultTime")
            ids = entry.get("devIds")
            if ids is not None:
                if not isinstance(ids, list):
                    raise ValueError(f"node {node!r}: devIds is not a list: {ids!r}")
                rec["deviceIds"] = [_go_int(i, 32, node, "devIds") for i in ids]
            saved[(node, rec["resource"], rec["faultId"])] = rec
    return saved


def _go_int(value: Any, bits: int, node: str, field: str) -> int:
    """A JSON number into a Go intN: an integer literal in range (null leaves it zero)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not -2 ** (bits - 1) <= value < 2 ** (bits - 1):
        raise ValueError(f"node {node!r}: {field} is not an int{bits}: {value!r}")
    return value


def _persisted_record(key: Key, stored: StoredFault) -> dict[str, Any]:
    """The fields ClusterD keeps in its ConfigMap (no assertion, add time, location, description)."""
    f = stored.fault
    return {"node": key[0], "resource": key[1], "faultId": key[2], "faultType": f.faultType,
            "faultCode": f.faultCode, "level": stored.level, "faultTime": f.faultTime,
            "deviceIds": list(stored.device_ids)}


def _valid_ms(value: int) -> bool:
    """ClusterD: the decimal string is 13 digits (milliseconds) and not before 2025-01-01."""
    return bool(_MS.fullmatch(str(value))) and value >= MIN_TIME_MS
