"""ClusterD at cluster scale: N nodes' ClusterD sinks against one ClusterD stand-in.

Every node is the agent's real ClusterD sink (agent/sinks/clusterd) over its own real fault log
(on /dev/shm), with its own gRPC channel (its own TCP connection), all on one asyncio loop in a
worker process (`--workers` of them). The ClusterD stand-in (testkit/fakes/clusterd) runs in this
process with ClusterD's rules: the PubFault bucket per resource (1 request/s, burst 100, 410 when
empty), the 1,000 calls/s interceptor (UNKNOWN "qps exceeded"), the listener that admits 1,024
connections and closes the rest at once (kept by gRPC's own listener, `cap_in_grpc`: the stand-in's
Python relay cannot keep up with a thousand clients' connects; connections are counted from the
kernel's socket table; the per-IP cap of 512 is left out: here every node connects from 127.0.0.1,
in a cluster each from its own IP), restarts (its saved cache reloaded some seconds after it serves
again).

Time is scaled: the stand-in's clock and the sinks' clocks (wall clock, and the loop's clock, which
all their sleeps and time-outs use) run `--scale` times faster than real time, from one origin.
gRPC's own timers (call deadlines, reconnection backoff, keepalive) stay in real time, so they are
`--scale` times shorter in the scenario's time; nothing measured here depends on them except the
reconnection after a restart. The worker's loop lag (how late its timers fire, in scenario seconds)
is printed with each run: a lag of the order of a second means the machine could not keep up and
the figures are not to be trusted (use a smaller --scale).

Baseline, same run: the sink as it was before the scale work (the three modules of
agent/sinks/clusterd at commit BASELINE_COMMIT, read with `git show`): exponential backoff with
jitter up to 30 s on a 410, one connection held while the node holds faults, a re-assertion every
1,800 s (+-10 %) per node holding faults, one resource.

Scenarios (`--scenarios`):
* storm-K (storm-50, storm-500, storm-all): a SeparateNPU fault on one NPU of K nodes at the same
  instant. Bound = max(K - 100, 0) s (the burst at once, then 1 request/s); per-node delay = the
  stand-in's acceptance of the first request carrying that node's occur - the fault.
* sharded-all: storm-all with `--resources` resources (the current sink only; the baseline has one).
  Bound = the largest resource's share - 100.
* restart: K = `--restart-k` nodes hold a fault (delivered beforehand), ClusterD restarts
  (`--restart-down` s down, its saved cache reloaded 5 s after it serves), and 20 other nodes raise
  a fault 10 s after it serves again. Per-node delay: for the K nodes, until ClusterD holds their
  fault again; for the 20, as in a storm (a re-assertion flood makes them wait).
* restart-lost: the same, but ClusterD's saved cache is gone (its ConfigMap deleted); bound =
  K + 20 - 100 s (every fault is sent again).
* flap: `--flappers` nodes each flip one NPU between SeparateNPU and healthy every 30 s for 10
  minutes; per-change delay (the occur or recover accepted - the change).
* day: every node holds a fault, then 24 h with no change (`--day-scale`): requests that are
  re-assertions per hour, as a share of ClusterD's 3,600/h per resource.

The API server is the Kubernetes stand-in (testkit/fakes/kube): the ClusterD stand-in saves its cache
in the ConfigMap `cluster-system/statistic-fault-info` there and keeps its pod `mindx-dl/clusterd-*`
(restarts counted), as ClusterD and the kubelet do. The current sink sees them through its real
observer (agent/sinks/clusterd/observe.py): one per worker process, shared by that worker's sinks
(the pod watch is the same for every node; each node reads the ConfigMap itself, with its own GET).
Its watch is renewed every 2 s of real time (the watch's own time-outs are not scaled).

For each: the time until ClusterD holds every fault, as a ratio to the bound; p50/p99/max per-node
delay; refused calls (410 and "qps exceeded") per delivered request; connections held (the most at
once, against the 1,024 cap); and requests spent on re-assertion as a share of the budget.

    nice -n 19 .venv/bin/python bench/cluster_scale.py --nodes 1000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import os
import random
import resource
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stats import percentile  # noqa: E402
from testkit.fakes.clusterd import DEFAULT_CONFIG, ClusterdStandIn  # noqa: E402
from testkit.fakes.kube import KubeStandIn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASELINE_COMMIT = "e5e1effcc10ec4b21a957d709106a005ce1e6ced"  # the sink before the scale work
BURST = 100
CAP = 1024
CODE, LEVEL = 0x80E18402, "SeparateNPU"  # public 020011001
BUDGET_PER_H = 3600  # per resource
RECONCILE_GOAL = 0.05
STORM_GOAL, P99_GOAL, CONNECTIONS_GOAL = 1.2, 1.5, 0.5


def node_name(i: int) -> str:
    return f"node-{i:05d}"


# ---- the worker: N sinks on one scaled loop ----------------------------------------------------


class _ScaledSelector(selectors.EpollSelector):
    scale = 1.0

    def select(self, timeout=None):
        return super().select(None if timeout is None else timeout / self.scale)


def _scaled_loop(scale: float) -> asyncio.AbstractEventLoop:
    selector = _ScaledSelector()
    selector.scale = scale

    class Loop(asyncio.SelectorEventLoop):
        def time(self) -> float:
            return time.monotonic() * scale

    return Loop(selector)


def _baseline_modules(clock_shim) -> types.ModuleType:
    """The sink, its planner and its fault rules at BASELINE_COMMIT, as a package of their own."""
    package = types.ModuleType("_baseline_clusterd")
    package.__path__ = []
    sys.modules[package.__name__] = package
    for name in ("pubfault", "batch", "sink"):
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{BASELINE_COMMIT}:agent/sinks/clusterd/{name}.py"],
                                check=True, capture_output=True, text=True).stdout
        source = source.replace("agent.sinks.clusterd.", "_baseline_clusterd.")
        module = types.ModuleType(f"_baseline_clusterd.{name}")
        module.__file__ = f"<{BASELINE_COMMIT[:10]}:agent/sinks/clusterd/{name}.py>"
        sys.modules[module.__name__] = module
        exec(compile(source, module.__file__, "exec"), module.__dict__)
        setattr(package, name, module)
    sink = package.sink
    sink.time = clock_shim  # its monotonic clock is the loop's (it read time.monotonic() itself)
    sink.CHANNEL_OPTIONS = [*sink.CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]  # a connection per node
    return package


@dataclass
class WorkerSpec:
    variant: str  # "baseline" | "current"
    nodes: list[int]
    address: str
    origin: float  # real time.time() at which the scenario clock was `origin`
    scale: float
    config: dict = field(default_factory=dict)  # ClusterdConfig keys
    kubeconfig: str = ""  # the API server's, for the current sink's observer


def worker_main(spec: WorkerSpec, conn) -> None:
    os.nice(0)
    loop = _scaled_loop(spec.scale)
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_worker(spec, conn))
    finally:
        loop.close()


async def _worker(spec: WorkerSpec, conn) -> None:
    from agent.common.executor import Executor
    from agent.config import ClusterdConfig
    from agent.faults.log import FaultLog
    from agent.model import ActiveCode, DeviceState, Health, Level
    import logging

    logging.disable(logging.WARNING)  # thousands of sinks logging every retry would be the benchmark
    loop = asyncio.get_running_loop()

    def wall() -> float:
        return spec.origin + (time.time() - spec.origin) * spec.scale

    if spec.variant == "baseline":
        Sink = _baseline_modules(types.SimpleNamespace(monotonic=loop.time, time=wall)).sink.ClusterdSink
    else:
        from agent.sinks.clusterd.sink import ClusterdSink as Sink
    config = ClusterdConfig(enabled=True, address=spec.address, **spec.config)
    root = Path(tempfile.mkdtemp(prefix="cluster-scale-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    executor = Executor("bench")
    lane = executor.lane("fault-log", 4)
    logs, sinks = {}, {}
    kwargs = {} if spec.variant == "baseline" else {"monotonic": loop.time}
    observer = None
    if spec.variant == "current" and spec.kubeconfig:
        from kubernetes import client, config as kube_config
        from agent.sinks.clusterd.observe import ClusterdObserver

        observer = ClusterdObserver(
            "mindx-dl/app=clusterd", "cluster-system/statistic-fault-info", kube=executor.lane("kube", 8),
            api_factory=lambda: client.CoreV1Api(kube_config.new_client_from_config(config_file=spec.kubeconfig)),
            watch_timeout_s=2)
        await observer.start()
        kwargs["observer"] = observer
    for i in spec.nodes:
        log = FaultLog(root / str(i), lane=lane, clock=wall)
        log.open()
        logs[i] = log
        sinks[i] = Sink(config, node_name(i), log, clock=wall, **kwargs)
        await sinks[i].start()
    lag: list[float] = []

    async def ticker() -> None:
        while True:
            due = loop.time() + 1.0
            await asyncio.sleep(1.0)
            lag.append(loop.time() - due)

    tick = asyncio.create_task(ticker())

    async def inject(items: list[tuple[int, bool]], at: float) -> dict[int, float]:
        await asyncio.sleep(max(0.0, at - wall()))
        started = {}

        async def one(i: int, faulty: bool) -> None:
            now_ms = int(wall() * 1000)
            state = (DeviceState(0, 0, Health.UNHEALTHY, Level[LEVEL],
                                 now_ms, (ActiveCode(CODE, f"{CODE:08X}", Level[LEVEL], now_ms),), now_ms)
                     if faulty else DeviceState(0, 0, level_since_ms=now_ms))
            started[i] = wall()
            changes = await logs[i].append_async([state])
            sinks[i].notify(changes)

        await asyncio.gather(*(one(i, faulty) for i, faulty in items))
        return started

    requests: asyncio.Queue = asyncio.Queue()
    threading.Thread(target=lambda: _reader(conn, loop, requests), daemon=True).start()
    conn.send(("ready", len(sinks)))
    while True:
        command, *args = await requests.get()
        if command == "inject":
            conn.send(("injected", await inject(*args)))
        elif command == "stats":
            counters, reconciles = Counter(), Counter()
            for sink in sinks.values():
                counters.update(sink.counters)
                reconciles.update(sink.reconciles)
                reconciles.update({f"checked {k}": v for k, v in getattr(sink, "checks", {}).items() if v})
            pending = sum(1 for sink in sinks.values() if sink.pending)
            if observer is not None:
                reconciles.update({f"observer {k}": v for k, v in observer.counters.items()})
                if observer.unavailable:
                    reconciles[f"observer unavailable: {observer.unavailable[:80]}"] = 1
            conn.send(("stats", dict(counters), dict(reconciles), pending, list(lag)))
            lag.clear()
        elif command == "stop":
            tick.cancel()
            await asyncio.gather(*(sink.stop() for sink in sinks.values()), return_exceptions=True)
            if observer is not None:
                await observer.stop()
            for log in logs.values():
                await log.close_async()
            shutil.rmtree(root, ignore_errors=True)
            conn.send(("stopped",))
            return


def _reader(conn, loop, queue) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = ("stop",)
        loop.call_soon_threadsafe(queue.put_nowait, message)
        if message[0] == "stop":
            return


# ---- the bench process: the stand-in, the scenarios, the figures ---------------------------------


class Cluster:
    """One run: a stand-in and the workers running `nodes` sinks of one variant."""

    def __init__(self, args, variant: str, scale: float, resources: list[str] | None = None,
                 reload_delay_s: float = 5.0):
        self.args, self.variant, self.scale = args, variant, scale
        self.origin = time.time()
        config = dict(DEFAULT_CONFIG)
        self.resources = resources or ["npu-node-agent"]
        config["publicFaultResource"] = [*DEFAULT_CONFIG["publicFaultResource"], *self.resources]
        self.kube = KubeStandIn().start()
        self._kube_dir = tempfile.mkdtemp(prefix="cluster-scale-kube-")
        kubeconfig = self.kube.write_kubeconfig(Path(self._kube_dir) / "kubeconfig")
        self.standin = ClusterdStandIn(config, clock=self.now, listener_cap=(CAP, None), cap_in_grpc=True,
                                       reload_delay_s=reload_delay_s, kube=self.kube).start()
        settings = {"cluster_nodes": args.nodes}
        if resources:
            settings["resources"] = ",".join(resources)
        if variant == "baseline":
            settings = {}
        self.workers = []
        nodes = list(range(args.nodes))
        context = multiprocessing.get_context("spawn")
        for w in range(args.workers):
            mine = nodes[w::args.workers]
            parent, child = context.Pipe()
            spec = WorkerSpec(variant, mine, f"127.0.0.1:{self.standin.port}", self.origin, scale, settings,
                              kubeconfig)
            process = context.Process(target=worker_main, args=(spec, child), daemon=True)
            process.start()
            self.workers.append((process, parent, set(mine)))
        for _, pipe, _ in self.workers:
            kind, count = pipe.recv()
            assert kind == "ready", kind
        self.lag: list[float] = []
        for _ in range(30):  # the sinks' start (a resync each, nothing to send) behind: the loop idle again
            time.sleep(2)
            self.stats()
            calm = max(self.lag, default=0.0) < 0.5
            self.lag.clear()
            if calm:
                break
        self.open_samples: list[int] = []  # connections open, every 0.1 s of real time
        self._sampling = True
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while self._sampling:
            self.open_samples.append(self.standin.connections[0])
            time.sleep(0.1)

    def reset_peak(self) -> None:
        self.standin.reset_peak()
        self.open_samples = []

    def now(self) -> float:
        return self.origin + (time.time() - self.origin) * self.scale

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds / self.scale)

    def inject(self, items: list[tuple[int, bool]], delay: float = 0.5) -> dict[int, float]:
        at = self.now() + delay
        for _, pipe, mine in self.workers:
            pipe.send(("inject", [(i, f) for i, f in items if i in mine], at))
        started = {}
        for _, pipe, _ in self.workers:
            kind, times = pipe.recv()
            started.update(times)
        return started

    def stats(self) -> tuple[Counter, Counter, int]:
        counters, reconciles, pending = Counter(), Counter(), 0
        for _, pipe, _ in self.workers:
            pipe.send(("stats",))
        for _, pipe, _ in self.workers:
            _, c, r, p, lag = pipe.recv()
            counters.update(c)
            reconciles.update(r)
            pending += p
            self.lag.extend(lag)
        return counters, reconciles, pending

    def close(self) -> None:
        self._sampling = False
        for _, pipe, _ in self.workers:
            try:
                pipe.send(("stop",))
            except OSError:
                pass
        for process, pipe, _ in self.workers:
            try:
                if pipe.poll(60):
                    pipe.recv()
            except (EOFError, OSError):
                pass
            process.join(10)
            if process.is_alive():
                process.kill()
        self.standin.stop()
        self.kube.stop()
        shutil.rmtree(self._kube_dir, ignore_errors=True)

    # -- what the stand-in saw --

    def accepted_occurs(self, since: int = 0) -> dict[str, float]:
        """node -> when ClusterD first accepted an occur from it (in requests[since:])."""
        first: dict[str, float] = {}
        for r in self.standin.requests[since:]:
            if r.code == 0:
                for f in r.request.faults:
                    if f.assertion == "occur":
                        first.setdefault(f.influence[0].nodeName, r.at)
        return first

    def held_nodes(self) -> set[str]:
        return {node for node, _, _ in self.standin.active()}

    def warm_up(self, faulty: list[int]) -> None:
        """Deliver faults outside the measurement: ClusterD's bucket refilled as long as it takes."""
        self.inject([(i, True) for i in faulty])
        want = {node_name(i) for i in faulty}
        deadline = time.time() + 600
        while not want <= self.held_nodes():
            self.standin.refill_now()
            if time.time() > deadline:
                raise SystemExit(f"warm-up: {len(want - self.held_nodes())} faults never reached ClusterD")
            time.sleep(0.05)
        self.sleep(70)  # the follow-ups and every channel's idle period behind
        self.standin.refill_now()


