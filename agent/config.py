"""The agent's configuration: every key declared once, YAML loading, environment overrides, validation.

Each key is a dataclass field made by `key()`: its default, its meaning and what it accepts. From
that one declaration the agent validates a configuration (every problem listed at once), and
tests/support/gendocs.py writes docs/configuration.md, the chart's `agent:` values, their schema and
the chart README's table; tests fail while a generated file differs. Every key is optional; an
unknown key is an error that names its full path, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
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

Number = typing.Union[int, float]


@dataclass(frozen=True)
class Key:
    """What a key means and accepts. Cross-key rules are `needs` and `floor`; anything else a
    `check` says (it raises ValueError with the reason)."""

    meaning: str  # one line of Markdown, for the docs, the chart's values and its README
    between: tuple[Number, Number | None] | None = None  # inclusive range (None: no maximum)
    off: Number | None = None  # a value outside `between` that turns the feature off
    note: str = ""  # why the range is what it is, said with a range error
    choices: tuple = ()
    shape: str = ""  # "host_port", "absolute_path", "absolute_path_or_empty", "not_empty" or "namespaces"
    needs: str = ""  # a boolean key that must be true when this boolean one is
    floor: str = ""  # a key (of the same section) whose value is this one's minimum
    check: typing.Callable[[typing.Any], None] | None = None
    accepts: str = ""  # what `check` accepts, for the docs
    mapping: tuple[tuple[str, ...], str, str] | None = None  # a mapping's keys, its values' regex and their name

    def text(self) -> str:
        """What the key accepts, in Markdown (the docs' and the chart README's "accepts" column)."""
        if self.accepts:
            return self.accepts
        if self.choices:
            return ", ".join(f"`{choice}`" if choice else '`""`' for choice in self.choices)
        if self.shape:
            return {"host_port": "`HOST:PORT`", "absolute_path": "absolute path",
                    "absolute_path_or_empty": 'absolute path or `""`', "not_empty": "not empty",
                    "namespaces": "namespace names, each once"}[self.shape]
        if self.mapping:
            keys, _, name = self.mapping
            return f"`{keys[0]}` … `{keys[-1]}` → {name}"
        if self.between:
            low, high = self.between
            floor = f"`{self.floor}`" if self.floor else _number(low)
            shown = f"≥ {floor}" if high is None else f"{floor}..{_number(high)}"
            return f"{_number(self.off)} (off) or {shown}" if self.off is not None else shown
        return ""


def key(default, meaning: str, **accepts) -> typing.Any:
    """A configuration key: a dataclass field carrying its declaration (see `Key`)."""
    if accepts.get("needs"):
        meaning = f"{meaning}; needs `{accepts['needs']}`"
    declared = {"key": Key(meaning, **accepts)}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=declared)
    return field(default=default, metadata=declared)


def section(cls: type) -> typing.Any:
    return field(default_factory=cls)


def _number(value: Number | None) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _node_name(name: str) -> None:
    if not NODE_NAME.fullmatch(name):
        raise ValueError(f"{quote(name)} is not a node name ClusterD and Kubernetes accept (lower-case letters, "
                         "digits, '-' and '.', starting and ending with a letter or digit, at most 253 characters); "
                         "set node_name or NODE_NAME")


def _level_or_empty(name: str) -> None:
    if name:
        Level.parse(name)


FAULT_LEVELS = tuple(level.name for level in Level if level is not Level.NormalNPU)


@dataclass
class LogConfig:
    level: str = key("info", "how much is logged", choices=("debug", "info", "warning", "error"))
    format: str = key("json", "`json`: one object per line on stderr; `text`: for people", choices=("json", "text"))


@dataclass
class HttpConfig:
    listen: str = key("0.0.0.0:9410", "where `/metrics`, `/healthz` and `/readyz` are served; the host may be "
                      "`${NAME}`, an environment variable's value (the chart's `${POD_IP}` under `hostNetwork`)",
                      shape="host_port")
    token_auth: bool = key(False, "`/metrics` only for a bearer token the API server accepts (TokenReview) whose user "
                           "may `get` the non-resource URL `/metrics` (SubjectAccessReview), as the kubelet checks "
                           "its scrapers; `/healthz` and `/readyz` stay open. The agent's service account needs "
                           "`create` on `tokenreviews` and `subjectaccessreviews`", needs="kubernetes.enabled")
    token_auth_timeout_seconds: float = key(3.0, "how long each review may take; a scrape may wait for two (a "
                                            "TokenReview, then a SubjectAccessReview), so both fit in "
                                            "Prometheus's default 10 s scrape time-out", between=(0.5, 30))


@dataclass
class TlsConfig:
    cert_file: str = key("", "PEM certificate (with its chain) that `/metrics` and the gRPC server present; empty: "
                         "both serve plaintext (local use, the demo). Re-read when it changes, no restart",
                         shape="absolute_path_or_empty", needs="tls.key_file")
    key_file: str = key("", "the PEM private key of `cert_file`", shape="absolute_path_or_empty",
                        needs="tls.cert_file")
    client_ca_file: str = key("", "PEM CA certificates: a gRPC client must present a certificate one of them signed "
                              "(mTLS); empty: none is asked for", shape="absolute_path_or_empty",
                              needs="tls.cert_file")


@dataclass
class GrpcConfig:
    listen: str = key("0.0.0.0:9411", "where the fault stream (`npuagent.v1.NodeFaults`), gRPC health and "
                      "reflection are served; the host may be `${NAME}`, as in `http.listen`", shape="host_port")


@dataclass
class SimulatedConfig:
    devices: int = key(8, "NPUs of the simulated backend", between=(1, 64))
    chip_name: str = key("910B3", "the chip name the simulated NPUs report", shape="not_empty")
    scenario: str = key("", "YAML file of timed fault injections for the simulated backend; empty: none")


@dataclass
class DevicesConfig:
    backend: str = key("dcmi", "`dcmi`: the NPU driver's `libdcmi.so`; `simulated`: fake NPUs, to try the agent "
                       "without NPUs", choices=("dcmi", "simulated"))
    dcmi_library: str = key("", "path of `libdcmi.so`; empty: `LD_LIBRARY_PATH`, the ld cache, then "
                            "`/usr/local/Ascend/driver/lib64/driver/libdcmi.so`")
    poll_interval_seconds: float = key(5.0, "how often every device's health and error codes are read; the "
                                       "driver's fault events arrive in between", between=(0.2, 3600))
    call_timeout_seconds: float = key(2.0, "a driver call slower than this marks the device unknown (health `-1`) "
                                      "and keeps its last known faults", between=(0.05, 60))
    simulated: SimulatedConfig = section(SimulatedConfig)


@dataclass
class FaultLogConfig:
    retire_unconfigured_cursors_after_seconds: float = key(
        86400.0, "how long the cursor of a sink that is switched off (`clusterd.enabled: false`) is kept, from the "
        "first start without it: switched back on within it, the sink resumes where it was; then the cursor is "
        "dropped so that the fault log compacts again (switched on later, the sink resynchronises its peer from "
        "the current state)", between=(0, 2_592_000), note="30 days")


@dataclass
class FaultsConfig:
    fault_code_file: str = key("", "code-to-level table in the device plugin's `faultCode.json` format; empty: the "
                               "built-in table (every code of the device plugin's shipped file). Re-read when it "
                               "changes; a bad file keeps the rules in force")
    customization_file: str = key("", "frequency and duration escalation rules in the device plugin's "
                                  "`faultCustomization.json` format; empty: the built-in rules (the device plugin's "
                                  "shipped file; `{}` in a file means none). Re-read when it changes")
    unknown_code_level: str = key("", "the level of a code no table lists; empty: the driver's severity decides, "
                                  "as in the device plugin", choices=("", *FAULT_LEVELS), check=_level_or_empty)


def resource_names(text: str) -> list[str]:
    """`clusterd.resources` as a list (empty: none)."""
    return [name.strip() for name in text.split(",")] if text.strip() else []


def _resource_names(text: str) -> None:
    names = resource_names(text)
    if any(not name for name in names):
        raise ValueError(f"{quote(text)} has an empty resource name")
    if len(set(names)) != len(names):
        raise ValueError(f"{quote(text)} lists a resource twice")


def namespaced(text: str) -> tuple[str, str]:
    """`namespace/rest` (`clusterd.pods`, `clusterd.saved_faults`) as its two parts; ("", "") when empty."""
    namespace, _, rest = text.partition("/")
    return (namespace, rest) if text else ("", "")


def _namespaced(text: str) -> None:
    namespace, rest = namespaced(text)
    if text and (not NAMESPACE.fullmatch(namespace) or not rest.strip()):
        raise ValueError(f"{quote(text)} is not `namespace/...` with a namespace name and something after the '/'")


DEFAULT_PUBLIC_CODES = {
    "SubHealthFault": "010011001", "PreSeparateNPU": "010011002", "RestartRequest": "020011002",
    "RestartBusiness": "020011002", "FreeRestartNPU": "020011002", "RestartNPU": "020011002",
    "SeparateNPU": "020011001", "ManuallySeparateNPU": "020011001",
}


@dataclass
class ClusterdConfig:
    enabled: bool = key(False, "send public faults to ClusterD's `PubFault` service")
    address: str = key("clusterd-grpc-svc.mindx-dl.svc.cluster.local:8899",
                       "ClusterD's gRPC address; `MINDX_SERVER_IP` replaces the host", shape="host_port")
    resource: str = key("npu-node-agent", "the resource the agent sends as; ClusterD accepts only resources its "
                        "configuration lists", shape="not_empty")
    public_codes: dict[str, str] = key(
        DEFAULT_PUBLIC_CODES, "the public fault code sent for a device at each level; a level left out is not sent",
        mapping=(FAULT_LEVELS, r"[0-9]{9}", "a 9-digit public fault code"))
    resources: str = key("", "resources to spread the cluster's nodes over, comma-separated: each node always "
                         "sends under the same one (a stable hash of its node name); every one multiplies ClusterD's "
                         "budget (1 request/s per resource) and must be listed in ClusterD's configuration; empty: "
                         "`resource` only", check=lambda text: _resource_names(text),
                         accepts="resource names, comma-separated, each once")
    # One request per 100 faults (held, or recovered in the last 10 minutes), nothing from a node
    # without; ClusterD's budget of 1 request/s is shared by every node of the cluster.
    reconcile_interval_seconds: float = key(
        1800.0, "the shortest period at which the agent re-sends what ClusterD should hold (and the recent "
        "recovers it should not), for a ClusterD that restarted without the agent noticing (its saved faults lost, "
        "or behind a proxy); longer when `cluster_nodes` needs it", between=(30, 86400))
    cluster_nodes: int = key(256, "about how many nodes run the agent and send to ClusterD: the periodic "
                             "re-sending is spread so that all of them together spend under 4 % of ClusterD's budget "
                             "(a period of at least 25 s per node and resource), and up to 256 nodes keep their "
                             "connection while they hold faults (to re-send at once when ClusterD restarts); set it "
                             "on larger clusters, whose nodes then connect only to send", between=(1, 1000000))
    pods: str = key("mindx-dl/app=clusterd", "ClusterD's pods as `namespace/label-selector`, watched (with "
                    "`kubernetes.enabled`) to notice a ClusterD restart that a node connected only to send (`cluster_nodes` "
                    "above 256) cannot see; the node then checks `saved_faults` and sends what ClusterD lacks; empty: "
                    "not watched", check=_namespaced, accepts="`NAMESPACE/SELECTOR` or `\"\"`")
    saved_faults: str = key("cluster-system/statistic-fault-info", "the ConfigMap where ClusterD saves its public "
                            "faults, as `namespace/name`, read (with `kubernetes.enabled`) before every re-sending (at "
                            "start, after a ClusterD restart or a lost connection, periodically), so that only what "
                            "ClusterD lacks, or holds and should not, is sent; empty, unreadable, or stale (over "
                            "4,500 faults): everything is re-sent",
                            check=_namespaced, accepts="`NAMESPACE/NAME` or `\"\"`")
    idle_disconnect_seconds: float = key(
        60.0, "how long the connection to ClusterD stays open after the last request (ClusterD admits 1,024 "
        "connections for the whole cluster); with `cluster_nodes` up to 256, a node holding faults stays connected",
        between=(10, 86400))


@dataclass
class KubernetesConfig:
    enabled: bool = key(False, "use the API server (in-cluster configuration, else `KUBECONFIG`): this node's pods "
                        "give the step metrics their job labels and the TaskD proxy its pod check; "
                        "`device_info_configmap` and `datatrace.enabled` need it")
    device_info_configmap: bool = key(False, "write `kube-system/mindx-dl-deviceinfo-<node>` as the device plugin "
                                      "does; only where the device plugin does not (both would overwrite each "
                                      "other)", needs="kubernetes.enabled")
    node_condition: bool = key(False, "keep an `NPUProblem` condition on this node's Node object (`kubectl describe "
                               "node`): True when a fault interrupts the workload on a chip (level RestartRequest or "
                               "above, or an NPU the driver calls unhealthy without a code), with the worst level as "
                               "its reason and those NPUs with their codes and pods as its message; False otherwise "
                               "(with lower-level codes only, their worst level as reason and the NPUs listed); "
                               "Unknown while the driver cannot be read; written on change (at most once a second) and every 5 minutes. False "
                               "removes a condition left by an earlier run. Patches `nodes/status`",
                               needs="kubernetes.enabled")
    events: bool = key(False, "post Kubernetes Events when an NPU's fault occurs, recovers or is escalated, on the "
                       "Node and on the pod holding the NPU (`kubectl get events`), aggregated and rate-limited "
                       "as client-go does (at most 25 writes per object, then one per 5 minutes), so that a "
                       "flapping NPU cannot flood the API server", needs="kubernetes.enabled")
    watch_timeout_seconds: int = key(300, "the server ends each list/watch after this and the agent resumes it",
                                     between=(1, 3600))
    pod_resources_socket: str = key("/var/lib/kubelet/pod-resources/kubelet.sock",
                                    "the kubelet's PodResources socket, to name the pod holding each NPU; empty: no "
                                    "attribution. Needs no API server", shape="absolute_path_or_empty")
    pod_resources_refresh_seconds: float = key(10.0, "how often the pods holding NPUs are asked for (also right "
                                               "after a fault changes)", between=(0.5, 3600))


@dataclass
class ProfilingConfig:
    root: str = key("/user/cluster-info/profiling", "the profiling directory the training processes write their "
                    "records to (`<root>/<job>/<rank>/<file>`)", shape="absolute_path")
    disk_limit_mb: int = key(5000, "MiB (as TaskD counts) the profiling tree may hold before the disk guard deletes "
                             "its oldest record files; 0 measures without deleting", between=(0, None),
                             note="0 measures the tree without aging it")
    disk_guard: bool = key(True, "keep `disk_limit_mb` on this node as its one owner (false: leave it to TaskD's "
                           "workers, each of which walks the tree); loaded once the root first holds something")
    metrics: bool = key(True, "read the records into per-rank step metrics and detect slow ranks; loaded once the "
                        "root first holds something")


@dataclass
class DatatraceConfig:
    enabled: bool = key(False, "keep `<root>/<namespace>.data-trace-<job>/profilingSwitch` equal to the "
                        "`data-trace-<job>` ConfigMaps; not where the device plugin also writes them",
                        needs="kubernetes.enabled")
    root: str = key("/user/cluster-info/datatrace-config", "the directory training containers read their "
                    "profiling switch from", shape="absolute_path")
    namespaces: list[str] = key([], "the namespaces whose `data-trace-<job>` ConfigMaps are watched, one watch each "
                                "(what per-namespace Roles allow); empty: every namespace, one cluster-wide watch",
                                shape="namespaces")


@dataclass
class TaskdProxyConfig:
    enabled: bool = key(False, "serve TaskD's TaskNet for every job on the node")
    listen: str = key("127.0.0.1:9602", "where the node's TaskNet proxy listens (TaskD workers dial "
                      "`127.0.0.1:9602`)", shape="host_port")
    manager_port: int = key(9601, "the port of each job's TaskD manager, on the job's `MASTER_ADDR` "
                            "(`MS_SCHED_HOST` for MindSpore)", between=(1, 65535))
    dial_timeout_seconds: float = key(5.0, "per attempt to reach a job's manager; retried with backoff",
                                      between=(0.1, 60))
    hold_seconds: float = key(60.0, "how long a message waits for an unreachable manager before its sender gets an "
                              "error", between=(0, 3600))
    queue_limit: int = key(1024, "messages held per job while its manager is unreachable", between=(1, 1_000_000))
    # Messages are held in their wire form, so the node default fits the chart's 512 MiB memory limit with room.
    job_buffer_mb: int = key(32, "MiB of messages the proxy may hold for one job (to its manager or queued for its "
                             "workers); more is refused with TaskNet's code 5001", between=(8, 65536),
                             note="a TaskNet message may be 8 MiB")
    node_buffer_mb: int = key(64, "MiB of messages the proxy may hold for the whole node", between=(8, 65536),
                              floor="job_buffer_mb")


def _interval(default: float, what: str) -> typing.Any:
    return key(default, f"seconds between two {what}", between=(1, 86400), off=0, note="0 turns the group off")


@dataclass
class TelemetryIntervals:
    """Seconds between two collections of each of npu-exporter's groups (its defaults); 0 turns a group off."""
    utilization: float = _interval(1.0, "reads of AI core, vector, cube and overall utilization")
    npu: float = _interval(5.0, "reads of temperature, power, voltage, AI core frequency, network health and NPU "
                           "processes")
    hbm: float = _interval(60.0, "reads of HBM memory, temperature, bandwidth and ECC counters")
    hccs: float = _interval(60.0, "reads of the HCCS link counters and bandwidths (the bandwidth call samples for "
                            "200 ms)")
    pcie: float = _interval(60.0, "reads of the PCIe bandwidths, A2 chips only (samples for 200 ms)")
    sio: float = _interval(60.0, "reads of the SIO CRC error counters between the dies, A3 chips only")
    network: float = _interval(60.0, "runs of hccn_tool for link status, bandwidth, speed and link-up count")
    roce: float = _interval(60.0, "runs of hccn_tool -stat (MAC and RoCE counters)")
    optical: float = _interval(60.0, "runs of hccn_tool -optical (module presence, power, voltage, temperature)")


