"""The agent's configuration: schema with defaults, YAML loading, environment overrides, validation.

Every key is optional; an unknown key is an error that names its full path, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import socket
import stat
import typing
from dataclasses import dataclass, field

import yaml

from agent.common.errors import ConfigError, quote
from agent.model import Level


@dataclass
class LogConfig:
    level: str = "info"  # debug | info | warning | error
    format: str = "json"  # json | text


@dataclass
class HttpConfig:
    listen: str = "0.0.0.0:9410"


@dataclass
class GrpcConfig:
    listen: str = "0.0.0.0:9411"


@dataclass
class SimulatedConfig:
    devices: int = 8
    chip_name: str = "910B3"
    scenario: str = ""  # YAML file of timed fault injections


@dataclass
class DevicesConfig:
    backend: str = "dcmi"  # dcmi | simulated
    dcmi_library: str = ""
    poll_interval_seconds: float = 5.0
    call_timeout_seconds: float = 2.0  # a driver call slower than this reports the device unknown
    simulated: SimulatedConfig = field(default_factory=SimulatedConfig)


@dataclass
class FaultLogConfig:
    # A sink switched off (e.g. clusterd.enabled: false) keeps its place in the fault log this long
    # from the first start without it, so that switched back on within it, it resumes where it was.
    # Meanwhile the log keeps every change since that place; then the cursor is dropped, and a sink
    # switched on later resynchronises its peer from the current state.
    retire_unconfigured_cursors_after_seconds: float = 86400.0


@dataclass
class FaultsConfig:
    fault_code_file: str = ""
    customization_file: str = ""
    unknown_code_level: str = ""


def _default_public_codes() -> dict[str, str]:
    return {
        "SubHealthFault": "010011001", "PreSeparateNPU": "010011002", "RestartRequest": "020011002",
        "RestartBusiness": "020011002", "FreeRestartNPU": "020011002", "RestartNPU": "020011002",
        "SeparateNPU": "020011001", "ManuallySeparateNPU": "020011001",
    }


@dataclass
class ClusterdConfig:
    enabled: bool = False
    address: str = "clusterd-grpc-svc.mindx-dl.svc.cluster.local:8899"
    resource: str = "npu-node-agent"
    public_codes: dict[str, str] = field(default_factory=_default_public_codes)
    # Re-send the public faults ClusterD should hold (and the recent recovers it should not) this
    # often, for a ClusterD that restarted without this agent noticing (behind a proxy). One request
    # per 100 faults (held, or recovered in the last 10 minutes), nothing from a node without;
    # ClusterD's budget of 1 request/s is shared by every node of the cluster.
    reconcile_interval_seconds: float = 1800.0


@dataclass
class KubernetesConfig:
    enabled: bool = False
    device_info_configmap: bool = False
    watch_timeout_seconds: int = 300  # the server ends each watch after this; it is then resumed
    # The kubelet's PodResources API: which pod holds which NPU ("" = no attribution). Needs no API server.
    pod_resources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    pod_resources_refresh_seconds: float = 10.0


@dataclass
class ProfilingConfig:
    root: str = "/user/cluster-info/profiling"
    disk_limit_mb: int = 5000
    disk_guard: bool = True  # the node-level owner of disk_limit_mb (TaskD workers each walk the tree otherwise)
    metrics: bool = True


@dataclass
class DatatraceConfig:
    enabled: bool = False
    root: str = "/user/cluster-info/datatrace-config"


@dataclass
class TaskdProxyConfig:
    enabled: bool = False
    listen: str = "127.0.0.1:9602"
    manager_port: int = 9601
    dial_timeout_seconds: float = 5.0  # per attempt to reach a job's manager; retried with backoff
    hold_seconds: float = 60.0  # how long a message waits for an unreachable manager
    queue_limit: int = 1024  # messages held per job while its manager is unreachable
    # Bytes of messages the proxy may hold (on their way to a manager, or queued for a worker): per
    # job and for the node. Messages are held in their wire form, so the node default fits the
    # chart's 512 MiB memory limit with room.
    job_buffer_mb: int = 32
    node_buffer_mb: int = 64


@dataclass
class TelemetryIntervals:
    """Seconds between two collections of each of npu-exporter's groups (its defaults); 0 turns a group off."""
    utilization: float = 1.0
    npu: float = 5.0
    hbm: float = 60.0
    hccs: float = 60.0
    pcie: float = 60.0
    sio: float = 60.0
    network: float = 60.0
    roce: float = 60.0
    optical: float = 60.0