@dataclass
class Result:
    scenario: str
    variant: str
    k: int
    bound: float
    converged: float | None  # seconds after the event until ClusterD held every fault
    delays: list[float]
    refused: int
    delivered: int
    peak_connections: int  # the most at any instant (the stand-in's count)
    mean_connections: float  # the mean of the samples
    reconcile_share: float | None
    lag_p99: float
    lag_max: float
    wall_s: float
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        return None if self.converged is None or self.bound <= 0 else self.converged / self.bound


def measure(cluster: Cluster, scenario: str, k: int, bound: float, event_at: float, want: set[str],
            first_request: int, timeout_s: float, since_ms: dict[str, float] | None = None,
            note: str = "") -> Result:
    """Wait until ClusterD holds a fault of every node in `want` (or the time-out), then read the figures."""
    started = time.time()
    deadline = cluster.now() + timeout_s
    while not want <= cluster.held_nodes() and cluster.now() < deadline:
        time.sleep(0.2)
    done = want <= cluster.held_nodes()
    firsts = cluster.accepted_occurs(first_request)
    origin = since_ms or {}
    delays = sorted(max(0.0, firsts[n] - origin.get(n, event_at)) for n in want if n in firsts)
    converged = max(delays) if done and delays else None
    if done and len(delays) < len(want):  # some came back with the reload, not through a request
        converged = None
    return _figures(cluster, scenario, k, bound, converged, delays, first_request, started, note)