@dataclass
class TelemetryConfig:
    enabled: bool = key(False, "npu-exporter's telemetry families (utilization, HBM, temperature, power, ECC, HCCS, "
                        "PCIe, SIO, network, RoCE, optical) under its names: on to replace npu-exporter on the node, "
                        "off beside it (one driver session and one copy of each series)")
    hccn_tool: str = key("/usr/local/Ascend/driver/tools/hccn_tool", "the driver's hccn_tool, for the network, RoCE "
                         "and optical groups; empty leaves those groups out")
    intervals: TelemetryIntervals = section(TelemetryIntervals)


@dataclass
class Config:
    node_name: str = key("", "this node's name as Kubernetes and ClusterD know it; empty: `NODE_NAME`, else the "
                         "host name in lower case", check=_node_name,
                         accepts="lower-case letters, digits, `-` and `.`, starting and ending with a letter or "
                         "digit, at most 253 characters")
    state_dir: str = key("/var/lib/npu-node-agent", "directory of what survives a restart: the fault log and the "
                         "sinks' cursors (`faultlog/`), the escalation history, the step metrics' state and the "
                         "profiling tailer's offsets", shape="absolute_path")
    fault_log: FaultLogConfig = section(FaultLogConfig)
    log: LogConfig = section(LogConfig)
    http: HttpConfig = section(HttpConfig)
    grpc: GrpcConfig = section(GrpcConfig)
    tls: TlsConfig = section(TlsConfig)
    devices: DevicesConfig = section(DevicesConfig)
    faults: FaultsConfig = section(FaultsConfig)
    clusterd: ClusterdConfig = section(ClusterdConfig)
    kubernetes: KubernetesConfig = section(KubernetesConfig)
    profiling: ProfilingConfig = section(ProfilingConfig)
    datatrace: DatatraceConfig = section(DatatraceConfig)
    taskd_proxy: TaskdProxyConfig = section(TaskdProxyConfig)
    telemetry: TelemetryConfig = section(TelemetryConfig)


