"""Fault levels of the Ascend Device Plugin, ordered by severity."""

from __future__ import annotations

from agent.model import Level


# Levels a parameter-plane (network) code may have; the device plugin downgrades the others.
NETWORK_LEVELS = frozenset(
    {Level.NotHandleFault, Level.SubHealthFault, Level.PreSeparateNPU, Level.SeparateNPU}
)

