"""Scenario files for the simulated backend: timed fault injections on a simulated node."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from agent.errors import ConfigError
from agent.faults.codes import parse_code

ACTIONS = ("occur", "recover", "once", "drop", "restore")


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
    try:
        document = yaml.safe_load(Path(path).read_text("utf-8"))
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: invalid YAML: {exc}"]) from None
    return parse_scenario(document, path, devices)


def parse_scenario(document: object, source: str, devices: int) -> Scenario:
    problems: list[str] = []
    if not isinstance(document, dict):
        raise ConfigError([f"{source}: expected a mapping with 'steps'"])
    for key in set(document) - {"steps", "repeat_every"}:
        problems.append(f"{source}: {key}: unknown key (known: repeat_every, steps)")
    repeat = document.get("repeat_every", 0)
    if isinstance(repeat, bool) or not isinstance(repeat, (int, float)) or repeat < 0:
        problems.append(f"{source}: repeat_every: expected seconds >= 0, got {repeat!r}")
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
            problems.append(f"{where}: unknown keys {sorted(extra)}")
        at, device, action = raw.get("at"), raw.get("device"), raw.get("action")
        severity, via = raw.get("severity", 2), raw.get("via", "event")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or at < 0:
            problems.append(f"{where}.at: expected seconds >= 0, got {at!r}")
            continue
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < devices:
            problems.append(f"{where}.device: expected a physical id 0..{devices - 1}, got {device!r}")
            continue
        if action not in ACTIONS:
            problems.append(f"{where}.action: {action!r} is not one of {', '.join(ACTIONS)}")
            continue
        if severity not in (0, 1, 2, 3):
            problems.append(f"{where}.severity: expected 0..3, got {severity!r}")
            continue
        if via not in ("event", "poll"):
            problems.append(f"{where}.via: expected event or poll, got {via!r}")
            continue
        code = 0
        if action in ("occur", "recover", "once"):
            try:
                code = parse_code(str(raw.get("code", "")))
            except ValueError as exc:
                problems.append(f"{where}.code: {exc}")
                continue
        steps.append(Step(float(at), device, action, code, severity, via))
    if problems:
        raise ConfigError(problems)
    return Scenario(tuple(sorted(steps, key=lambda s: s.at_s)), float(repeat))
