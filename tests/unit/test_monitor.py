"""The device monitor's main task: supervised, and restarted without opening or subscribing twice."""

from __future__ import annotations

import asyncio
from collections import Counter

from agent import lifecycle as tasks
from agent.common.executor import Executor
from agent.model import DeviceInfo, Health, Reading
from agent.devices.monitor import DeviceMonitor
from testkit.wait import until


class Driver:
    """Two healthy devices; counts the calls (libdcmi cannot unsubscribe, so a second subscribe doubles events)."""

    name = "test"

    def __init__(self):
        self.calls: Counter[str] = Counter()

    def open(self) -> list[DeviceInfo]:
        self.calls["open"] += 1
        return [DeviceInfo(i, i, i, 0, "910B3", "910B3-Ascend-V1") for i in range(2)]

    def read(self, device: DeviceInfo) -> Reading:
        self.calls["read"] += 1
        return Reading(Health.HEALTHY, frozenset())

    def subscribe(self, on_event) -> str:
        self.calls["subscribe"] += 1
        return ""

    def close(self) -> None:
        pass


class Observer:
    """Fails (as a bug would) on the given calls."""

    def __init__(self, fail: set[tuple[str, int]]):
        self.fail = fail
        self.calls: Counter[str] = Counter()

    def _call(self, name: str) -> None:
        self.calls[name] += 1
        if (name, self.calls[name]) in self.fail:
            raise RuntimeError(f"{name} #{self.calls[name]} failed")

    def on_inventory(self, devices) -> None:
        self._call("inventory")

    def on_event(self, device, event) -> None:
        self._call("event")

    def on_reading(self, device, reading, started_ms) -> None:
        self._call("reading")

    def on_polled(self) -> None:
        self._call("polled")


def run_monitor(observer: Observer, driver: Driver, check) -> None:
    async def body():
        monitor = DeviceMonitor(driver, observer, calls=Executor().lane("driver", 4, 8), poll_interval_s=0.05,
                                call_timeout_s=5)
        await monitor.start()
        try:
            await check(monitor)
        finally:
            await monitor.stop()
    asyncio.run(body())


def test_a_failed_poll_round_restarts_the_polling_without_opening_or_subscribing_again():
    driver, observer = Driver(), Observer(fail={("reading", 3)})
    before = tasks.restarts["devices/main"]

    async def check(monitor: DeviceMonitor):
        await until(lambda: observer.calls["reading"] >= 20, 20, "polling again after the restart")
        assert tasks.restarts["devices/main"] == before + 1
        assert "RuntimeError: reading #3 failed" in monitor.tasks.problem  # on /readyz until it runs well for 10 s

    run_monitor(observer, driver, check)
    assert (driver.calls["open"], driver.calls["subscribe"], observer.calls["inventory"]) == (1, 1, 1)


def test_an_inventory_that_failed_is_listed_again_and_then_polled():
    driver, observer = Driver(), Observer(fail={("inventory", 1)})

    async def check(monitor: DeviceMonitor):
        await until(lambda: observer.calls["reading"] >= 4, 20, "polling after the second inventory")
        assert monitor.readiness() == (True, "")

    run_monitor(observer, driver, check)
    assert (driver.calls["open"], observer.calls["inventory"], driver.calls["subscribe"]) == (2, 2, 1)
