"""The `simulated` backend: a node of N NPUs that behaves like the driver, driven by a scenario.

It answers the same calls as the DCMI backend (inventory, health, error codes, fault events from
its own thread), so everything above it runs unchanged on a machine without NPUs.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from agent.model import CARD_DROP_CODE, DeviceInfo, DriverEvent, Health, Reading
from agent.devices.scenario import Scenario, Step


BUSES = (0xC1, 0x01, 0x41, 0x81, 0xC2, 0x02, 0x42, 0x82)


class SimulatedBackend:
    name = "simulated"

    def __init__(self, devices: int = 8, chip_name: str = "910B3", scenario: Scenario | None = None,
                 clock: Callable[[], float] = time.time):
        self._count = devices
        self._chip_name = chip_name
        self._scenario = scenario
        self._clock = clock
        self._lock = threading.Lock()
        self._codes: dict[int, dict[int, int]] = {i: {} for i in range(devices)}  # phy -> code -> raised_s
        self._dropped: set[int] = set()
        self._on_event: Callable[[DriverEvent], None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self) -> list[DeviceInfo]:
        model = f"{self._chip_name}-Ascend-V1"
        # Fixed identities in the driver's formats: a UUID per chip and the PCIe addresses of an 8-chip A2 server.
        return [DeviceInfo(i, i, i, 0, self._chip_name, model, f"5A1D0000-0000{i:04X}-00000000-00000000-00000000",
                           f"0000:{BUSES[i % len(BUSES)]:02X}:00.0")
                for i in range(self._count)]

    def read(self, device: DeviceInfo) -> Reading:
        with self._lock:
            order = tuple(self._codes[device.phy_id])  # raised first, listed first
            dropped = device.phy_id in self._dropped
        if dropped:  # the health call fails with -8012
            return Reading(Health.UNKNOWN, frozenset(order) | {CARD_DROP_CODE}, order=(*order, CARD_DROP_CODE))
        return Reading(Health.UNHEALTHY if order else Health.HEALTHY, frozenset(order), order=order)

    def dropped(self, phy_id: int) -> bool:
        with self._lock:
            return phy_id in self._dropped

    def subscribe(self, on_event: Callable[[DriverEvent], None]) -> str:
        self._on_event = on_event
        if self._scenario is not None and self._scenario.steps and self._thread is None:
            self._thread = threading.Thread(target=self._play, name="simulated-driver", daemon=True)
            self._thread.start()
        return ""

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def apply(self, step: Step) -> None:
        """Apply one injection now (the scenario thread calls this; so may a test or the demo)."""
        now = int(self._clock())
        event = None
        with self._lock:
            codes = self._codes[step.device]
            if step.action == "occur":
                codes.setdefault(step.code, now)
                event = DriverEvent(step.device, step.code, 1, step.severity, codes[step.code])
            elif step.action == "recover":
                raised = codes.pop(step.code, now)
                event = DriverEvent(step.device, step.code, 0, step.severity, raised)
            elif step.action == "once":
                event = DriverEvent(step.device, step.code, 2, step.severity, now)
            elif step.action == "drop":
                self._dropped.add(step.device)
            elif step.action == "restore":
                self._dropped.discard(step.device)
        if event is not None and step.via == "event" and self._on_event is not None:
            self._on_event(event)

    def _play(self) -> None:
        scenario = self._scenario
        while not self._stop.is_set():
            started = time.monotonic()
            for step in scenario.steps:
                if self._stop.wait(max(0.0, started + step.at_s - time.monotonic())):
                    return
                self.apply(step)
            if scenario.repeat_every_s <= 0:
                return
            if self._stop.wait(max(0.0, started + scenario.repeat_every_s - time.monotonic())):
                return
