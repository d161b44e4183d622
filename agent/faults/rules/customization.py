"""faultCustomization.json: frequency and duration escalation rules, with the device plugin's ranges."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from agent.common.errors import ConfigError, clip, file_problem, quote
from agent.faults.rules.codes import parse_code, read_json_file
from agent.model import Level

NEVER_RELEASE_S = 2**32  # a missing ReleaseTimeWindow: the escalation is never released by time

# (minimum, maximum) of each numeric field, as the device plugin enforces them.
RANGES = {
    "TimeWindow": (60, 864000),
    "Times": (1, 100),
    "ReleaseTimeWindow": (60, NEVER_RELEASE_S),
    "FaultTimeout": (0, 600),
    "RecoverTimeout": (0, 86400),
    "WaitProcessReadCMTime": (5, 90),
    "WaitDeviceResetTime": (60, 180),
    "WaitFaultSelfHealingTime": (1, 30),
}
FREQUENCY_LEVELS = frozenset(Level) - {Level.NormalNPU}
DURATION_LEVELS = FREQUENCY_LEVELS - {Level.ManuallySeparateNPU}


@dataclass(frozen=True)
class FrequencyRule:
    """`times` occurrences within `window_s` escalate the device to `level` until quiet for `release_s`."""

    codes: frozenset[int]
    window_s: int
    times: int
    level: Level
    release_s: int = NEVER_RELEASE_S


@dataclass(frozen=True)
class DurationRule:
    """A code active for `fault_timeout_s` escalates to `level`; it clears after `recover_timeout_s` clear."""

    codes: frozenset[int]
    fault_timeout_s: int
    recover_timeout_s: int
    level: Level


@dataclass(frozen=True)
class Customization:
    source: str = ""
    frequency: dict[int, FrequencyRule] = field(default_factory=dict)  # code -> its (first) rule
    duration: dict[int, DurationRule] = field(default_factory=dict)
    grace_tolerance: dict[str, int] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()


NO_CUSTOMIZATION = Customization(source="none")


def load_customization(path: str) -> Customization:
    """The rules at `path`, or the built-in ones (the device plugin's shipped faultCustomization.json)
    when `path` is empty."""
    if not path:
        text = Path(__file__).with_name("builtin_customization.json").read_text("utf-8")
        return parse_customization(json.loads(text), "built-in fault customization")
    return parse_customization(read_json_file(path), path)


def parse_customization(document: object, source: str) -> Customization:
    problems: list[str] = []
    warnings: list[str] = []
    if not isinstance(document, dict):
        raise ConfigError([file_problem(source, "", "expected a JSON object")])
    for key in document:
        if key not in ("GraceTolerance", "FaultFrequency", "FaultDuration"):
            problems.append(file_problem(source, clip(key, 80), "unknown key (known: GraceTolerance, FaultFrequency, FaultDuration)"))

    reader = _Reader(source, problems)
    grace: dict[str, int] = {}
    tolerance = document.get("GraceTolerance", {})
    if isinstance(tolerance, dict):
        for key, value in tolerance.items():
            if key not in ("WaitProcessReadCMTime", "WaitDeviceResetTime", "WaitFaultSelfHealingTime"):
                problems.append(file_problem(source, f"GraceTolerance.{clip(key, 80)}", "unknown key"))
                continue
            number = reader.integer(tolerance, key, f"GraceTolerance.{key}", required=True)
            if number is not None:
                grace[key] = number
    else:
        problems.append(file_problem(source, "GraceTolerance", "expected an object"))

    frequency: dict[int, FrequencyRule] = {}
    for where, rule in reader.rules(document, "FaultFrequency"):
        codes = reader.codes(rule, where)
        window = reader.integer(rule, "TimeWindow", f"{where}.TimeWindow", required=True)
        times = reader.integer(rule, "Times", f"{where}.Times", required=True)
        level = reader.level(rule, f"{where}.FaultHandling", FREQUENCY_LEVELS)
        release = reader.integer(rule, "ReleaseTimeWindow", f"{where}.ReleaseTimeWindow", required=False)
        if release is None and level is not None and level is not Level.ManuallySeparateNPU and "ReleaseTimeWindow" not in rule:
            problems.append(file_problem(source, f"{where}.ReleaseTimeWindow",
                                         f"required when FaultHandling is {level.name} (only ManuallySeparateNPU may omit it)"))
        if None in (codes, window, times, level) or ("ReleaseTimeWindow" in rule and release is None):
            continue
        built = FrequencyRule(codes, window, times, level, NEVER_RELEASE_S if release is None else release)
        _index(frequency, built, where, source, warnings)

    duration: dict[int, DurationRule] = {}
    for where, rule in reader.rules(document, "FaultDuration"):
        codes = reader.codes(rule, where)
        timeout = reader.integer(rule, "FaultTimeout", f"{where}.FaultTimeout", required=True)
        recover = reader.integer(rule, "RecoverTimeout", f"{where}.RecoverTimeout", required=True)
        level = reader.level(rule, f"{where}.FaultHandling", DURATION_LEVELS)
        if None in (codes, timeout, recover, level):
            continue
        _index(duration, DurationRule(codes, timeout, recover, level), where, source, warnings)

    if problems:
        raise ConfigError(problems)
    return Customization(source, frequency, duration, grace, tuple(warnings))


def _index(by_code: dict, rule, where: str, source: str, warnings: list[str]) -> None:
    for code in sorted(rule.codes):
        if code in by_code:
            warnings.append(f"{source}: {where} repeats {code:08X}; the first rule for it applies")
        else:
            by_code[code] = rule


class _Reader:
    """Reads fields of the rule objects, collecting one problem per bad value."""

    _ALLOWED = {
        "FaultFrequency": {"EventId", "TimeWindow", "Times", "FaultHandling", "ReleaseTimeWindow"},
        "FaultDuration": {"EventId", "FaultTimeout", "RecoverTimeout", "FaultHandling"},
    }

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems

    def problem(self, where: str, reason: str) -> None:
        self.problems.append(file_problem(self.source, where, reason))

    def rules(self, document: dict, key: str):
        value = document.get(key, [])
        if not isinstance(value, list):
            self.problem(key, "expected a list of rules")
            return
        for index, rule in enumerate(value):
            where = f"{key}[{index}]"
            if not isinstance(rule, dict):
                self.problem(where, "expected an object")
                continue
            for extra in sorted(set(rule) - self._ALLOWED[key]):
                self.problem(f"{where}.{clip(extra, 80)}", f"unknown key (known: {', '.join(sorted(self._ALLOWED[key]))})")
            yield where, rule

    def codes(self, rule: dict, where: str) -> frozenset[int] | None:
        value = rule.get("EventId")
        if not isinstance(value, list) or not value:
            self.problem(f"{where}.EventId", "expected a non-empty list of hex fault codes")
            return None
        codes = set()
        for index, item in enumerate(value):
            try:
                if not isinstance(item, str):
                    raise ValueError(f"{quote(item)} is not a string")
                codes.add(parse_code(item.strip()))
            except ValueError as exc:
                self.problem(f"{where}.EventId[{index}]", str(exc))
                return None
        return frozenset(codes)

    def integer(self, rule: dict, key: str, where: str, required: bool) -> int | None:
        if key not in rule:
            if required:
                self.problem(where, "missing")
            return None
        value = rule[key]
        low, high = RANGES[key]
        if isinstance(value, bool) or not isinstance(value, int):
            self.problem(where, f"{quote(value)} is not an integer (allowed range {low}..{high})")
            return None
        if not low <= value <= high:
            self.problem(where, f"{value} is out of range (allowed range {low}..{high})")
            return None
        return value

    def level(self, rule: dict, where: str, allowed: frozenset[Level]) -> Level | None:
        value = rule.get("FaultHandling")
        names = ", ".join(level.name for level in sorted(allowed))
        if not isinstance(value, str) or value not in Level.__members__ or Level[value] not in allowed:
            self.problem(where, f"{quote(value)} is not allowed here (allowed: {names})")
            return None
        return Level[value]
