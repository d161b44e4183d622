"""Scenario files for the simulated backend: timed fault injections on a simulated node."""

from __future__ import annotations

import math
from dataclasses import dataclass

from agent.config import load_yaml, read_config_file
from agent.common.errors import ConfigError, clip, quote
from agent.faults.rules.codes import parse_code

ACTIONS = ("occur", "recover", "once", "drop", "restore")
MAX_SECONDS = 365 * 86400  # a step further off than a year is a mistake (1e308 s would overflow a thread's wait)
MIN_REPEAT_S = 1.0  # a scenario replayed more often would keep a core busy


@dataclass(frozen=True)
class Step:
    at_s: float  # seconds after the scenario (re)starts
    device: int  # physical id
    action: str  # occur | recover | once | drop | restore
    code: int = 0
    severity: int = 2
    via: str = "event"  # event: the driver sends an event; poll: only polling can see it


@dataclass(frozen=True)
class Scenario:
    steps: tuple[Step, ...]
    repeat_every_s: float = 0.0  # 0: run once


def load_scenario(path: str, devices: int) -> Scenario:
    return parse_scenario(load_yaml(read_config_file(path), path), path, devices)


def _seconds(value: object) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and 0 <= value <= MAX_SECONDS)


def parse_scenario(document: object, source: str, devices: int) -> Scenario:
    problems: list[str] = []
    if not isinstance(document, dict):
        raise ConfigError([f"{source}: expected a mapping with 'steps'"])
    for key in set(document) - {"steps", "repeat_every"}:
        problems.append(f"{source}: {clip(str(key), 80)}: unknown key (known: repeat_every, steps)")
    repeat = document.get("repeat_every", 0)
    if not _seconds(repeat) or 0 < repeat < MIN_REPEAT_S:
        problems.append(f"{source}: repeat_every: expected 0 (play once) or seconds {MIN_REPEAT_S:g}..{MAX_SECONDS}, "
                        f"got {quote(repeat)}")
        repeat = 0
    steps = []
    raw_steps = document.get("steps")
    if not isinstance(raw_steps, list):
        problems.append(f"{source}: steps: expected a list")
        raw_steps = []
    for index, raw in enumerate(raw_steps):
        where = f"{source}: steps[{index}]"
        if not isinstance(raw, dict):
            problems.append(f"{where}: expected a mapping")
            continue
        extra = set(raw) - {"at", "device", "action", "code", "severity", "via"}
        if extra:
            problems.append(f"{where}: unknown keys {quote(sorted(extra, key=str))}")
        at, device, action = raw.get("at"), raw.get("device"), raw.get("action")
        severity, via = raw.get("severity", 2), raw.get("via", "event")
        if not _seconds(at):
            problems.append(f"{where}.at: expected seconds 0..{MAX_SECONDS}, got {quote(at)}")
            continue
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < devices:
            problems.append(f"{where}.device: expected a physical id 0..{devices - 1}, got {quote(device)}")
            continue
        if action not in ACTIONS:
            problems.append(f"{where}.action: {quote(action)} is not one of {', '.join(ACTIONS)}")
            continue
        if isinstance(severity, bool) or severity not in (0, 1, 2, 3):
            problems.append(f"{where}.severity: expected 0..3, got {quote(severity)}")
            continue
        if via not in ("event", "poll"):
            problems.append(f"{where}.via: expected event or poll, got {quote(via)}")
            continue
        code = 0
        if action in ("occur", "recover", "once"):
            try:
                code = parse_code(str(raw.get("code", "")))
            except ValueError as exc:
                problems.append(f"{where}.code: {exc}")
                continue
        steps.append(Step(float(at), device, action, code, int(severity), via))
    if problems:
        raise ConfigError(problems)
    return Scenario(tuple(sorted(steps, key=lambda s: s.at_s)), float(repeat))