def _figures(cluster: Cluster, scenario: str, k: int, bound: float, converged, delays, first_request, started,
             note: str = "", reconcile_share: float | None = None) -> Result:
    cluster.sleep(2)
    counters, reconciles, pending = cluster.stats()
    requests = cluster.standin.requests[first_request:]
    delivered = sum(1 for r in requests if r.code == 0)
    refused = sum(1 for r in requests if r.code == 410) + cluster.standin.qps_exceeded
    lag = cluster.lag or [0.0]
    samples = cluster.open_samples or [0]
    return Result(scenario, cluster.variant, k, bound, converged, list(delays), refused, delivered,
                  cluster.standin.connections[1], sum(samples) / len(samples), reconcile_share, percentile(lag, 99), max(lag),
                  time.time() - started, note, {"reconciles": dict(reconciles), "pending": pending,
                                                "cap_refused": cluster.standin.connections[2]})


def storm(args, variant: str, k: int, name: str, resources: list[str] | None = None) -> Result:
    cluster = Cluster(args, variant, args.scale, resources)
    try:
        chosen = random.Random(args.seed).sample(range(args.nodes), k)
        per_resource = Counter()
        if resources and variant == "current":
            from agent.sinks.clusterd.pacing import resource_of
            per_resource.update(resource_of(node_name(i), "", resources) for i in chosen)
        bound = max(0.0, (max(per_resource.values()) if per_resource else k) - BURST)
        cluster.reset_peak()
        first = len(cluster.standin.requests)
        injected = cluster.inject([(i, True) for i in chosen])
        event = min(injected.values())
        return measure(cluster, name, k, bound, event, {node_name(i) for i in chosen}, first,
                       timeout_s=max(3 * bound, 300) + 120, since_ms={node_name(i): t for i, t in injected.items()},
                       note=f"{len(resources)} resources, largest {max(per_resource.values())} nodes"
                       if per_resource else "")
    finally:
        cluster.close()


