"""A chip held at a frequency escalation (ManuallySeparateNPU) while its code comes and goes: the
state changes only where something the outputs show changes (the demo once printed it flipping)."""

from __future__ import annotations

from agent.faults.rules.engine import EngineSettings, FaultEngine
from agent.model import Assertion, Health, Level
from tests.unit.test_engine import RULES, S, T0, TABLE

CODE = 0x80E18005  # 3 times within an hour: ManuallySeparateNPU (RULES)


def test_an_occurrence_within_the_hold_keeps_the_escalated_codes_start():
    e = FaultEngine(TABLE, RULES, EngineSettings())
    e.add_device(4, 0, T0)
    e.on_reading(4, frozenset(), Health.HEALTHY, T0)
    for n in range(3):
        e.on_event(4, CODE, Assertion.OCCUR, 2, None, T0 + 10 * n * S)
        e.on_reading(4, frozenset(), Health.HEALTHY, T0 + (10 * n + 1) * S)  # the driver clears it
    held = e.state(4)
    assert held.level is Level.ManuallySeparateNPU and held.codes[0].escalated_by == "FaultFrequency"
    start = held.codes[0].since_ms
    assert start <= T0 + 20 * S

    # The code occurs again and clears, twice: the level, the code's start and the device's start stay;
    # only what the driver says of the chip's health changes.
    seen = []
    for n in range(2):
        at = T0 + (60 + 10 * n) * S
        seen += e.on_event(4, CODE, Assertion.OCCUR, 2, None, at)
        seen += e.on_reading(4, frozenset({CODE}), Health.UNHEALTHY, at + 100)
        seen += e.on_reading(4, frozenset(), Health.HEALTHY, at + S)
    assert [(s.health, s.level, s.codes[0].since_ms, s.since_ms) for s in seen] == [
        (Health.UNHEALTHY, Level.ManuallySeparateNPU, start, start),
        (Health.HEALTHY, Level.ManuallySeparateNPU, start, start)] * 2