@dataclass
class TelemetryConfig:
    # npu-exporter's telemetry families (utilization, HBM, temperature, power, ECC, links): on to replace
    # npu-exporter on the node, off beside it (one driver session and one copy of each series).
    enabled: bool = False
    hccn_tool: str = "/usr/local/Ascend/driver/tools/hccn_tool"  # network, RoCE and optical groups; "" = skip them
    intervals: TelemetryIntervals = field(default_factory=TelemetryIntervals)


@dataclass
class Config:
    node_name: str = ""
    state_dir: str = "/var/lib/npu-node-agent"
    fault_log: FaultLogConfig = field(default_factory=FaultLogConfig)
    log: LogConfig = field(default_factory=LogConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    grpc: GrpcConfig = field(default_factory=GrpcConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    clusterd: ClusterdConfig = field(default_factory=ClusterdConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    datatrace: DatatraceConfig = field(default_factory=DatatraceConfig)
    taskd_proxy: TaskdProxyConfig = field(default_factory=TaskdProxyConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)


def load_config(path: str | None, environ: typing.Mapping[str, str] | None = None) -> Config:
    """Read, override from the environment, and validate; raises ConfigError listing every problem."""
    environ = os.environ if environ is None else environ
    document = (load_yaml(read_config_file(path), path) or {}) if path else {}
    return config_from_dict(document, environ)


def config_from_dict(document: object, environ: typing.Mapping[str, str] | None = None) -> Config:
    """The same as `load_config` for an in-memory document (used by `demo` and tests)."""
    problems: list[str] = []
    config = _build(Config, document, "", problems)
    if problems:
        raise ConfigError(problems)
    problems = _apply_environment(config, {} if environ is None else environ) + validate(config)
    if problems:
        raise ConfigError(problems)
    return config


# Far above any real configuration, rule or scenario file (a ConfigMap holds at most 1 MiB).
MAX_FILE_BYTES = 4 << 20
# Nodes a YAML document may expand to through its aliases (a real configuration has a few hundred):
# a few lines of nested aliases ("billion laughs") would otherwise stand for billions of values.
MAX_YAML_NODES = 100_000


def read_config_file(path: str) -> str:
    """The text of a configuration, rule or scenario file; ConfigError (one line naming it) unless it
    is a regular UTF-8 file of at most MAX_FILE_BYTES. Opened without blocking, so a FIFO (which
    would wait for a writer) or a device is refused at once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
            raise ConfigError([f"{path}: cannot read: {kind}, not a regular file"])
        data = b""
        while len(data) <= MAX_FILE_BYTES and (chunk := os.read(fd, 1 << 20)):
            data += chunk
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError([f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB; not read"])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader (the pure-Python one, whose composer can be checked) that refuses a
    document expanding past MAX_YAML_NODES through aliases, or referring to itself."""

    def compose_document(self):
        node = super().compose_document()
        _check_expansion(node)
        return node


def _check_expansion(root: yaml.Node) -> None:
    """Count the nodes `root` stands for with every alias expanded (once per distinct node, iteratively)."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])
        if children_done:
            open_nodes.discard(id(node))
            sizes[id(node)] = size = 1 + sum(sizes[id(child)] for child in children)
            if size > MAX_YAML_NODES:
                raise yaml.composer.ComposerError(
                    None, None, f"expands to more than {MAX_YAML_NODES} values through its aliases", node.start_mark)
            continue
        if id(node) in open_nodes:
            raise yaml.composer.ComposerError(None, None, "an alias refers to its own anchor", node.start_mark)
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)


def load_yaml(text: str, path: str) -> object:
    """The document in `text`; ConfigError naming `path` (and the line) when it is not usable YAML."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or exc
    except RecursionError:
        where, reason = "", "nested too deeply"
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits
        where, reason = "", exc
    raise ConfigError([f"{path}: invalid YAML{where}: {reason}"])


def _apply_environment(config: Config, environ: typing.Mapping[str, str]) -> list[str]:
    if not config.node_name:
        # Kubernetes names a node after its host name in lower case.
        config.node_name = environ.get("NODE_NAME") or socket.gethostname().lower()
    server_ip = environ.get("MINDX_SERVER_IP", "").strip()
    if not server_ip or not config.clusterd.enabled:
        return []
    try:
        host = ipaddress.ip_address(server_ip.removeprefix("[").removesuffix("]"))
    except ValueError:
        if not _DNS_NAME.fullmatch(server_ip):
            return [f"MINDX_SERVER_IP: {quote(server_ip)} is not an IP address or host name"]
        host = server_ip
    try:
        _, port = split_host_port(config.clusterd.address)
    except ValueError:
        return []  # validate() names clusterd.address
    config.clusterd.address = f"[{host}]:{port}" if isinstance(host, ipaddress.IPv6Address) else f"{host}:{port}"
    return []


def _build(cls: type, document: object, prefix: str, problems: list[str]):
    where = prefix.rstrip(".") or "configuration"
    if not isinstance(document, dict):
        problems.append(f"{where}: expected a mapping, got {type(document).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in document.items():
        path = f"{prefix}{key}"
        if key not in names:
            problems.append(f"{path}: unknown key (known: {', '.join(sorted(names))})")
            continue
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            values[key] = _build(hint, value, f"{path}.", problems)
        else:
            checked = _check_scalar(hint, value, path, problems)
            if checked is not None:
                values[key] = checked
    return cls(**values)


def _check_scalar(hint, value, path: str, problems: list[str]):
    if hint is bool:
        if isinstance(value, bool):
            return value
        problems.append(f"{path}: expected true or false, got {quote(value)}")
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        problems.append(f"{path}: expected an integer, got {quote(value)}")
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isfinite(value):
                return float(value)
            problems.append(f"{path}: expected a finite number, got {quote(value)}")
        else:
            problems.append(f"{path}: expected a number, got {quote(value)}")
    elif hint is str:
        if isinstance(value, str):
            return value
        problems.append(f"{path}: expected a string, got {quote(value)} (quote it)")
    elif typing.get_origin(hint) is dict:
        if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            return dict(value)
        problems.append(f"{path}: expected a mapping of strings to strings (quote numbers)")
    else:  # pragma: no cover - the schema only uses the types above
        raise TypeError(f"unsupported schema type {hint} at {path}")
    return None


# A node name as ClusterD (agent/sinks/clusterd/pubfault.py) and Kubernetes accept it: a DNS-1123 subdomain.
NODE_NAME = re.compile(r"^[a-z0-9]([a-z0-9\-.]{0,251}[a-z0-9])?$")
_DNS_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9\-.]{0,251}[A-Za-z0-9])?")
_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[^:\s]+):(?P<port>\d{1,5})$")


def split_host_port(text: str) -> tuple[str, int]:
    match = _HOST_PORT.match(text)
    if not match or not 0 <= int(match["port"]) <= 65535:
        raise ValueError(f"{quote(text)} is not HOST:PORT")
    return match["host"].strip("[]"), int(match["port"])


def validate(config: Config) -> list[str]:
    problems: list[str] = []

    def check(ok: bool, path: str, reason: str) -> None:
        if not ok:
            problems.append(f"{path}: {reason}")

    def check_listen(path: str, text: str) -> None:
        try:
            split_host_port(text)
        except ValueError as exc:
            problems.append(f"{path}: {exc}")

    check(config.log.level in ("debug", "info", "warning", "error"), "log.level",
          f"{quote(config.log.level)} is not one of debug, info, warning, error")
    check(config.log.format in ("json", "text"), "log.format", f"{quote(config.log.format)} is not json or text")
    check(bool(NODE_NAME.fullmatch(config.node_name)), "node_name",
          f"{quote(config.node_name)} is not a node name ClusterD and Kubernetes accept (lower-case letters, "
          "digits, '-' and '.', starting and ending with a letter or digit, at most 253 characters); "
          "set node_name or NODE_NAME")
    check(bool(config.state_dir), "state_dir", "must not be empty")
    retire = config.fault_log.retire_unconfigured_cursors_after_seconds
    check(0 <= retire <= 2_592_000, "fault_log.retire_unconfigured_cursors_after_seconds",
          f"{retire} is out of range 0..2592000 (30 days)")
    check_listen("http.listen", config.http.listen)
    check_listen("grpc.listen", config.grpc.listen)
    check_listen("clusterd.address", config.clusterd.address)
    check_listen("taskd_proxy.listen", config.taskd_proxy.listen)
    devices = config.devices
    check(devices.backend in ("dcmi", "simulated"), "devices.backend", f"{quote(devices.backend)} is not dcmi or simulated")
    check(0.2 <= devices.poll_interval_seconds <= 3600, "devices.poll_interval_seconds",
          f"{devices.poll_interval_seconds} is out of range 0.2..3600")
    check(0.05 <= devices.call_timeout_seconds <= 60, "devices.call_timeout_seconds",
          f"{devices.call_timeout_seconds} is out of range 0.05..60")
    check(1 <= devices.simulated.devices <= 64, "devices.simulated.devices",
          f"{devices.simulated.devices} is out of range 1..64")
    if config.faults.unknown_code_level:
        try:
            Level.parse(config.faults.unknown_code_level)
        except ValueError as exc:
            problems.append(f"faults.unknown_code_level: {exc}")
    for level, code in config.clusterd.public_codes.items():
        check(level in Level.__members__ and level != "NormalNPU", f"clusterd.public_codes.{level}",
              "is not a fault level")
        check(bool(re.fullmatch(r"\d{9}", code)), f"clusterd.public_codes.{level}",
              f"{quote(code)} is not a 9-digit public fault code")
    check(30 <= config.clusterd.reconcile_interval_seconds <= 86400, "clusterd.reconcile_interval_seconds",
          f"{config.clusterd.reconcile_interval_seconds} is out of range 30..86400")
    check(0 <= config.profiling.disk_limit_mb, "profiling.disk_limit_mb",
          "must not be negative (0 measures the tree without aging it)")
    proxy = config.taskd_proxy
    check(1 <= proxy.manager_port <= 65535, "taskd_proxy.manager_port", "is not a port number")
    check(0.1 <= proxy.dial_timeout_seconds <= 60, "taskd_proxy.dial_timeout_seconds",
          f"{proxy.dial_timeout_seconds} is out of range 0.1..60")
    check(0 <= proxy.hold_seconds <= 3600, "taskd_proxy.hold_seconds", f"{proxy.hold_seconds} is out of range 0..3600")
    check(1 <= proxy.queue_limit <= 1_000_000, "taskd_proxy.queue_limit",
          f"{proxy.queue_limit} is out of range 1..1000000")
    check(8 <= proxy.job_buffer_mb <= 65536, "taskd_proxy.job_buffer_mb",
          f"{proxy.job_buffer_mb} is out of range 8..65536 (a TaskNet message may be 8 MiB)")
    check(proxy.job_buffer_mb <= proxy.node_buffer_mb <= 65536, "taskd_proxy.node_buffer_mb",
          f"{proxy.node_buffer_mb} is out of range {proxy.job_buffer_mb} (job_buffer_mb)..65536")
    check(not config.datatrace.enabled or config.kubernetes.enabled, "datatrace.enabled",
          "needs kubernetes.enabled")
    check(1 <= config.kubernetes.watch_timeout_seconds <= 3600, "kubernetes.watch_timeout_seconds",
          f"{config.kubernetes.watch_timeout_seconds} is out of range 1..3600")
    check(0.5 <= config.kubernetes.pod_resources_refresh_seconds <= 3600, "kubernetes.pod_resources_refresh_seconds",
          f"{config.kubernetes.pod_resources_refresh_seconds} is out of range 0.5..3600")
    check(not config.kubernetes.device_info_configmap or config.kubernetes.enabled,
          "kubernetes.device_info_configmap", "needs kubernetes.enabled")
    for group, seconds in dataclasses.asdict(config.telemetry.intervals).items():
        check(seconds == 0 or 1 <= seconds <= 86400, f"telemetry.intervals.{group}",
              f"{seconds} is out of range 1..86400 (0 turns the group off)")
    return problems


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