def restart(args, variant: str, persisted: bool) -> Result:
    name = "restart" if persisted else "restart-lost"
    cluster = Cluster(args, variant, args.scale)
    try:
        rng = random.Random(args.seed)
        k = min(args.restart_k, args.nodes - 20)
        chosen = rng.sample(range(args.nodes), k + 20)
        faulty, late = chosen[:k], chosen[k:]
        cluster.warm_up(faulty)
        cluster.reset_peak()
        first = len(cluster.standin.requests)
        cluster.standin.stop()
        cluster.sleep(args.restart_down)
        cluster.standin.start(persisted=persisted)
        back = cluster.now()
        cluster.sleep(10)
        injected = cluster.inject([(i, True) for i in late], delay=0.0)
        want = {node_name(i) for i in faulty}
        late_names = {node_name(i) for i in late}
        started = time.time()
        deadline = back + max(3 * k, 600)
        while not (want | late_names) <= cluster.held_nodes() and cluster.now() < deadline:
            time.sleep(0.2)
        held_at: dict[str, float] = {}
        for r in cluster.standin.requests[first:]:  # when each fault was held again (reload or request)
            for node in {key[0] for key in r.cached}:
                held_at.setdefault(node, r.at)
        reload_at = back + 5.0
        delays = sorted(min(held_at.get(n, float("inf")), reload_at if persisted else float("inf")) - back
                        for n in want)
        delays = [d for d in delays if d != float("inf")]
        firsts = cluster.accepted_occurs(first)
        late_delays = sorted(firsts[n] - injected[i] for i, n in zip(late, map(node_name, late)) if n in firsts)
        done = (want | late_names) <= cluster.held_nodes()
        converged = max(delays + late_delays) if done else None
        # Lost: every fault is sent again, the 20 new ones with them (the burst at once, then 1/s).
        bound = 0.0 if persisted else max(0.0, k + len(late) - BURST)
        result = _figures(cluster, name, k, bound, converged, delays, first, started,
                          note=f"{len(want) - len(delays)} of {k} faults not held again within {deadline - back:.0f} s"
                          if len(delays) < len(want) else "")
        result.extra["late"] = late_delays
        result.extra["late_missing"] = len(late) - len(late_delays)
        result.extra["reasserted"] = sum(result.extra["reconciles"].values())
        return result
    finally:
        cluster.close()


