"""Public faults for ClusterD: which ones a device state means, and ClusterD's validation rules.

Pure functions. A device whose worst level has a public code (`clusterd.public_codes`) is one
public fault. Its `faultId` names one occurrence: (node, device, public code, when the device entered
the level), so the recover matches its own occur and a later occurrence is a different key. ClusterD
deletes a recovered key some seconds later by key alone, from one queue shared by every sender; an
occurrence with a key of its own can never be caught by that deletion, whatever the queue's timing.
Its `faultTime` is the fault's start, repeated in the recover.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from agent._proto import pubfault_pb2 as pb
from agent.model import DeviceState, MIN_TIME_MS, PodRef

MAX_FAULTS_PER_REQUEST = 100
_ID = re.compile(r"^[a-zA-Z0-9\-_.]{8,128}$")
_NODE = re.compile(r"^[a-z0-9]([a-z0-9\-.]{0,251}[a-z0-9])?$")
_DESCRIPTION = re.compile(r"^[\S ]{0,512}$")


@dataclass(frozen=True)
class PublicFault:
    fault_id: str
    code: str  # 9-digit public code
    time_ms: int
    device: int  # physical id
    level: str
    codes: str  # the device's own codes, for people reading ClusterD's view

    def to_dict(self) -> dict:
        return {"id": self.fault_id, "code": self.code, "time_ms": self.time_ms, "device": self.device,
                "level": self.level, "codes": self.codes}

    @classmethod
    def from_dict(cls, item: dict) -> "PublicFault":
        """KeyError/TypeError/ValueError on a malformed item."""
        fault = cls(str(item["id"]), str(item["code"]), int(item["time_ms"]), int(item["device"]),
                    str(item["level"]), str(item["codes"]))
        if not _ID.match(fault.fault_id):
            raise ValueError(f"faultId {fault.fault_id!r}")
        return fault


def fault_id(node: str, device: int, public_code: str, level_since_ms: int) -> str:
    return hashlib.sha256(f"{node}/npu/{device}/{public_code}/{level_since_ms}".encode()).hexdigest()


def public_faults(node: str, state: DeviceState, public_codes: dict[str, str]) -> dict[str, PublicFault]:
    code = public_codes.get(state.level.name)
    if not code:
        return {}
    codes = ",".join(c.text for c in state.codes)
    # (a start ClusterD would refuse cannot come from the engine; older logs may hold one)
    since = state.since_ms if state.since_ms >= MIN_TIME_MS else max(state.level_since_ms, MIN_TIME_MS)
    fault = PublicFault(fault_id(node, state.phy_id, code, state.level_since_ms), code, since, state.phy_id,
                        state.level.name, codes)
    return {fault.fault_id: fault}


def to_message(node: str, assertion: str, fault: PublicFault, pods: tuple[PodRef, ...] = ()) -> pb.Fault:
    """The wire fault. `pods` hold the NPU now: the first one goes into `faultLocation` (ClusterD keeps
    at most 10 entries of up to 128 bytes), all of them into the description (up to 512 characters)."""
    hits = ", ".join(f"{p.namespace}/{p.pod} (container {p.container})" for p in pods)
    description = _clip(f"npu-node-agent: NPU {fault.device} {fault.level} ({fault.codes or 'no code'})"
                        + (f"; pods: {hits}" if hits else ""), 512)
    location = {"device": str(fault.device), "level": _clip(fault.level, 128), "codes": _clip(fault.codes, 128)}
    if pods:
        location.update(namespace=_clip(pods[0].namespace, 128), pod=_clip(pods[0].pod, 128),
                        container=_clip(pods[0].container, 128), pods=str(len(pods)))
    return pb.Fault(
        faultId=fault.fault_id, faultType="NPU", faultCode=fault.code, faultTime=fault.time_ms, assertion=assertion,
        faultLocation=location, influence=[pb.PubFaultInfo(nodeName=node, deviceIds=[fault.device])],
        description=description)


def _clip(text: str, limit: int) -> str:
    """At most `limit` bytes (which is also at most `limit` characters), cut on a character boundary,
    with tabs and line breaks (which ClusterD refuses in a description) turned into spaces."""
    text = re.sub(r"\s", " ", text)
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[:limit - 3].decode(errors="ignore") + "..."


def _time_ok(value: int) -> bool:
    return len(str(value)) == 13 and value >= MIN_TIME_MS


def request_problems(request: pb.PublicFaultRequest) -> list[str]:
    """ClusterD's request-level rules; any problem means a 409 for the whole request."""
    problems = []
    if not _ID.match(request.id):
        problems.append(f"id {request.id!r} does not match {_ID.pattern}")
    if not _time_ok(request.timestamp):
        problems.append(f"timestamp {request.timestamp} is not 13-digit ms on or after 2025-01-01")
    if request.version != "1.0":
        problems.append(f"version {request.version!r} is not 1.0")
    if not 1 <= len(request.faults) <= MAX_FAULTS_PER_REQUEST:
        problems.append(f"{len(request.faults)} faults (1..100 allowed)")
    return problems


def fault_problems(fault: pb.Fault, known_codes: frozenset[str] | None = None) -> list[str]:
    """ClusterD's per-fault rules; a fault with a problem is dropped silently by ClusterD."""
    problems = []
    if not _ID.match(fault.faultId):
        problems.append(f"faultId {fault.faultId!r} does not match {_ID.pattern}")
    if fault.faultType not in ("NPU", "Node", "Network", "Storage"):
        problems.append(f"faultType {fault.faultType!r}")
    if len(fault.faultCode) != 9 or (known_codes is not None and fault.faultCode not in known_codes):
        problems.append(f"faultCode {fault.faultCode!r} is not a configured 9-character public code")
    if not _time_ok(fault.faultTime):
        problems.append(f"faultTime {fault.faultTime} is not 13-digit ms on or after 2025-01-01")
    if fault.assertion not in ("occur", "recover", "once"):
        problems.append(f"assertion {fault.assertion!r}")
    if len(fault.faultLocation) > 10 or any(len(k.encode()) > 16 or len(v.encode()) > 128
                                            for k, v in fault.faultLocation.items()):
        problems.append("faultLocation: at most 10 entries, keys up to 16 bytes, values up to 128 bytes")
    if not 1 <= len(fault.influence) <= 1000:
        problems.append(f"{len(fault.influence)} influence entries (1..1000 allowed)")
    for info in fault.influence:
        if info.nodeName and not _NODE.fullmatch(info.nodeName):
            problems.append(f"nodeName {info.nodeName!r} is not a DNS-1123 name")
        if not info.nodeName and not info.nodeSN:
            problems.append("influence without nodeName or nodeSN")
        ids = list(info.deviceIds)
        if not 1 <= len(ids) <= 32 or len(set(ids)) != len(ids) or any(not 0 <= i < 32 for i in ids):
            problems.append(f"deviceIds {ids}: 1..32 unique ids in 0..31")
    if not _DESCRIPTION.match(fault.description):
        problems.append("description: up to 512 characters, no tabs or line breaks")
    return problems
