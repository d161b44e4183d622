"""What the node's `NPUProblem` condition says, from the devices' states: a pure function.

Status True means a problem that interrupts work on a chip (node-problem-detector's convention:
`KernelDeadlock`, `ReadonlyFilesystem`; drain controllers act on it): some NPU's worst active fault
level is RestartRequest or above (ACTING_LEVEL: the workload on the chip must at least be restarted),
or the driver calls an NPU unhealthy with no fault code. Its reason is the worst level (`SeparateNPU`,
CamelCase as Kubernetes wants reasons; `NPUUnhealthy` for an unhealthy NPU without a code).

Status False when no NPU has such a problem: with only lower-level codes (NotHandleFault,
SubHealthFault; the workload goes on), the reason is the worst of those levels and the message lists
the NPUs that have them; with none, `NPUsHealthy`. Kubernetes conventions allow a reason on False.

The message names each NPU with a code or unhealthy, with its level, codes and the pods holding it,
worst first, within MESSAGE_LIMIT bytes. Unknown while the agent cannot tell: the driver cannot be
read, not every NPU has been polled yet, or an NPU's health cannot be read and none has a problem
that interrupts work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from agent.model import DeviceState, Health, Level, PodsOf

CONDITION_TYPE = "NPUProblem"
ACTING_LEVEL = Level.RestartRequest  # from this level up a fault interrupts the workload on the chip: True
MESSAGE_LIMIT = 1024  # bytes; `kubectl describe node` shows a condition's message on one line
HEALTHY = "NPUsHealthy"
UNKNOWN = "NPUStateUnknown"
UNHEALTHY = "NPUUnhealthy"  # the driver says unhealthy, with no fault code listed


@dataclass(frozen=True)
class Condition:
    status: str  # "True", "False" or "Unknown"
    reason: str
    message: str


def npu_problem(states: Iterable[DeviceState], pods_of: PodsOf, *, polled: bool, driver_problem: str = "") -> Condition:
    """The condition for these device states. `polled`: every device was polled since the start
    (before, the states are the fault log's, maybe stale); `driver_problem`: why the driver cannot
    be read now ("" when it can)."""
    if driver_problem:
        return Condition("Unknown", UNKNOWN, bounded([f"the NPU driver cannot be read: {driver_problem}"]))
    if not polled:
        return Condition("Unknown", UNKNOWN, "the agent has not polled every NPU since it started")
    states = sorted(states, key=lambda state: state.phy_id)
    listed = [state for state in states if state.codes or state.health is Health.UNHEALTHY]
    unreadable = [state for state in states if state.health is Health.UNKNOWN and not state.codes]
    entries = [describe(state, pods_of) for state in sorted(listed, key=lambda s: (-s.level, s.phy_id))]
    entries += [f"NPU{state.phy_id} health unreadable" for state in unreadable]
    worst = max((state.level for state in listed if state.codes), default=Level.NormalNPU)
    if worst >= ACTING_LEVEL:
        return Condition("True", worst.name, bounded(entries))
    if any(state.health is Health.UNHEALTHY and not state.codes for state in listed):
        return Condition("True", UNHEALTHY, bounded(entries))
    if unreadable:
        return Condition("Unknown", UNKNOWN, bounded(entries))
    if not states:
        return Condition("Unknown", UNKNOWN, "the driver lists no NPU")
    if listed:  # only codes that do not interrupt the workload (NotHandleFault, SubHealthFault, NormalNPU)
        return Condition("False", worst.name, bounded(entries))
    return Condition("False", HEALTHY, f"{len(states)} NPUs healthy, no active fault code")


def describe(state: DeviceState, pods_of: PodsOf) -> str:
    """`NPU1 SeparateNPU 80E01801,80E18005 (pod demo/worker-0)`."""
    if state.codes:
        text = f"NPU{state.phy_id} {state.level.name} {','.join(code.text for code in state.codes)}"
    else:
        text = f"NPU{state.phy_id} unhealthy, no fault code"
    pods = list(dict.fromkeys(f"{ref.namespace}/{ref.pod}" for ref in pods_of(state.phy_id)))
    if pods:
        text += f" ({'pod' if len(pods) == 1 else 'pods'} {', '.join(pods)})"
    return text


def bounded(entries: list[str], limit: int = MESSAGE_LIMIT) -> str:
    """The entries joined by "; " within `limit` UTF-8 bytes: as many as fit whole, then `... and N more`."""
    whole = "; ".join(entries)
    if len(whole.encode()) <= limit:
        return whole
    kept: list[str] = []
    used = 0
    for index, entry in enumerate(entries):
        more = len(entries) - index - 1
        tail = len(f"; ... and {more} more".encode()) if more else 0
        size = len(entry.encode()) + (2 if kept else 0)
        if used + size + tail <= limit:
            kept.append(entry)
            used += size
            continue
        if not kept:  # the first entry alone is too long (a driver's error text): cut it
            cut = entry.encode()[:max(0, limit - tail - 3)].decode(errors="ignore")
            return f"{cut}..." + (f"; ... and {more} more" if more else "")
        return f"{'; '.join(kept)}; ... and {len(entries) - index} more"
    return "; ".join(kept)