def flap(args, variant: str) -> Result:
    cluster = Cluster(args, variant, args.scale)
    try:
        flappers = random.Random(args.seed).sample(range(args.nodes), args.flappers)
        cluster.reset_peak()
        first = len(cluster.standin.requests)
        started = time.time()
        changes: list[tuple[str, bool, float]] = []
        for round_ in range(20):  # 10 minutes, a change every 30 s
            faulty = round_ % 2 == 0
            injected = cluster.inject([(i, faulty) for i in flappers], delay=0.0)
            changes += [(node_name(i), faulty, t) for i, t in injected.items()]
            cluster.sleep(30)
        cluster.sleep(30)
        accepted = [(r.at, f.influence[0].nodeName, f.assertion) for r in cluster.standin.requests[first:]
                    if r.code == 0 for f in r.request.faults]
        delays = []
        for node, faulty, at in changes:
            want = "occur" if faulty else "recover"
            hit = next((t for t, n, a in accepted if n == node and a == want and t >= at), None)
            if hit is not None:
                delays.append(hit - at)
        converged = max(delays) if len(delays) == len(changes) else None
        return _figures(cluster, "flap", args.flappers, 0.0, converged, sorted(delays), first, started,
                        note=f"{len(changes)} changes, {len(changes) - len(delays)} never delivered")
    finally:
        cluster.close()