def load_config(path: str | None, environ: typing.Mapping[str, str] | None = None, hosts: bool = True) -> Config:
    """Read, override from the environment, and validate; raises ConfigError listing every problem.
    `hosts`: take `${NAME}` hosts from the environment (check-config leaves them to the start)."""
    environ = os.environ if environ is None else environ
    document = (load_yaml(read_config_file(path), path) or {}) if path else {}
    return config_from_dict(document, environ, hosts)


def config_from_dict(document: object, environ: typing.Mapping[str, str] | None = None, hosts: bool = True) -> Config:
    """The same as `load_config` for an in-memory document (used by `demo` and tests)."""
    # One pass: a key of the wrong type is reported and keeps its default, and the checks of its value
    # (and those that refer to it) are skipped; every other key is still checked, so all problems show at once.
    problems: list[str] = []
    wrong_type: set[str] = set()
    config = _build(Config, document, "", problems, wrong_type)
    problems += _apply_environment(config, {} if environ is None else environ, hosts)
    problems += validate(config, wrong_type)
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


def _apply_environment(config: Config, environ: typing.Mapping[str, str], hosts: bool = True) -> list[str]:
    if not config.node_name:
        # Kubernetes names a node after its host name in lower case.
        config.node_name = environ.get("NODE_NAME") or socket.gethostname().lower()
    problems = _expand_hosts(config, environ) if hosts else []
    server_ip = environ.get("MINDX_SERVER_IP", "").strip()
    if not server_ip or not config.clusterd.enabled:
        return problems
    try:
        host = ipaddress.ip_address(server_ip.removeprefix("[").removesuffix("]"))
    except ValueError:
        if not _DNS_NAME.fullmatch(server_ip):
            return [*problems, f"MINDX_SERVER_IP: {quote(server_ip)} is not an IP address or host name"]
        host = server_ip
    try:
        _, port = split_host_port(config.clusterd.address)
    except ValueError:
        return problems  # validate() names clusterd.address
    config.clusterd.address = f"[{host}]:{port}" if isinstance(host, ipaddress.IPv6Address) else f"{host}:{port}"
    return problems


