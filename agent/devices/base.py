"""What every device backend offers, and the plain data it hands out."""

from __future__ import annotations

from typing import Callable, Protocol

from agent.model import DeviceInfo, DriverEvent, Reading


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