def day(args, variant: str) -> Result:
    cluster = Cluster(args, variant, args.day_scale)
    try:
        cluster.warm_up(list(range(args.nodes)))
        cluster.stats()
        cluster.lag.clear()
        cluster.reset_peak()
        first = len(cluster.standin.requests)
        started = time.time()
        start = cluster.now()
        cluster.sleep(86400)
        hours = (cluster.now() - start) / 3600
        requests = cluster.standin.requests[first:]
        share = len(requests) / hours / BUDGET_PER_H
        return _figures(cluster, "day", args.nodes, 0.0, None, [], first, started, reconcile_share=share,
                        note=f"{len(requests)} requests in {hours:.1f} h of scenario time")
    finally:
        cluster.close()


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(results: list[Result]) -> None:
    print()
    print(f"{'scenario':<13}{'variant':<10}{'K':>6}{'bound s':>9}{'done s':>9}{'ratio':>7}{'p50 s':>8}{'p99 s':>8}"
          f"{'max s':>8}{'p99/bd':>7}{'refused/':>9}{'conns':>7}{'of cap':>7}{'conns':>7}{'recon.':>8}{'lag p99':>8}{'wall':>6}")
    print(f"{'':<13}{'':<10}{'':>6}{'':>9}{'':>9}{'':>7}{'':>8}{'':>8}{'':>8}{'':>7}{'deliv.':>9}{'peak':>7}{'':>7}{'mean':>7}"
          f"{'budget':>8}{'s':>8}{'s':>6}")
    for r in results:
        p50 = percentile(r.delays, 50) if r.delays else None
        p99 = percentile(r.delays, 99) if r.delays else None
        print(f"{r.scenario:<13}{r.variant:<10}{r.k:>6}{fmt(r.bound, 0):>9}{fmt(r.converged):>9}{fmt(r.ratio, 2):>7}"
              f"{fmt(p50):>8}{fmt(p99):>8}{fmt(max(r.delays) if r.delays else None):>8}"
              f"{fmt(p99 / r.bound if p99 is not None and r.bound > 0 else None, 2):>7}"
              f"{fmt(r.refused / r.delivered if r.delivered else None, 2):>9}{r.peak_connections:>7}"
              f"{r.peak_connections / CAP:>7.0%}{r.mean_connections:>7.0f}{(f'{r.reconcile_share:.1%}' if r.reconcile_share is not None else '-'):>8}"
              f"{r.lag_p99:>8.2f}{r.wall_s:>6.0f}")
        extra = []
        if r.note:
            extra.append(r.note)
        if "late" in r.extra:
            late = r.extra["late"]
            extra.append(f"20 faults raised 10 s after the restart: p50 {fmt(percentile(late, 50) if late else None)} s,"
                         f" max {fmt(max(late) if late else None)} s, {r.extra['late_missing']} not delivered; "
                         f"{r.extra['reasserted']} re-assertions")
        extra.append(f"requests {r.delivered} delivered, {r.refused} refused; re-assertions "
                     f"{r.extra['reconciles'] or '{}'}; connections reset at the cap {r.extra['cap_refused']}; "
                     f"loop lag max {r.lag_max:.2f} s")
        print(f"{'':<23}" + "; ".join(extra))