_HOST_VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)\}:(?P<port>[^:]*)")


def _expand_hosts(settings: object, environ: typing.Mapping[str, str], prefix: str = "") -> list[str]:
    """`${NAME}:PORT` in a HOST:PORT key: the host from the environment (e.g. the pod's IP, which the
    downward API gives only as a variable), an IPv6 address bracketed."""
    problems = []
    for item in dataclasses.fields(settings):
        value, path = getattr(settings, item.name), f"{prefix}{item.name}"
        if dataclasses.is_dataclass(value):
            problems += _expand_hosts(value, environ, f"{path}.")
        elif item.metadata.get("key") and item.metadata["key"].shape == "host_port":
            if not (match := _HOST_VARIABLE.fullmatch(value)):
                continue
            host = environ.get(match["name"], "").strip()
            if not host:
                problems.append(f"{path}: {quote(value)}: {match['name']} is not set in the environment")
                continue
            bracketed = ":" in host and not host.startswith("[")
            setattr(settings, item.name, f"[{host}]:{match['port']}" if bracketed else f"{host}:{match['port']}")
    return problems


def _build(cls: type, document: object, prefix: str, problems: list[str], wrong_type: set[str],
           root: type | None = None):
    """`cls` from `document`; each key of the wrong type (or section that is not a mapping) is a problem,
    keeps its default and has its path added to `wrong_type`."""
    root = root or cls
    where = prefix.rstrip(".") or "configuration"
    if not isinstance(document, dict):
        problems.append(f"{where}: expected a mapping, got {type(document).__name__}")
        wrong_type.add(prefix.rstrip("."))
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in document.items():
        path = f"{prefix}{key}"
        if key not in names:
            problems.append(f"{path}: unknown key (known: {', '.join(sorted(names))})")
            if suggestion := _did_you_mean(root, prefix, key, value, names):  # its own line: the one above stays as it was
                problems.append(f"{path}: {suggestion}")
            continue
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            values[key] = _build(hint, value, f"{path}.", problems, wrong_type, root)
        else:
            checked = _check_scalar(hint, value, path, problems)
            if checked is not None:
                values[key] = checked
            else:
                wrong_type.add(path)
    return cls(**values)


