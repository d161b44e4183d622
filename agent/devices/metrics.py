"""The driver as the device monitor meets it: events, polls, calls that time out, rendered at scrape time."""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import Metric

from agent.common.families import counter, described, gauge
from agent.devices.monitor import DeviceMonitor

EVENTS = counter("npu_agent_driver_events_total",
                 "Driver fault events received; rate_limited ones were mended by a poll, skipped ones named an "
                 "unknown device or assertion", "result")
POLLS = counter("npu_agent_device_polls_total", "Device polls (health and error codes)")
TIMEOUTS = counter("npu_agent_driver_call_timeouts_total",
                   "Driver calls that did not return within devices.call_timeout_seconds")
SUBSCRIBED = gauge("npu_agent_driver_events_subscribed",
                   "1 when the driver delivers fault events, 0 when only polling works")
FAMILIES = (EVENTS, POLLS, TIMEOUTS, SUBSCRIBED)


class DriverCollector:
    def __init__(self, node: str, monitor: DeviceMonitor):
        self._node = node
        self._monitor = monitor

    def describe(self) -> list[Metric]:
        return described(FAMILIES)

    def collect(self) -> Iterable[Metric]:
        node, monitor = self._node, self._monitor
        counters = monitor.counters
        yield EVENTS.series(node, (("accepted", counters["events"] - counters["events_dropped"]),
                                   ("rate_limited", counters["events_dropped"]),
                                   ("skipped", counters["events_skipped"])))
        yield POLLS.one(node, counters["polls"])
        yield TIMEOUTS.one(node, counters["call_timeouts"])
        yield SUBSCRIBED.one(node, 0 if (monitor.events_error or not monitor.devices) else 1)
