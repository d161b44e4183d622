"""Which profiling switch files this node should have: a pure function of pods and ConfigMaps.

For every job with a running pod on this node, the directory `<namespace>.data-trace-<job>` under
the datatrace root, holding `profilingSwitch` = the bytes of the `profilingSwitch` key of ConfigMap
`<namespace>/data-trace-<job>`. Names that would become paths are
checked here, so nothing that is not a valid Kubernetes name ever reaches the file system.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field

from agent.kube.jobs import job_of

SWITCH_KEY = "profilingSwitch"
CONFIGMAP_PREFIX = "data-trace-"
DATATRACE_MOUNT = "/user/cluster-info/datatrace-config"  # where training containers see their directory
NPU_ANNOTATION_PREFIX = "huawei.com/Ascend"
MAX_SWITCH_BYTES = 1 << 20  # TaskD reads at most 1 MiB
NAME_MAX = 255  # one path component

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # DNS-1123 label: a namespace
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # a job name


class Keep(enum.Enum):
    """The ConfigMap's value cannot be flushed: leave the file as it is."""
    PREVIOUS = "previous"


@dataclass(frozen=True)
class PodInfo:
    namespace: str
    name: str
    job: str | None  # from the job labels; None when the pod carries none
    uses_datatrace: bool  # an NPU annotation or a container mounting the datatrace path
    running: bool  # not finished (Succeeded/Failed); a terminating pod still trains until it is gone


@dataclass(frozen=True)
class SwitchConfigMap:
    namespace: str
    name: str
    value: bytes | None  # the profilingSwitch key; None when the key is missing


@dataclass
class Desired:
    directories: dict[str, bytes | Keep | None] = field(default_factory=dict)  # dir -> content; None: no file
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (what, why), for one log line each


def valid_namespace(name: str) -> bool:
    return len(name) <= 63 and bool(_LABEL.fullmatch(name))


def valid_job(name: str) -> bool:
    return len(name) <= 253 - len(CONFIGMAP_PREFIX) and bool(_SUBDOMAIN.fullmatch(name))


def directory_name(namespace: str, job: str) -> str | None:
    """`<namespace>.data-trace-<job>`, or None when either is not a valid name or the result too long."""
    if not valid_namespace(namespace) or not valid_job(job):
        return None
    name = f"{namespace}.{CONFIGMAP_PREFIX}{job}"
    return name if len(name.encode()) <= NAME_MAX else None


def parse_directory_name(name: str) -> tuple[str, str] | None:
    """The (namespace, job) of a directory this agent may own, else None (never touch it)."""
    namespace, sep, rest = name.partition(".")
    if not sep or not rest.startswith(CONFIGMAP_PREFIX):
        return None
    job = rest[len(CONFIGMAP_PREFIX):]
    return (namespace, job) if directory_name(namespace, job) == name else None


def switch_problem(value: bytes) -> str | None:
    """Why a switch value must not be flushed, or None. TaskD treats an unparsable file as all off."""
    if len(value) > MAX_SWITCH_BYTES:
        return f"larger than {MAX_SWITCH_BYTES} bytes ({len(value)})"
    try:
        json.loads(value)
    except ValueError as exc:
        return f"not valid JSON: {exc}"
    return None


def desired(pods: list[PodInfo], configmaps: dict[tuple[str, str], SwitchConfigMap]) -> Desired:
    result = Desired()
    for pod in pods:
        if not (pod.running and pod.uses_datatrace and pod.job):
            continue
        directory = directory_name(pod.namespace, pod.job)
        if directory is None:
            result.rejected.append((f"pod {pod.namespace}/{pod.name}",
                                    f"job {pod.job!r} in namespace {pod.namespace!r} is not a valid directory name"))
            continue
        if directory in result.directories:
            continue
        cm = configmaps.get((pod.namespace, CONFIGMAP_PREFIX + pod.job))
        if cm is None:
            result.directories[directory] = None
        elif cm.value is None:
            result.rejected.append((f"configmap {cm.namespace}/{cm.name}", f"no {SWITCH_KEY} key"))
            result.directories[directory] = Keep.PREVIOUS
        elif problem := switch_problem(cm.value):
            result.rejected.append((f"configmap {cm.namespace}/{cm.name}", problem))
            result.directories[directory] = Keep.PREVIOUS
        else:
            result.directories[directory] = cm.value
    return result


def pod_info(pod) -> PodInfo:
    """From a kubernetes V1Pod."""
    meta, spec, status = pod.metadata, pod.spec, pod.status
    annotations = meta.annotations or {}
    mounts = [m.mount_path for c in (spec.containers or []) + (spec.init_containers or [])
              for m in (c.volume_mounts or [])]
    phase = status.phase if status else None
    return PodInfo(namespace=meta.namespace or "", name=meta.name, job=job_of(meta.labels or {}),
                   uses_datatrace=any(k.startswith(NPU_ANNOTATION_PREFIX) for k in annotations)
                   or any(m.rstrip("/") == DATATRACE_MOUNT for m in mounts),
                   running=phase not in ("Succeeded", "Failed"))


def switch_configmap(cm) -> SwitchConfigMap | None:
    """From a kubernetes V1ConfigMap; None for ConfigMaps that are not profiling switches."""
    if not cm.metadata.name.startswith(CONFIGMAP_PREFIX):
        return None
    data = cm.data or {}
    value = data.get(SWITCH_KEY)
    return SwitchConfigMap(cm.metadata.namespace or "", cm.metadata.name,
                           None if value is None else value.encode("utf-8"))