@functools.lru_cache(maxsize=8)
def key_paths(cls: type, prefix: str = "") -> dict[str, bool]:
    """Every section and key of `cls` by its dotted path: True for a section."""
    paths: dict[str, bool] = {}
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        section = dataclasses.is_dataclass(hints[item.name])
        paths[f"{prefix}{item.name}"] = section
        if section:
            paths.update(key_paths(hints[item.name], f"{prefix}{item.name}."))
    return paths


def _did_you_mean(root: type, prefix: str, key: object, value: object, names: set[str]) -> str:
    """For an unknown key: the key it was likely meant to be, in its section or anywhere (a key put in
    the wrong section, a dotted path written flat, `log_level` for `log.level`); "" when none is close."""
    if not isinstance(key, str) or len(key) > 200:
        return ""
    paths = key_paths(root)
    if "." in key and f"{prefix}{key}" in paths:
        first, *rest = f"{prefix}{key}".split(".")
        nested = "..."
        for name in reversed(rest):
            nested = f"{{{name}: {nested}}}"
        return f"a dotted key is not nested: write {first}: {nested}"
    near = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.75)
    if near:
        return f"did you mean {prefix}{near[0]}?"
    # Elsewhere: a section for a mapping, a key for anything else, by its name or its path with `_` for `.`.
    fitting = [path for path, section in paths.items() if section == isinstance(value, dict)]
    for spelling in (lambda path: path.rpartition(".")[2], lambda path: path.replace(".", "_")):
        spelt: dict[str, list[str]] = {}
        for path in fitting:
            spelt.setdefault(spelling(path), []).append(path)
        found = spelt.get(key) or [path for near in difflib.get_close_matches(key, sorted(spelt), n=1, cutoff=0.85)
                                   for path in spelt[near]]
        found = [path for path in found if path != f"{prefix}{key}"]
        if found:  # more than three are a guess, not a suggestion
            return f"did you mean {' or '.join(found)}?" if len(found) <= 3 else ""
    return ""


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
    elif typing.get_origin(hint) is list:
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return list(value)
        problems.append(f"{path}: expected a list of strings")
    elif typing.get_origin(hint) is dict:
        if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            return dict(value)
        problems.append(f"{path}: expected a mapping of strings to strings (quote numbers)")
    else:  # pragma: no cover - the schema only uses the types above
        raise TypeError(f"unsupported schema type {hint} at {path}")
    return None


