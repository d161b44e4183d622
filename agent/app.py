"""The composition root: every component the configuration enables, built once, in dependency order.

Read top to bottom: the executor for blocking calls, the fault pipeline (log, hub, sinks, rules,
devices), then the node's pods, the profiling hostPaths, the TaskD proxy, and last the endpoints that
report on all of them. Nothing is rewired after construction; `serve` runs the result until SIGTERM.

One concurrency rule: the agent's work runs on one asyncio loop, and every call that can block runs
in one executor (agent.common.executor), in a lane per purpose. A lane's first number is how many
of its calls run at once, the second how many calls abandoned by their callers (stuck: a hung
driver or file system) it keeps apart so that its other calls go on:
- driver: 2 at once (a poll round is short ioctls, which the device plugin makes one after another;
  two, so that one slow device does not hold up the others), and one stuck call per device (the
  monitor refuses a device's next call while one is stuck) plus open/subscribe/close;
- fault-log: 1, 0 (the fault log, its cursors and the escalation history are written in order,
  and a write is waited for, never abandoned);
- rule-files, datatrace: 1, 0 (while a read or a pass is stuck, the next is refused at once: the
  task retries with backoff, and /readyz says why);
- kube: one per watch (a watch holds its thread for up to watch_timeout_seconds) + 2 for lists
  and the device-info ConfigMap, + 1 each for the node condition (or, with it off, the removal of an
  earlier run's) and the Events (each writes one call at a time, so a hung API server holding one
  never takes the ConfigMap's turn);
- kube-reviews: 2, 0 (the TokenReviews and SubjectAccessReviews of /metrics scrapers, with
  http.token_auth: apart, so that reviews a hung API server holds never take the ConfigMap's turn,
  and a review that waited its time-out for a turn is dropped unrun);
- disk-guard, profiling-tailer: 1 each (walks and reads of the profiling tree, in order; neither
  waits behind the other or behind the driver);
- taskd-peers: 2 (/proc walks identifying processes that connect);
- telemetry: 2, and one stuck read per chip and kind (npu-exporter's families, when enabled; apart from
  the driver lane so that a hung telemetry call never delays a fault poll);
- metrics: 1 (formatting and compressing a /metrics page; requests that arrive meanwhile share it);
- default: 2 (asyncio's default executor, e.g. getaddrinfo).
Threads start on demand and end after a minute without work, so an idle agent holds the few the
device polls use; the bound on threads is the sum of the lanes' numbers.

The rule is the agent process's. `agent.worker` is not part of it: it runs inside training processes,
on a background thread of its own (and the native collector's callbacks on MSPTI's threads), without
an event loop, because a training script must not have to run one (agent/worker/__init__.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from agent import __version__
from agent.common.executor import Executor
from agent.common.metrics import ExecutorCollector, StateFileCollector
from agent.config import Config
from agent.devices.base import DeviceBackend
from agent.devices.metrics import DriverCollector
from agent.devices.monitor import DeviceMonitor
from agent.faults.hub import FaultHub
from agent.faults.log import FaultLog
from agent.faults.metrics import FaultCollector, FaultLogCollector
from agent.faults.service import FaultService
from agent.grpc_server import GrpcServer
from agent.http import HttpEndpoint
from agent.lifecycle import STOP_BUDGET_S, LifecycleCollector, Readiness, Supervisor
from agent.metrics import BuildInfoCollector, make_registry
from agent.model import PodsOf, Sink, no_pods
from agent.sinks.metrics import SinkCollector
from agent.status import StatusPage

if TYPE_CHECKING:  # imported only when enabled (agent.ondemand): an agent without them never loads them
    from agent.diskguard.guard import DiskGuard
    from agent.ondemand import OnDemand
    from agent.steps.consumer import StepMetrics
    from agent.telemetry.sampler import TelemetrySampler

log = logging.getLogger(__name__)

MAX_DEVICES = 64  # devices.simulated's bound, and more NPUs than any node has
DRIVER_LANE = (2, MAX_DEVICES + 3)
TELEMETRY_STUCK = 2 * MAX_DEVICES  # e.g. network health and the sensors of every chip of a dropped card
HUB_KEEP = 4096  # changes kept in memory for stream subscribers that resume
MIB = 1 << 20  # TaskD's "MB" is a MiB
EXIT_OK, EXIT_RUNTIME = 0, 1


@dataclass(frozen=True)
class App:
    config: Config
    executor: Executor
    supervisor: Supervisor
    readiness: Readiness
    hub: FaultHub
    fault_log: FaultLog
    faults: FaultService
    monitor: DeviceMonitor
    http: HttpEndpoint
    grpc: GrpcServer
    pods_of: PodsOf  # physical id -> the containers holding the NPU (empty without attribution)
    profiling: OnDemand | None = None  # when profiling.disk_guard or profiling.metrics
    telemetry: TelemetrySampler | None = None  # when telemetry.enabled

    @property
    def guard(self) -> DiskGuard | None:
        """The DiskGuard, once built (profiling.disk_guard; see agent.ondemand)."""
        return built_guard(self.profiling) if self.config.profiling.disk_guard else None

    @property
    def steps(self) -> StepMetrics | None:
        """The StepMetrics, once built (profiling.metrics; see agent.ondemand)."""
        return built_steps(self.profiling) if self.config.profiling.metrics else None


# The profiling root's parts, by class. Their modules are imported only once the parts are built (which
# loaded them): an agent whose root holds nothing never loads them (agent.ondemand).

def built_guard(followers: OnDemand | None) -> DiskGuard | None:
    if not (followers and followers.parts):
        return None
    from agent.diskguard.guard import DiskGuard
    return followers.part(DiskGuard)


def built_steps(followers: OnDemand | None) -> StepMetrics | None:
    if not (followers and followers.parts):
        return None
    from agent.steps.consumer import StepMetrics
    return followers.part(StepMetrics)


def make_backend(config: Config, clock: Callable[[], float] = time.time) -> DeviceBackend:
    devices = config.devices
    if devices.backend == "simulated":
        from agent.devices.scenario import load_scenario
        from agent.devices.simulated import SimulatedBackend

        sim = devices.simulated
        scenario = load_scenario(sim.scenario, sim.devices) if sim.scenario else None
        return SimulatedBackend(sim.devices, sim.chip_name, scenario, clock)
    from agent.devices.dcmi import DcmiBackend

    if not config.telemetry.enabled:  # telemetry's ctypes types cost memory: only when asked for
        return DcmiBackend(devices.dcmi_library)
    from agent.devices.dcmi_abi import SIGNATURES
    from agent.telemetry.dcmi_abi import SIGNATURES as TELEMETRY

    return DcmiBackend(devices.dcmi_library, {**SIGNATURES, **TELEMETRY})


def telemetry_sources(config: Config, backend: DeviceBackend) -> list:
    """Where telemetry comes from: the driver the fault monitor uses (one session), then hccn_tool."""
    if backend.name == "simulated":
        from agent.telemetry.simulated import SimulatedTelemetry

        return [SimulatedTelemetry(backend.dropped)]
    sources = []
    if backend.name == "dcmi":
        from agent.telemetry.dcmi import DcmiTelemetry

        sources.append(DcmiTelemetry(backend))
    if config.telemetry.hccn_tool:
        from agent.telemetry.hccn import HccnTool

        sources.append(HccnTool(config.telemetry.hccn_tool, config.devices.call_timeout_seconds))
    return sources


def build(config: Config, backend: DeviceBackend | None = None, clock: Callable[[], float] = time.time) -> App:
    """Raises OSError when the fault log in state_dir cannot be opened. Features that are off cost
    no import: the Kubernetes client, telemetry and the proxy load only when enabled, the profiling
    followers only once the profiling root holds something."""
    node, state_dir, kube = config.node_name, Path(config.state_dir), config.kubernetes
    collectors = []
    executor = Executor()
    wants_jobs = kube.enabled and (config.profiling.metrics or config.taskd_proxy.enabled)
    configmap_watches = len(config.datatrace.namespaces) or 1 if config.datatrace.enabled else 0
    watches = int(wants_jobs or config.datatrace.enabled) + configmap_watches  # pods, configmaps
    watches += int(kube.enabled and config.clusterd.enabled and bool(config.clusterd.pods))  # ClusterD's pods
    # One call at a time each: the node condition, or with it off the removal of an earlier run's; the Events.
    writers = int(kube.enabled) + int(kube.enabled and kube.events)
    kube_lane = executor.lane("kube", watches + 2 + writers)

    # The fault pipeline: durable log -> hub (current state, stream fan-out) -> sinks.
    # The sinks that keep a cursor in the log (by their names there); a cursor of another sink retires.
    fault_log = FaultLog(state_dir / "faultlog", lane=executor.lane("fault-log"), clock=clock,
                         sinks=["clusterd"] if config.clusterd.enabled else [],
                         retire_after_s=config.fault_log.retire_unconfigured_cursors_after_seconds)
    fault_log.open()
    recent = fault_log.changes_after(max(0, fault_log.revision - HUB_KEEP)) or []
    hub = FaultHub(node, keep=HUB_KEEP, epoch=fault_log.epoch, history=recent, latest=fault_log.latest())

    attribution = None
    if kube.pod_resources_socket:
        from agent.kube.podresources import PodAttribution

        attribution = PodAttribution(kube.pod_resources_socket, kube.pod_resources_refresh_seconds)
    pods_of = attribution.pods_of if attribution else no_pods

    sinks: list[Sink] = []
    observers = []  # what the sinks learn of their peers from the API server (started before them)
    if config.clusterd.enabled:
        from agent.sinks.clusterd.metrics import ClusterdCollector
        from agent.sinks.clusterd.sink import ClusterdSink

        observer = None
        if kube.enabled and (config.clusterd.pods or config.clusterd.saved_faults):
            from agent.kube.client import core_api
            from agent.sinks.clusterd.observe import ClusterdObserver

            observer = ClusterdObserver(config.clusterd.pods, config.clusterd.saved_faults, api_factory=core_api,
                                        kube=kube_lane, watch_timeout_s=kube.watch_timeout_seconds)
            observers.append(observer)
        # Until every device was polled, the log's last states may be stale: ClusterD waits for the hub.
        clusterd = ClusterdSink(config.clusterd, node, fault_log, clock, pods_of, devices_known=lambda: hub.current,
                                observer=observer)
        sinks.append(clusterd)
        collectors.append(ClusterdCollector(node, clusterd))
    if kube.enabled and kube.device_info_configmap:
        from agent.sinks.configmap.sink import DeviceInfoConfigMapSink

        sinks.append(DeviceInfoConfigMapSink(node, hub, lambda: hub.chip_name, kube=kube_lane, clock=clock))
    removal = []  # with the node condition off, a condition an earlier run left is removed once at start
    if kube.enabled and kube.node_condition:
        from agent.sinks.nodecondition.metrics import NodeConditionCollector
        from agent.sinks.nodecondition.sink import NodeConditionSink

        # The monitor is built below (the lambdas read it once it runs).
        condition = NodeConditionSink(node, hub, pods_of, polled=lambda: hub.current, kube=kube_lane, clock=clock,
                                      driver_problem=lambda: monitor.driver_problem)
        sinks.append(condition)
        collectors.append(NodeConditionCollector(node, condition))
    elif kube.enabled:
        from agent.sinks.nodecondition.sink import StaleConditionRemoval

        removal.append(StaleConditionRemoval(node, kube=kube_lane))
    if kube.enabled and kube.events:
        from agent.sinks.events.metrics import KubeEventsCollector
        from agent.sinks.events.sink import KubeEventsSink

        events = KubeEventsSink(node, hub, pods_of, kube=kube_lane, clock=clock)
        sinks.append(events)
        collectors.append(KubeEventsCollector(node, events))

    listeners = [*([attribution.refresh_soon] if attribution else []), *(sink.notify for sink in sinks)]
    faults = FaultService(config.faults, config.state_dir, fault_log, hub, files=executor.lane("rule-files"),
                          listeners=listeners, once_hold_s=config.devices.poll_interval_seconds, clock=clock)
    backend = backend or make_backend(config, clock)
    monitor = DeviceMonitor(backend, faults, calls=executor.lane("driver", *DRIVER_LANE),
                            poll_interval_s=config.devices.poll_interval_seconds,
                            call_timeout_s=config.devices.call_timeout_seconds, clock=clock)
    tls = None
    if config.tls.cert_file:
        from agent.tls import TlsCollector, TlsFiles

        tls = TlsFiles(config.tls, lane=executor.lane("tls", 1))  # ConfigError unless the files load
        collectors.append(TlsCollector(node, tls))
    servers = [GrpcServer(config.grpc.listen, hub, pods_of, credentials=tls.grpc_credentials if tls else None,
                          devices=monitor)]

    telemetry = None
    if config.telemetry.enabled:
        from agent.telemetry.collector import TelemetryCollector
        from agent.telemetry.sampler import TelemetrySampler

        # Two at once: the HCCS and PCIe bandwidth calls block for their 200 ms sampling window.
        telemetry = TelemetrySampler(telemetry_sources(config, backend), lambda: monitor.devices,
                                     lane=executor.lane("telemetry", 2, TELEMETRY_STUCK),
                                     intervals=vars(config.telemetry.intervals),
                                     call_timeout_s=config.devices.call_timeout_seconds)
        collectors.append(TelemetryCollector(node, telemetry, lambda: monitor.devices, pods_of))

    # One watch of this node's pods for whoever needs them (job labels, datatrace, the proxy's pod check).
    node_pods = jobs = None
    if wants_jobs or config.datatrace.enabled:
        from agent.kube.client import core_api
        from agent.kube.pods import NodePods

        node_pods = NodePods(node, core_api, kube_lane, kube.watch_timeout_seconds)
    if wants_jobs:
        from agent.kube.jobs import JobDirectory

        jobs = JobDirectory(node_pods)

    # The profiling root's followers: built once the root holds something (agent.ondemand); their
    # families are there from the start.
    profiling = []
    followers = None
    guard_lane = executor.lane("disk-guard") if config.profiling.disk_guard else None
    tailer_lane = executor.lane("profiling-tailer") if config.profiling.metrics else None

    def build_followers(fresh: bool) -> list:
        parts = []
        if guard_lane:
            from agent.diskguard.guard import DiskGuard

            parts.append(DiskGuard(Path(config.profiling.root), config.profiling.disk_limit_mb * MIB,
                                   executor=guard_lane))
        if tailer_lane:
            from agent.steps.consumer import StepMetrics
            from agent.steps.tail import ProfilingTailer

            steps = StepMetrics(state_dir / "steps.json", job_labels=jobs.labels if jobs else None,
                                job_pods=jobs.pods if jobs else None)
            parts += [steps, ProfilingTailer(Path(config.profiling.root), state_dir / "profiling-offsets.json", steps,
                                             replay_existing=fresh, executor=tailer_lane)]
        return parts  # the tailer stops first and hands its last lines over

    if guard_lane or tailer_lane:
        from agent.ondemand import OnDemand

        followers = OnDemand("profiling", Path(config.profiling.root), build_followers, lane=guard_lane or tailer_lane)
        profiling.append(followers)
    if guard_lane:
        from agent.diskguard.metrics import DiskGuardCollector

        collectors.append(DiskGuardCollector(node, lambda: built_guard(followers),
                                             config.profiling.disk_limit_mb * MIB))
    if tailer_lane:
        from agent.steps.metrics import StepCollector

        collectors.append(StepCollector(node, lambda: built_steps(followers)))
    if config.datatrace.enabled:
        from agent.datatrace.metrics import DatatraceCollector
        from agent.datatrace.sync import DatatraceSync
        from agent.kube.client import core_api

        datatrace = DatatraceSync(Path(config.datatrace.root), node, core_api, node_pods, kube=kube_lane,
                                  files=executor.lane("datatrace"), watch_timeout_s=kube.watch_timeout_seconds,
                                  namespaces=tuple(config.datatrace.namespaces))
        collectors.append(DatatraceCollector(node, datatrace))
        profiling.append(datatrace)

    if config.taskd_proxy.enabled:
        from agent.taskd.metrics import TaskdProxyCollector
        from agent.taskd.peers import PeerResolver
        from agent.taskd.proxy import TaskdProxy

        proxy_config = config.taskd_proxy
        proxy = TaskdProxy(proxy_config.listen, proxy_config.manager_port, peers=executor.lane("taskd-peers", 2),
                           dial_timeout_s=proxy_config.dial_timeout_seconds, hold_s=proxy_config.hold_seconds,
                           queue_limit=proxy_config.queue_limit, job_bytes=proxy_config.job_buffer_mb << 20,
                           node_bytes=proxy_config.node_buffer_mb << 20, resolver=PeerResolver(jobs=jobs))
        collectors.append(TaskdProxyCollector(node, proxy))
        servers.append(proxy)

    # Start order: attribution first (the stream's first snapshot already names the pods); the
    # servers, so /readyz and the stream answer while the driver is still being opened; sinks before
    # the sources that feed them; the pod watch before the profiling parts that read it.
    first = [*([tls] if tls else []), *([attribution] if attribution else [])]
    rest = [*servers, *observers, *sinks, *removal, faults, monitor, *([telemetry] if telemetry else []),
            *([node_pods] if node_pods and node_pods.subscribed else []), *profiling]
    readiness = Readiness([*first, *rest])  # the endpoint that answers /readyz is ready by answering
    # Each subsystem's families (the telemetry, profiling, datatrace and proxy ones are above).
    writes = [*faults.writes, *(write for sink in sinks for write in sink.writes)]
    collectors[:0] = [FaultCollector(node, monitor, faults, pods_of), FaultLogCollector(node, fault_log),
                      SinkCollector(node, hub, sinks), StateFileCollector(node, writes), DriverCollector(node, monitor),
                      LifecycleCollector(node, readiness), BuildInfoCollector(node), ExecutorCollector(node, executor)]
    auth = None
    if config.http.token_auth:
        from agent.kube.reviews import KubeReviewer
        from agent.tokenauth import TokenAuth, TokenAuthCollector

        auth = TokenAuth(KubeReviewer(), executor.lane("kube-reviews", 2),
                         timeout_s=config.http.token_auth_timeout_seconds)
        if not config.tls.cert_file:
            log.warning("http.token_auth without tls.cert_file: scrapers send their tokens in plaintext")
        collectors.append(TokenAuthCollector(node, auth))
    # The status page at / reads what the collectors read, on the loop (agent.status).
    page = StatusPage(node, hub, monitor, sinks, readiness.states, pods_of, backend=config.devices.backend, clock=clock)
    http = HttpEndpoint(config.http.listen, make_registry(*collectors), readiness.check, lane=executor.lane("metrics"),
                        tls=tls.server_context if tls else None, auth=auth, page=page)
    supervisor = Supervisor([*first, http, *rest])
    return App(config, executor, supervisor, readiness, hub, fault_log, faults, monitor, http, servers[0], pods_of,
               followers, telemetry)


def raise_open_files_limit() -> None:
    """The soft descriptor limit up to the hard one: container runtimes leave 1024, which a burst of
    connections would use up (then nothing opens: not the fault log, not a probe's connection)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20  # the kernel refuses more than fs.nr_open
    try:
        if wanted > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the open files limit; keeping it", extra={"soft": soft, "hard": hard,
                                                                            "error": str(exc)})
        return
    log.info("open files limit", extra={"was": soft, "soft": max(soft, wanted), "hard": hard})


