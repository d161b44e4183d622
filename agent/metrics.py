"""The agent's /metrics: one registry of every subsystem's collector (agent.app wires them).

Each collector renders its families at scrape time from its components' own state (nothing is
pushed into metric objects as things happen, so a device or code that is gone leaves no series)
and describes them (agent.common.families), so the registry refuses a family exposed twice.
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from agent import __version__
from agent.common.families import described, gauge

BUILD_INFO = gauge("npu_agent_build_info", "Version of the running agent", "version")


class BuildInfoCollector:
    def __init__(self, node: str):
        self._node = node

    def describe(self) -> list[Metric]:
        return described((BUILD_INFO,))

    def collect(self) -> Iterable[Metric]:
        yield BUILD_INFO.series(self._node, ((__version__, 1),))


def make_registry(*collectors) -> CollectorRegistry:
    """Raises ValueError when two collectors describe a family of the same name."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return registry