# A node name as ClusterD (agent/sinks/clusterd/pubfault.py) and Kubernetes accept it: a DNS-1123 subdomain.
NODE_NAME = re.compile(r"^[a-z0-9]([a-z0-9\-.]{0,251}[a-z0-9])?$")
NAMESPACE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")  # a DNS-1123 label
_DNS_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9\-.]{0,251}[A-Za-z0-9])?")
_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[^:\s]+):(?P<port>\d{1,5})$")


def split_host_port(text: str) -> tuple[str, int]:
    match = _HOST_PORT.match(text)
    if not match or not 0 <= int(match["port"]) <= 65535:
        raise ValueError(f"{quote(text)} is not HOST:PORT")
    return match["host"].strip("[]"), int(match["port"])


def validate(config: Config, wrong_type: typing.Collection[str] = ()) -> list[str]:
    """Every problem of `config` against its keys' declarations, one line each; the keys in
    `wrong_type` (already reported, left at their defaults) and the checks that refer to them are skipped."""
    return declared_problems(config, config, skip=frozenset(wrong_type))


def declared_problems(settings: object, root: object, prefix: str = "", skip: frozenset[str] = frozenset()) -> list[str]:
    """The problems of each key of the dataclass `settings` (within `root`, where `needs` is looked up)."""
    problems: list[str] = []
    for item in dataclasses.fields(settings):
        value, path = getattr(settings, item.name), f"{prefix}{item.name}"
        if path in skip:
            continue
        if dataclasses.is_dataclass(value):
            problems += declared_problems(value, root, f"{path}.", skip)
        elif declared := item.metadata.get("key"):
            if _refers_to(declared, prefix, skip):
                continue
            problems += [f"{where}: {reason}" for where, reason in _problems(declared, value, path, settings, root)]
    return problems