def verdicts(results: list[Result]) -> list[str]:
    lines = []
    for r in results:
        if r.variant != "current":
            continue
        if r.scenario == "storm-500":
            p99 = percentile(r.delays, 99) if r.delays else None
            ok = r.ratio is not None and r.ratio <= STORM_GOAL and p99 is not None and p99 <= P99_GOAL * r.bound
            lines.append(f"storm of 500: done {fmt(r.ratio, 2)}x the bound (goal <= {STORM_GOAL}), p99 "
                         f"{fmt(p99 / r.bound if p99 else None, 2)}x (goal <= {P99_GOAL}): {'PASS' if ok else 'FAIL'}")
        if r.scenario == "day" and r.reconcile_share is not None:
            ok = r.reconcile_share <= RECONCILE_GOAL
            lines.append(f"reconciliation with {r.k} faulty nodes: {r.reconcile_share:.1%} of the budget "
                         f"(goal <= {RECONCILE_GOAL:.0%}): {'PASS' if ok else 'FAIL'}")
    worst = max((r for r in results if r.variant == "current"), key=lambda r: r.peak_connections, default=None)
    if worst is not None:
        ok = worst.peak_connections <= CONNECTIONS_GOAL * CAP
        lines.append(f"connections: at most {worst.peak_connections} ({worst.peak_connections / CAP:.0%} of the "
                     f"listener's {CAP}, in {worst.scenario}; goal <= {CONNECTIONS_GOAL:.0%}): "
                     f"{'PASS' if ok else 'FAIL'}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--scenarios", default="storm-50,storm-500,storm-all,sharded-all,restart,restart-lost,flap,day",
                        help="comma-separated")
    parser.add_argument("--variants", default="baseline,current")
    parser.add_argument("--scale", type=float, default=10.0, help="scenario seconds per real second")
    parser.add_argument("--day-scale", type=float, default=400.0, help="--scale of the day scenario")
    parser.add_argument("--workers", type=int, default=1, help="processes running the sinks")
    parser.add_argument("--resources", type=int, default=4, help="resources of sharded-all")
    parser.add_argument("--restart-k", type=int, default=500)
    parser.add_argument("--restart-down", type=float, default=10.0, help="seconds ClusterD is down")
    parser.add_argument("--flappers", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    gc.freeze()
    results = []
    began = time.time()
    for scenario in args.scenarios.split(","):
        for variant in args.variants.split(","):
            if scenario == "sharded-all" and variant == "baseline":
                continue  # one resource only
            print(f"{scenario} / {variant} ...", flush=True)
            if scenario.startswith("storm-"):
                k = args.nodes if scenario == "storm-all" else min(args.nodes, int(scenario.split("-")[1]))
                result = storm(args, variant, k, scenario)
            elif scenario == "sharded-all":
                result = storm(args, variant, args.nodes, scenario,
                               [f"npu-node-agent-{i}" for i in range(args.resources)])
            elif scenario in ("restart", "restart-lost"):
                result = restart(args, variant, scenario == "restart")
            elif scenario == "flap":
                result = flap(args, variant)
            elif scenario == "day":
                result = day(args, variant)
            else:
                parser.error(f"unknown scenario {scenario}")
            results.append(result)
            report([result])
    print(f"\n{args.nodes} nodes, {args.workers} worker process(es), time x{args.scale:g} (day x{args.day_scale:g}); "
          f"baseline = agent/sinks/clusterd at {BASELINE_COMMIT[:10]}; {time.time() - began:.0f} s in all")
    report(results)
    print()
    for line in verdicts(results):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
