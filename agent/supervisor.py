"""Builds the components the configuration enables, starts them in order and stops them in reverse."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from agent.config import Config
from agent.devices.base import DeviceBackend
from agent.devices.dcmi import DcmiBackend
from agent.devices.monitor import DeviceMonitor
from agent.devices.scenario import load_scenario
from agent.devices.simulated import SimulatedBackend
from agent.faults.clusterd import ClusterdSink
from agent.faults.configmap import DeviceInfoConfigMapSink
from agent.faults.hub import FaultHub
from agent.faults.log import FaultLog
from agent.faults.service import FaultService
from agent.grpc_server import GrpcServer
from agent.http import HttpEndpoint
from agent.kube.client import core_api
from agent.kube.jobs import JobDirectory
from agent.kube.podresources import PodAttribution, PodsOf, no_pods
from agent.kube.pods import NodePods
from agent.metrics import AgentCollector, make_registry
from agent.profiling.datatrace_sync import DatatraceSync
from agent.profiling.disk import DiskGuard
from agent.profiling.metrics import DatatraceCollector, DiskGuardCollector, StepCollector
from agent.profiling.step_metrics import StepMetrics
from agent.profiling.tail import ProfilingTailer
from agent.taskd.metrics import TaskdProxyCollector
from agent.taskd.peers import PeerResolver
from agent.taskd.proxy import TaskdProxy

log = logging.getLogger(__name__)

STOP_BUDGET_S = 8.0  # SIGTERM to exit within 10 s, with room for the interpreter to wind down
HUB_KEEP = 4096  # changes kept in memory for stream subscribers that resume
MIB = 1 << 20  # TaskD's "MB" is a MiB


class Component(Protocol):
    """Runs its long-lived tasks through an `agent.tasks.Tasks` named `tasks`, whose failures show here."""

    name: str

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def readiness(self) -> tuple[bool, str]: ...


class Supervisor:
    def __init__(self, components: list[Component]):
        self.components = components
        self._started: list[Component] = []

    async def start(self) -> None:
        for component in self.components:
            await component.start()
            self._started.append(component)

    async def stop(self, budget_s: float = STOP_BUDGET_S) -> None:
        deadline = time.monotonic() + budget_s
        for component in reversed(self._started):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                await asyncio.wait_for(component.stop(), remaining)
            except asyncio.TimeoutError:
                log.warning("component did not stop in time", extra={"component": component.name})
            except Exception:
                log.exception("component failed to stop", extra={"component": component.name})
        self._started.clear()

    def states(self) -> list[tuple[str, bool, str]]:
        """(component, ready, why not): its own readiness and that of its supervised tasks (agent.tasks)."""
        states = []
        for component in self.components:
            ok, why = component.readiness()
            tasks = getattr(component, "tasks", None)
            failed = tasks.problem if tasks is not None else ""
            states.append((component.name, ok and not failed, "; ".join(p for p in (why, failed) if p)))
        return states

    def readiness(self) -> tuple[bool, list[str]]:
        reasons = [f"{name}: {why}" for name, ok, why in self.states() if not ok]
        return not reasons, reasons


@dataclass
class Agent:
    config: Config
    supervisor: Supervisor
    hub: FaultHub
    fault_log: FaultLog
    faults: FaultService
    monitor: DeviceMonitor
    http: HttpEndpoint
    grpc: GrpcServer
    sinks: list
    profiling: list
    pods_of: PodsOf  # physical id -> the containers holding the NPU (empty without attribution)


def make_backend(config: Config, clock: Callable[[], float] = time.time) -> DeviceBackend:
    devices = config.devices
    if devices.backend == "simulated":
        sim = devices.simulated
        scenario = load_scenario(sim.scenario, sim.devices) if sim.scenario else None
        return SimulatedBackend(sim.devices, sim.chip_name, scenario, clock)
    return DcmiBackend(devices.dcmi_library)


def build_agent(config: Config, backend: DeviceBackend | None = None,
                clock: Callable[[], float] = time.time) -> Agent:
    fault_log = FaultLog(Path(config.state_dir) / "faultlog")
    fault_log.open()  # OSError: state_dir unusable, reported by the caller
    recent = fault_log.changes_after(max(0, fault_log.revision - HUB_KEEP)) or []
    hub = FaultHub(config.node_name, keep=HUB_KEEP, epoch=fault_log.epoch, history=recent, latest=fault_log.latest())
    faults = FaultService(config.faults, config.state_dir, fault_log, hub,
                          once_hold_s=config.devices.poll_interval_seconds, clock=clock)
    monitor = DeviceMonitor(backend or make_backend(config, clock), faults,
                            poll_interval_s=config.devices.poll_interval_seconds,
                            call_timeout_s=config.devices.call_timeout_seconds, clock=clock)
    attribution = None
    if config.kubernetes.pod_resources_socket:
        attribution = PodAttribution(config.kubernetes.pod_resources_socket,
                                     config.kubernetes.pod_resources_refresh_seconds)
        faults.listeners.append(attribution.refresh_soon)
    pods_of = attribution.pods_of if attribution else no_pods
    grpc_server = GrpcServer(config.grpc.listen, hub, pods_of)
    sinks = []
    if config.clusterd.enabled:
        clusterd = ClusterdSink(config.clusterd, config.node_name, fault_log, clock, pods_of,
                                devices_known=lambda: monitor.polled_once)
        faults.listeners.append(clusterd.notify)
        sinks.append(clusterd)
    if config.kubernetes.enabled and config.kubernetes.device_info_configmap:
        configmap = DeviceInfoConfigMapSink(
            config.node_name, hub, lambda: monitor.devices[0].chip_name if monitor.devices else "", clock=clock)
        faults.listeners.append(configmap.notify)
        sinks.append(configmap)
    supervisor = Supervisor([])
    collectors = [AgentCollector(config.node_name, monitor, faults, hub, fault_log, sinks,
                                 lambda: [(name, ok) for name, ok, _ in supervisor.states()], pods_of)]
    profiling = []
    # One watch of this node's pods for whoever subscribes (job labels, datatrace, the proxy's pod check).
    node_pods = NodePods(config.node_name, core_api, config.kubernetes.watch_timeout_seconds)
    jobs = None  # pod -> job, for the step metrics' labels and the TaskD proxy's peer check
    if config.kubernetes.enabled and (config.profiling.metrics or config.taskd_proxy.enabled):
        jobs = JobDirectory(node_pods)
    if config.profiling.disk_guard:
        guard = DiskGuard(Path(config.profiling.root), config.profiling.disk_limit_mb * MIB)
        collectors.append(DiskGuardCollector(config.node_name, guard))
        profiling.append(guard)
    if config.profiling.metrics:
        steps = StepMetrics(Path(config.state_dir) / "steps.json", job_labels=jobs.labels if jobs else None)
        tailer = ProfilingTailer(Path(config.profiling.root), Path(config.state_dir) / "profiling-offsets.json", steps)
        steps.commit = tailer.commit
        collectors.append(StepCollector(config.node_name, steps))
        profiling += [steps, tailer]  # the tailer stops first and hands its last lines over
    if config.datatrace.enabled:
        datatrace = DatatraceSync(Path(config.datatrace.root), config.node_name, core_api, node_pods,
                                  config.kubernetes.watch_timeout_seconds)
        collectors.append(DatatraceCollector(config.node_name, datatrace))
        profiling.append(datatrace)
    servers = [grpc_server]
    if config.taskd_proxy.enabled:
        proxy_config = config.taskd_proxy
        proxy = TaskdProxy(proxy_config.listen, proxy_config.manager_port,
                           dial_timeout_s=proxy_config.dial_timeout_seconds, hold_s=proxy_config.hold_seconds,
                           queue_limit=proxy_config.queue_limit, job_bytes=proxy_config.job_buffer_mb << 20,
                           node_bytes=proxy_config.node_buffer_mb << 20, resolver=PeerResolver(jobs=jobs))
        collectors.append(TaskdProxyCollector(config.node_name, proxy))
        servers.append(proxy)
    http = HttpEndpoint(config.http.listen, make_registry(*collectors), supervisor.readiness)
    # Servers first, so /readyz and the stream answer while the driver is still being opened;
    # sinks before the sources that feed them.
    # Attribution first: the first snapshot on the stream already names the pods. The pod watch
    # runs only when somebody subscribed to it, before the profiling parts that read it.
    supervisor.components = [*([attribution] if attribution else []), http, *servers, *sinks, faults, monitor,
                             *([node_pods] if node_pods.subscribed else []), *profiling]
    return Agent(config, supervisor, hub, fault_log, faults, monitor, http, grpc_server, sinks, profiling, pods_of)
