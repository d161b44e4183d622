"""The device monitor: listens to the driver's fault events and polls it, off the event loop.

Events give speed; polling gives certainty (it mends lost events, sees codes that raise no event,
and notices a dropped card). Every driver call runs in the executor's driver lane with a time-out:
a call that hangs makes the device "unknown", never the agent. A device whose previous call is
still stuck is not called again until that call returns (the lane refuses its key at once), so
hung calls cannot pile up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

from agent.devices.base import BackendError, DeviceBackend
from agent.model import Assertion, DeviceInfo, DriverEvent, Health, RESET_FINISH_CODE, Reading
from agent.common.executor import CallTimeout, Lane, StillStuck
from agent.common.errors import Once
from agent.common.ratelimit import TokenBucket
from agent.lifecycle import Tasks, spawn

log = logging.getLogger(__name__)
NOT_STARTED = "not started"  # the error until the driver is first opened

RECOVER_DELAY_S = 1.0  # a recover event races the error-code list; confirm it by a poll this much later
OPEN_RETRY_S = 30.0
KNOWN_ASSERTIONS = frozenset(Assertion)


class FaultObserver(Protocol):
    def on_inventory(self, devices: list[DeviceInfo]) -> None: ...
    def on_event(self, device: DeviceInfo, event: DriverEvent) -> None: ...
    def on_reading(self, device: DeviceInfo, reading: Reading, started_ms: int) -> None: ...
    def on_polled(self) -> None:
        """Every device was read (or its read failed) once since the start."""


class DeviceMonitor:
    name = "devices"

    def __init__(self, backend: DeviceBackend, observer: FaultObserver, *, calls: Lane, poll_interval_s: float,
                 call_timeout_s: float, clock: Callable[[], float] = time.time,
                 event_rate_per_minute: int = 1000, open_retry_s: float = OPEN_RETRY_S):
        self.backend = backend
        self._observer = observer
        self._poll_interval_s = poll_interval_s
        self._call_timeout_s = call_timeout_s
        self._clock = clock
        self._open_retry_s = open_retry_s
        # The device plugin's limit: 1,000 events a minute, in bursts of up to as many.
        self._bucket = TokenBucket(event_rate_per_minute / 60.0, event_rate_per_minute, time.monotonic)
        self._calls = calls
        self._loop: asyncio.AbstractEventLoop | None = None
        self.tasks = Tasks(self.name)
        self._inventory_sent = False  # the observer has the devices (steps of `_run` done, for a restart)
        self._subscribed = False
        self._polls: dict[int, asyncio.Task] = {}  # logic id -> running poll
        self._scheduled: dict[int, asyncio.TimerHandle] = {}
        self._by_logic: dict[int, DeviceInfo] = {}
        self._last_error: dict[int, str] = {}  # logic id -> why its last read failed ("" when it worked)
        self._first_unknown = Once()  # ("device", logic id) / ("assertion", value) logged
        self.devices: list[DeviceInfo] = []
        self.code_order: dict[int, tuple[int, ...]] = {}  # phy id -> its codes as the driver last listed them
        self.error = NOT_STARTED
        self.events_error = ""
        self.polled_once = False
        # events: for a known device with an assertion the agent knows; events_skipped: any other
        self.counters = {"events": 0, "events_dropped": 0, "events_skipped": 0, "polls": 0, "call_timeouts": 0,
                         "read_errors": 0}

    # ---- component ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.tasks.start("main", self._run, reset=self._reset)

    async def stop(self) -> None:
        await self.tasks.stop()
        for handle in self._scheduled.values():
            handle.cancel()
        for task in self._polls.values():
            task.cancel()
        self._loop = None  # events still arriving from the driver thread are dropped from now on
        try:
            await asyncio.wait_for(self._blocking("close", self.backend.close), 2.0)
        except (CallTimeout, asyncio.TimeoutError):
            log.warning("driver close did not return in time")
        self._calls.close()

    @property
    def driver_problem(self) -> str:
        """Why the driver cannot be used: "" once it is open, and before the first attempt."""
        return "" if self.error == NOT_STARTED else self.error

    @property
    def read_errors(self) -> dict[int, str]:
        """Physical id -> why its last read failed, for the devices whose last read failed (the fault stream says so)."""
        return {self._by_logic[logic].phy_id: "no answer from the driver" if kind == "no answer" else kind
                for logic, kind in self._last_error.items() if kind and logic in self._by_logic}

    def readiness(self) -> tuple[bool, str]:
        if not self.devices:
            return False, self.error
        if not self.polled_once:
            return False, "first poll of the devices not finished"
        return True, ""

    # ---- the driver, off the loop ---------------------------------------------------------------

    async def _blocking(self, key: str, fn: Callable, *args, timeout: float | None = None):
        """`fn(*args)` in the driver lane; CallTimeout when it takes too long or is still stuck."""
        timeout = timeout or self._call_timeout_s
        try:
            return await self._calls.run(fn, *args, timeout=timeout, key=key)
        except StillStuck:
            raise
        except CallTimeout:
            self.counters["call_timeouts"] += 1
            raise CallTimeout(f"{key}: no answer within {timeout:g}s") from None

    async def _run(self) -> None:
        # After a failure the run goes on from the step that failed: the driver is opened and
        # subscribed to once (libdcmi has no unsubscribe: a second subscription doubles every event).
        if not self._inventory_sent:
            await self._open()
        if not self._subscribed:
            await self._subscribe()
        while True:
            await self._poll_all()
            if not self.polled_once:
                self.polled_once = True
                self._observer.on_polled()
            await asyncio.sleep(self._poll_interval_s)

    def _reset(self) -> None:
        """Before a restart of `_run`: devices the observer may not have taken in are listed again."""
        if not self._inventory_sent:
            self.devices, self._by_logic = [], {}
            self.error = "device inventory failed; listing the devices again"

    async def _open(self) -> None:
        last = ""
        while True:
            try:
                devices = await self._blocking("open", self.backend.open, timeout=max(30.0, self._call_timeout_s))
                break
            except (BackendError, CallTimeout) as exc:
                self.error = f"{self.backend.name} backend unavailable: {exc}"
            if self.error != last:
                log.error("devices unavailable; retrying", extra={"reason": self.error, "retry_s": self._open_retry_s})
                last = self.error
            await asyncio.sleep(self._open_retry_s)
        self.devices = devices
        self._by_logic = {d.logic_id: d for d in devices}
        self.error = ""
        log.info("devices found", extra={"backend": self.backend.name, "count": len(devices),
                                         "devices": [f"logic {d.logic_id} = phy {d.phy_id} ({d.model_name})" for d in devices]})
        self._observer.on_inventory(devices)
        self._inventory_sent = True

    async def _subscribe(self) -> None:
        self._subscribed = True  # even if the call fails or hangs: it may have registered the callback
        try:
            why = await self._blocking("subscribe", self.backend.subscribe, self._on_driver_event)
        except CallTimeout as exc:
            why = str(exc)
        except Exception as exc:  # a driver refusing in a way not foreseen: polling still works
            why = f"subscribe failed: {exc!r}"
        self.events_error = why
        if why:
            log.warning("fault events unavailable; relying on polling",
                        extra={"reason": why, "poll_interval_s": self._poll_interval_s})
        else:
            log.info("subscribed to driver fault events")

    # ---- events -------------------------------------------------------------------------------

    def _on_driver_event(self, event: DriverEvent) -> None:
        """Called on the driver's thread: hand the event to the loop and return at once."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._handle_event, event)
        except RuntimeError:  # the loop closed under us during shutdown
            pass

    def _handle_event(self, event: DriverEvent) -> None:
        device = self._by_logic.get(event.logic_id)
        if event.code == 0 or device is None or event.assertion not in KNOWN_ASSERTIONS:
            self._skip(event, device)
            return
        self.counters["events"] += 1
        if not self._bucket.take():
            # Over the rate limit: let a poll of the device mend whatever this event said.
            self.counters["events_dropped"] += 1
            self._schedule_poll(device, 0.0)
            return
        if event.code == RESET_FINISH_CODE:
            self._schedule_poll(device, 0.0)
        elif event.assertion == 0:
            self._schedule_poll(device, RECOVER_DELAY_S)
        else:
            self._observer.on_event(device, event)

    def _skip(self, event: DriverEvent, device: DeviceInfo | None) -> None:
        """Count an event that cannot be applied; log the first of each unknown device and assertion
        value (a driver sending thousands is counted, not logged thousands of times)."""
        self.counters["events_skipped"] += 1
        if event.code == 0:
            return
        if device is None:
            if self._first_unknown(("device", event.logic_id)):
                log.warning("fault event for an unknown device skipped", extra={"logic_id": event.logic_id})
        elif self._first_unknown(("assertion", event.assertion)):
            log.warning("fault event with an unknown assertion skipped", extra={
                "device": device.phy_id, "code": f"{event.code:08X}", "assertion": event.assertion})

    # ---- polling ------------------------------------------------------------------------------

    async def _poll_all(self) -> None:
        await asyncio.gather(*(self._poll(device) for device in self.devices))

    def _schedule_poll(self, device: DeviceInfo, delay: float) -> None:
        if self._loop is None or device.logic_id in self._scheduled:
            return

        def fire() -> None:
            self._scheduled.pop(device.logic_id, None)
            spawn(self._poll(device, fresh=True), "devices", "confirmation-poll")

        self._scheduled[device.logic_id] = self._loop.call_later(delay, fire)

    async def _poll(self, device: DeviceInfo, fresh: bool = False) -> None:
        """Read one device. One read per device at a time: join the one under way, and with
        `fresh` read again after it (it may have started before the event that asked for this)."""
        running = self._polls.get(device.logic_id)
        if running is not None:
            await asyncio.shield(running)
            if not fresh or device.logic_id in self._polls:
                return
        task = asyncio.ensure_future(self._read(device))
        self._polls[device.logic_id] = task
        try:
            await asyncio.shield(task)
        finally:
            if self._polls.get(device.logic_id) is task:
                del self._polls[device.logic_id]

    async def _read(self, device: DeviceInfo) -> None:
        started_ms = int(self._clock() * 1000)
        self.counters["polls"] += 1
        try:
            reading = await self._blocking(f"read/{device.logic_id}", self.backend.read, device)
            kind = reading.error
        except CallTimeout as exc:
            # "no answer" and "the previous call has not returned yet" alternate while calls hang: one problem.
            reading, kind = Reading(Health.UNKNOWN, None, str(exc)), "no answer"
        except Exception as exc:
            reading = Reading(Health.UNKNOWN, None, f"read failed: {exc!r}")
            kind = reading.error
        if reading.error:
            self.counters["read_errors"] += 1
        if kind != self._last_error.get(device.logic_id, ""):
            # Log transitions only: a device that stays broken does not flood the log.
            if reading.error:
                log.error("device read failed; its last known faults stay", extra={
                    "device": device.phy_id, "logic_id": device.logic_id, "reason": reading.error})
            else:
                log.info("device read works again", extra={"device": device.phy_id, "logic_id": device.logic_id})
            self._last_error[device.logic_id] = kind
        if reading.codes is not None:
            self.code_order[device.phy_id] = reading.order
        self._observer.on_reading(device, reading, started_ms)