async def serve(config: Config, stop: asyncio.Event | None = None, backend: DeviceBackend | None = None,
                on_started: Callable[[App], None] | None = None) -> int:
    """Run the agent until `stop` is set or SIGTERM/SIGINT arrives; returns the exit code."""
    stop = stop or asyncio.Event()
    raise_open_files_limit()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    try:
        Path(config.state_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.error("state_dir is not usable; escalation history will not survive a restart",
                  extra={"state_dir": config.state_dir, "error": str(exc)})
    try:
        app = build(config, backend=backend)
    except OSError as exc:
        log.error("cannot open the fault log in state_dir", extra={"state_dir": config.state_dir, "error": str(exc)})
        return EXIT_RUNTIME
    loop.set_default_executor(app.executor.lane("default", 2))
    log.info("npu-node-agent starting", extra={"version": __version__, "node": config.node_name,
                                                "backend": config.devices.backend})
    try:
        await app.supervisor.start()
    except OSError as exc:
        log.error("cannot start", extra={"error": str(exc)})
        await app.supervisor.stop()
        return EXIT_RUNTIME
    # Everything built so far lives as long as the process: keep it out of the collector's full
    # passes, which otherwise walk every gRPC and protobuf object (a ~65 ms pause on a small node).
    gc.collect()  # the start's garbage first, or it would be kept for good
    gc.freeze()
    if on_started is not None:
        on_started(app)
    await stop.wait()
    started = time.monotonic()
    log.info("stopping")
    await app.supervisor.stop()
    try:  # a hung disk must not hold up the exit
        await asyncio.wait_for(app.fault_log.close_async(), max(0.1, STOP_BUDGET_S - (time.monotonic() - started)))
    except TimeoutError:
        log.warning("the fault log's last revision was not noted: its disk does not answer")
    app.executor.close()
    log.info("stopped", extra={"seconds": round(time.monotonic() - started, 3)})
    return EXIT_OK
