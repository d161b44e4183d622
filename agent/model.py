"""Plain types shared across the agent's subsystems (a leaf: it imports nothing of the agent).

Driver observations (DeviceInfo, Reading, DriverEvent), a device's public fault state (Level,
Health, ActiveCode, DeviceState), its revisioned changes (Change, Snapshot), who holds an NPU
(PodRef, PodsOf), and what a fault sink offers the rest of the agent (Sink)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, runtime_checkable


class Level(enum.IntEnum):
    """A chip fault level; the integer is the rank exported as `npu_agent_device_fault_level`.

    The order is the device plugin's severity order (most severe last), so `max()` of levels
    is "the most serious fault type".
    """

    NormalNPU = 0
    NotHandleFault = 1
    SubHealthFault = 2
    RestartRequest = 3
    RestartBusiness = 4
    FreeRestartNPU = 5
    RestartNPU = 6
    PreSeparateNPU = 7
    SeparateNPU = 8
    ManuallySeparateNPU = 9

    @classmethod
    def parse(cls, name: str) -> "Level":
        try:
            return cls[name]
        except KeyError:
            allowed = ", ".join(level.name for level in cls if level is not cls.NormalNPU)
            raise ValueError(f"unknown fault level {name!r} (allowed: {allowed})") from None


class Assertion(enum.IntEnum):
    """DCMI's `assertion` field."""

    RECOVER = 0
    OCCUR = 1
    ONCE = 2


class Health(enum.IntEnum):
    """`npu_chip_info_health_status`: the driver's health, or unknown when it could not be read."""

    UNKNOWN = -1
    UNHEALTHY = 0
    HEALTHY = 1


@dataclass(frozen=True)
class ActiveCode:
    code: int
    text: str  # upper-case hex as the tables spell it
    level: Level
    since_ms: int
    severity: int | None = None
    escalated_by: str = ""  # FaultFrequency / FaultDuration when a rule raised the level


@dataclass(frozen=True)
class DeviceState:
    """What the outputs see of one device."""

    phy_id: int
    logic_id: int
    health: Health = Health.HEALTHY
    level: Level = Level.NormalNPU
    since_ms: int = 0  # start of the oldest listed code; 0 when there is none
    codes: tuple[ActiveCode, ...] = ()
    # When the device entered `level`: strictly increasing per device, so it names one occurrence
    # of a level (a public fault's id is made from it) and never repeats, even within a millisecond.
    level_since_ms: int = 0

    @property
    def faulty(self) -> bool:
        return bool(self.codes)


@dataclass(frozen=True)
class DeviceInfo:
    logic_id: int  # the driver's index, used in every call and in fault events
    phy_id: int  # the id in device names (Ascend910-<phy>), metrics and public faults
    card_id: int
    device_id: int
    chip_name: str  # e.g. 910B3
    model_name: str  # as npu-exporter builds it: <chip name>-<chip type>-<chip version>
    vdie_id: str = ""  # npu-exporter's vdie_id: the chip's UUID, 5 hex words; "" when the driver cannot say
    pcie_bus_info: str = ""  # npu-exporter's pcie_bus_info, e.g. 0000:61:00.0; "" when the driver cannot say


@dataclass(frozen=True)
class Reading:
    """One poll of a device. `codes` is None when they could not be read."""

    health: Health
    codes: frozenset[int] | None
    error: str = ""  # why something could not be read, for the log
    order: tuple[int, ...] = ()  # the codes in the driver's order (npu-exporter's npu_chip_info_error_code order)


@dataclass(frozen=True)
class DriverEvent:
    logic_id: int
    code: int
    assertion: int  # 0 recover, 1 occur, 2 once
    severity: int  # 0 suggestion .. 3 critical
    raised_s: int  # the driver's alarm time (unix seconds), 0 when absent


@dataclass(frozen=True)
class Change:
    revision: int
    state: DeviceState


@dataclass(frozen=True)
class Snapshot:
    revision: int
    devices: tuple[Change, ...]  # every device with the revision of its last change


@dataclass(frozen=True, slots=True)
class PodRef:
    namespace: str
    pod: str
    container: str


PodsOf = Callable[[int], tuple[PodRef, ...]]  # physical id -> the containers holding it now


def no_pods(phy_id: int) -> tuple[PodRef, ...]:
    """The lookup when attribution is off."""
    return ()


class StateWrite(Protocol):
    """State a component keeps on disk whose writes may fail for a while (agent.common.fsutil.WriteRetry)."""

    what: str  # names it: the `file` label of npu_agent_state_write_failures_total
    failures: int  # failed attempts so far, for that family

    @property
    def problem(self) -> str:
        """Why it is failing now ("" while it is written), for /readyz."""


@runtime_checkable
class Sink(Protocol):
    """A peer the durable fault log's changes are delivered to (ClusterD, the device-info ConfigMap),
    as the composition root, the fault service, the supervisor and the metrics see it. A sink with
    families of its own (ClusterD's) has a collector of its own beside it."""

    name: str  # its `sink` label in the metrics, and its cursor's name in the fault log if it keeps one

    @property
    def counters(self) -> Mapping[str, int]:
        """Requests (or writes) by result: npu_agent_fault_reports_total."""

    @property
    def pending(self) -> int:
        """Changes logged and not yet acknowledged by its peer (0: it writes the latest state, no
        backlog): npu_agent_outbox_pending, how far delivery lags."""

    @property
    def last_success(self) -> float:
        """When its peer last acknowledged a request (0: never), so that a silent peer shows."""

    @property
    def writes(self) -> tuple[StateWrite, ...]:
        """The state it keeps on disk, whose failed writes are counted and shown on /readyz."""

    def notify(self, changes: list[Change]) -> None:
        """The fault log has new changes: the fault service calls it on the loop after each durable append."""

    async def start(self) -> None:
        """Supervised like every component (agent.lifecycle): started before the sources that feed it."""

    async def stop(self) -> None:
        """Ends its tasks (a request in flight may finish first)."""

    def readiness(self) -> tuple[bool, str]:
        """Whether the sink itself works, and why not, for /readyz (a peer that is away shows in `pending`)."""


# The earliest fault time a peer accepts (ClusterD refuses times before 2025-01-01): older driver
# times are clamped to it.
MIN_TIME_MS = 1735689600000

# Synthesized when the health call answers -8012 (device not ready: the card dropped).
CARD_DROP_CODE = 0x40F84E00


# "Reset finish": never stored, it only asks for a fresh poll of the device.
RESET_FINISH_CODE = 0x8C2FA009
