"""Fault levels of the Ascend Device Plugin, ordered by severity."""

from __future__ import annotations

import enum


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


# Levels a parameter-plane (network) code may have; the device plugin downgrades the others.
NETWORK_LEVELS = frozenset(
    {Level.NotHandleFault, Level.SubHealthFault, Level.PreSeparateNPU, Level.SeparateNPU}
)


def format_code(code: int) -> str:
    """Upper-case hex without 0x, at least 8 digits (9-digit synthesized codes keep their length)."""
    return f"{code:08X}"
