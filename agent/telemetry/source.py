"""What a telemetry source offers the sampler: blocking reads of one chip, each giving samples."""

from __future__ import annotations

from typing import Protocol

from agent import __version__
from agent.model import DeviceInfo

# (family name, values of the family's extra labels, value). A sample a source leaves out is npu-exporter's
# "omitted"; a failure npu-exporter exports as -1 is a sample of -1.
Sample = tuple[str, tuple[str, ...], float]


def node_samples(driver_version: str) -> list[Sample]:
    """npu-exporter's version families, naming the agent as the exporter."""
    exporter = f"npu-node-agent-{__version__}"
    return [("npu_exporter_version_info", (exporter,), 1.0), ("node_base_info", (exporter, driver_version), 1.0)]


class TelemetrySource(Protocol):
    name: str

    def reads(self, device: DeviceInfo) -> tuple[str, ...]:
        """The reads (agent.telemetry.families.GROUPS) this source makes for this chip."""

    def read(self, device: DeviceInfo, read: str) -> list[Sample]:
        """Blocking: one read of one chip. A driver call that fails gives npu-exporter's failure value; a
        function the driver does not support is logged once and not called again."""

    def read_timeout(self, read: str, call_timeout_s: float) -> float:
        """How long the sampler waits for a read before it counts as unknown (the call time-out, as a rule)."""

    def node(self) -> list[Sample]:
        """Blocking, once at start: node-level samples (driver version)."""

    def unsupported(self) -> list[tuple[int, str]]:
        """(physical id, function) pairs skipped because the driver does not support them."""
