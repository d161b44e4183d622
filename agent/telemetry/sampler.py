"""Collects npu-exporter's telemetry groups, each on its own interval, off the event loop.

Every read (one chip, one part of a group) runs in the executor's telemetry lane with the driver
call time-out: a read that hangs leaves that chip's part of the group unknown (npu-exporter's failure
value where it exports one, else no sample) and never holds up fault detection, whose calls run in
the driver lane. While a read of a chip is stuck, the next one of the same kind is refused at once, so
hung calls do not pile up. Scrapes read the latest samples; nothing is collected on the scrape path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Callable

from agent.common.errors import Once
from agent.common.executor import CallTimeout, Lane, StillStuck
from agent.lifecycle import Tasks
from agent.model import DeviceInfo
from agent.telemetry.families import BY_NAME, FAILED_AS_MINUS_ONE, GROUPS, SAMPLING_READS
from agent.telemetry.source import Sample, TelemetrySource

log = logging.getLogger(__name__)

WAIT_FOR_DEVICES_S = 1.0
RESULTS = ("ok", "timeout", "refused", "error")


def failed(read: str) -> list[Sample]:
    """What a read that could not run renders: -1 where npu-exporter exports a failure, nothing elsewhere."""
    return [(name, (), -1.0) for name in FAILED_AS_MINUS_ONE.get(read, ())]


class TelemetrySampler:
    name = "telemetry"

    def __init__(self, sources: list[TelemetrySource], devices: Callable[[], list[DeviceInfo]], *, lane: Lane,
                 intervals: dict[str, float], call_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self._sources = sources
        self._devices = devices
        self._lane = lane
        self._intervals = {group.name: intervals.get(group.name, group.interval_s) for group in GROUPS}
        self._call_timeout_s = call_timeout_s
        self._clock = clock
        self.tasks = Tasks(self.name)
        self.samples: dict[tuple[int, str], list[Sample]] = {}  # (logic id, read) -> latest samples
        self.node_samples: list[Sample] = []
        self.results: Counter[tuple[str, str]] = Counter({(g.name, r): 0 for g in GROUPS for r in RESULTS})
        self.seconds: Counter[str] = Counter()  # group -> time spent collecting it
        self._state: dict[tuple[int, str], str] = {}  # (logic id, read) -> last result, to log changes only
        self._errors = Once()
        self._sampling = asyncio.Semaphore(1)  # see SAMPLING_READS

    @property
    def groups(self) -> list[str]:
        return [name for name, seconds in self._intervals.items() if seconds > 0]

    async def start(self) -> None:
        self.tasks.start("node", self._node)
        for group in GROUPS:
            if self._intervals[group.name] > 0:
                self.tasks.start(group.name, lambda group=group: self._run(group))

    async def stop(self) -> None:
        await self.tasks.stop()
        self._lane.close()

    def readiness(self) -> tuple[bool, str]:
        return True, ""  # telemetry is never a reason to take the agent out of service; task failures show anyway

    def unsupported(self) -> list[tuple[int, str]]:
        return sorted(pair for source in self._sources for pair in source.unsupported())

    async def _wait_for_devices(self) -> list[DeviceInfo]:
        while not (devices := self._devices()):
            await asyncio.sleep(WAIT_FOR_DEVICES_S)
        return devices

    async def _node(self) -> None:
        await self._wait_for_devices()
        samples: list[Sample] = []
        for source in self._sources:
            try:
                samples += await self._lane.run(source.node, timeout=self._call_timeout_s, key=("node", source.name))
            except CallTimeout as exc:
                log.warning("node telemetry not read", extra={"source": source.name, "reason": str(exc)})
        self.node_samples = samples

    async def _run(self, group) -> None:
        interval = self._intervals[group.name]
        devices = await self._wait_for_devices()
        plan = []
        for device in devices:
            for read in group.reads:  # the first source that makes the read does it
                source = next((source for source in self._sources if read in source.reads(device)), None)
                if source is not None:
                    plan.append((device, source, read))
        while True:
            started = self._clock()
            await asyncio.gather(*(self._read(group.name, *step) for step in plan))
            spent = self._clock() - started
            self.seconds[group.name] += spent
            await asyncio.sleep(max(0.0, interval - spent))

    async def _read(self, group: str, device: DeviceInfo, source: TelemetrySource, read: str) -> None:
        timeout = source.read_timeout(read, self._call_timeout_s)
        key = (device.logic_id, read)
        why = ""
        try:
            async with self._sampling if read in SAMPLING_READS else contextlib.nullcontext():
                samples = await self._lane.run(source.read, device, read, timeout=timeout, key=key)
            result = "ok"
        except StillStuck:
            samples, result, why = failed(read), "refused", "the previous read has not returned"
        except CallTimeout:
            samples, result, why = failed(read), "timeout", f"no answer within {timeout:g}s"
        except Exception as exc:  # a source bug must cost this read, not the group's task
            samples, result, why = failed(read), "error", repr(exc)
            if self._errors((read, type(exc).__name__)):
                log.exception("telemetry read failed", extra={"device": device.phy_id, "read": read})
        self.samples[key] = [s for s in samples if s[0] in BY_NAME]
        self.results[(group, result)] += 1
        state = "ok" if result == "ok" else "failing"
        if state != self._state.get(key, "ok"):
            if why:
                log.warning("telemetry read failing; its values read as unknown",
                            extra={"device": device.phy_id, "read": read, "reason": why})
            else:
                log.info("telemetry read works again", extra={"device": device.phy_id, "read": read})
        self._state[key] = state
