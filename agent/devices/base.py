"""What every device backend offers, and the plain data it hands out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from agent.faults.engine import Health


@dataclass(frozen=True)
class DeviceInfo:
    logic_id: int  # the driver's index, used in every call and in fault events
    phy_id: int  # the id in device names (Ascend910-<phy>), metrics and public faults
    card_id: int
    device_id: int
    chip_name: str  # e.g. 910B3
    model_name: str  # as npu-exporter builds it: <chip name>-<chip type>-<chip version>


@dataclass(frozen=True)
class Reading:
    """One poll of a device. `codes` is None when they could not be read."""

    health: Health
    codes: frozenset[int] | None
    error: str = ""  # why something could not be read, for the log


@dataclass(frozen=True)
class DriverEvent:
    logic_id: int
    code: int
    assertion: int  # 0 recover, 1 occur, 2 once
    severity: int  # 0 suggestion .. 3 critical
    raised_s: int  # the driver's alarm time (unix seconds), 0 when absent


class BackendError(Exception):
    """The backend cannot be used at all (no library, init failed); the message says why."""


class DeviceBackend(Protocol):
    """Blocking calls; the monitor runs them off the event loop with a time-out."""

    name: str

    def open(self) -> list[DeviceInfo]:
        """Initialise and list the devices; raises BackendError."""

    def read(self, device: DeviceInfo) -> Reading:
        """Health and current error codes of one device."""

    def subscribe(self, on_event: Callable[[DriverEvent], None]) -> str:
        """Start delivering fault events (from any thread). Returns "" or why events are unavailable."""

    def close(self) -> None:
        ...