def _refers_to(declared: Key, prefix: str, skip: frozenset[str]) -> bool:
    """Whether a cross-key rule of `declared` reads a key in `skip` (whose default would stand for the
    value the file meant)."""
    others = [declared.needs, f"{prefix}{declared.floor}" if declared.floor else ""]
    return any(other and any(other == bad or other.startswith(f"{bad}.") for bad in skip) for other in others)


def _problems(declared: Key, value, path: str, settings: object, root: object) -> list[tuple[str, str]]:
    if declared.check:
        try:
            declared.check(value)
        except ValueError as exc:
            return [(path, str(exc))]
    elif declared.choices and value not in declared.choices:
        shown = [str(choice) for choice in declared.choices]
        alternatives = " or ".join(shown) if len(shown) == 2 else f"one of {', '.join(shown)}"
        return [(path, f"{quote(value)} is not {alternatives}")]
    if declared.shape == "host_port":
        try:
            split_host_port(value)
        except ValueError as exc:
            return [(path, str(exc))]
    elif declared.shape == "not_empty" and not value:
        return [(path, "must not be empty")]
    elif declared.shape == "namespaces":
        bad = [name for name in value if not NAMESPACE.fullmatch(name)]
        if bad or len(set(value)) != len(value):
            return [(path, f"{quote(bad[0])} is not a namespace name" if bad else "a namespace is listed twice")]
    elif declared.shape.startswith("absolute_path") and not value.startswith("/"):
        if value or declared.shape == "absolute_path":
            return [(path, f"{quote(value)} is not an absolute path")]
    if declared.needs and value and not _lookup(root, declared.needs):
        return [(path, f"needs {declared.needs}")]
    if declared.mapping:
        names, pattern, name = declared.mapping
        return [(f"{path}.{k}", f"is not one of {', '.join(names)}") for k in value if k not in names] + [
            (f"{path}.{k}", f"{quote(v)} is not {name}") for k, v in value.items() if not re.fullmatch(pattern, v)]
    if declared.between and value != declared.off:
        low, high = declared.between
        floor = getattr(settings, declared.floor) if declared.floor else low
        if value < floor or (high is not None and value > high):
            note = f" ({declared.note})" if declared.note else ""
            if high is None and floor == 0:
                return [(path, f"must not be negative{note}")]
            shown = f"{floor} ({declared.floor})" if declared.floor else _number(low)
            return [(path, f"{value} is out of range {shown}..{_number(high) if high is not None else ''}{note}")]
    return []


def _lookup(root: object, path: str):
    for name in path.split("."):
        root = getattr(root, name)
    return root


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


