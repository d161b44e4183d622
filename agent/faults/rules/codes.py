"""Fault-code tables in the device plugin's faultCode.json format, and how a code gets its level."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from agent.config import read_config_file
from agent.common.errors import ConfigError, clip, file_problem, quote
from agent.faults.rules.levels import NETWORK_LEVELS
from agent.model import Level

# faultCode.json keys, checked in this order: the first bucket holding a code decides its level,
# so a code listed under two levels takes the more severe one, as in the device plugin.
CHIP_BUCKETS: dict[str, Level] = {
    "SeparateNPUCodes": Level.SeparateNPU,
    "PreSeparateNPUCodes": Level.PreSeparateNPU,
    "RestartNPUCodes": Level.RestartNPU,
    "FreeRestartNPUCodes": Level.FreeRestartNPU,
    "RestartBusinessCodes": Level.RestartBusiness,
    "RestartRequestCodes": Level.RestartRequest,
    "SubHealthFaultCodes": Level.SubHealthFault,
    "NotHandleFaultCodes": Level.NotHandleFault,
}
NETWORK_BUCKETS: dict[str, Level] = {
    "SeparateNPUNetworkCodes": Level.SeparateNPU,
    "PreSeparateNPUNetworkCodes": Level.PreSeparateNPU,
    "SubHealthFaultNetworkCodes": Level.SubHealthFault,
    "NotHandleFaultNetworkCodes": Level.NotHandleFault,
}

# Parameter-plane codes the device plugin classifies as network faults.
NETWORK_FAULT_CODES = frozenset({0x81078603, 0x81078607, 0x110000002, 0x110001024})
# A network code found in no bucket.
NETWORK_DEFAULT_LEVEL = Level.PreSeparateNPU

_HEX = re.compile(r"^[0-9A-Fa-f]{1,16}$")


def parse_code(text: str) -> int:
    """A code as the tables and the driver spell it: hex digits, optional 0x."""
    body = text[2:] if text[:2].lower() == "0x" else text
    if not _HEX.match(body):
        raise ValueError(f"{quote(text)} is not a hexadecimal fault code")
    return int(body, 16)


@dataclass(frozen=True)
class FaultCodeTable:
    source: str
    chip: dict[int, Level]
    network: dict[int, Level]
    spellings: dict[int, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    def lookup(self, code: int) -> Level | None:
        """The configured level of a code, or None when the table does not know it."""
        if code in NETWORK_FAULT_CODES:
            return self.network.get(code, NETWORK_DEFAULT_LEVEL)
        return self.chip.get(code)

    def spell(self, code: int) -> str:
        """Upper-case hex as the table spelled it (keeps the leading zero of 9-digit codes)."""
        return self.spellings.get(code, f"{code:08X}")

    def __len__(self) -> int:
        return len(self.chip) + len(self.network)


def parse_fault_code_table(document: object, source: str) -> FaultCodeTable:
    problems: list[str] = []
    warnings: list[str] = []
    if not isinstance(document, dict):
        raise ConfigError([file_problem(source, "", "expected a JSON object of code lists")])
    for key in document:
        if key not in CHIP_BUCKETS and key not in NETWORK_BUCKETS:
            known = ", ".join([*CHIP_BUCKETS, *NETWORK_BUCKETS])
            problems.append(file_problem(source, clip(key, 80), f"unknown key (known: {known})"))

    chip: dict[int, Level] = {}
    network: dict[int, Level] = {}
    spellings: dict[int, str] = {}

    def codes_of(key: str) -> list[int]:
        value = document.get(key, [])
        if not isinstance(value, list):
            problems.append(file_problem(source, key, "expected a list of hex strings"))
            return []
        codes = []
        for index, item in enumerate(value):
            try:
                if not isinstance(item, str):
                    raise ValueError(f"{quote(item)} is not a string")
                code = parse_code(item.strip())
            except ValueError as exc:
                problems.append(file_problem(source, f"{key}[{index}]", str(exc)))
                continue
            spellings.setdefault(code, item.strip().upper().removeprefix("0X"))
            codes.append(code)
        return codes

    for key, level in CHIP_BUCKETS.items():
        for code in codes_of(key):
            if code in NETWORK_FAULT_CODES:
                _place_network(network, code, level, source, key, warnings)
            elif code in chip:
                if chip[code] != level:
                    warnings.append(
                        f"{source}: {spellings[code]} is listed under {chip[code].name} and {level.name}; "
                        f"the more severe {chip[code].name} applies"
                    )
            else:
                chip[code] = level
    for key, level in NETWORK_BUCKETS.items():
        for code in codes_of(key):
            if code in NETWORK_FAULT_CODES:
                _place_network(network, code, level, source, key, warnings)
            else:
                warnings.append(f"{source}: {key} lists {spellings[code]}, which is not a network code; ignored")
    if problems:
        raise ConfigError(problems)
    return FaultCodeTable(source, chip, network, spellings, tuple(warnings))


def _place_network(network: dict[int, Level], code: int, level: Level, source: str, key: str,
                   warnings: list[str]) -> None:
    if level not in NETWORK_LEVELS:
        warnings.append(
            f"{source}: network code {code:08X} under {key} ({level.name}) is not a level a network fault "
            f"may have; downgraded to NotHandleFault as the device plugin does"
        )
        level = Level.NotHandleFault
    network[code] = max(level, network.get(code, Level.NormalNPU))


def load_fault_code_table(path: str) -> FaultCodeTable:
    """The table at `path`, or the built-in default table when `path` is empty."""
    if not path:
        # Beside this module (the package is installed as files): importlib.resources would bring in
        # zipfile and its readers, half a MiB of every agent's memory, to read one file.
        text = Path(__file__).with_name("builtin_fault_codes.json").read_text("utf-8")
        return parse_fault_code_table(json.loads(text), "built-in fault-code table")
    return parse_fault_code_table(read_json_file(path), path)


def read_json_file(path: str) -> object:
    """The JSON document in the rule file at `path`; ConfigError naming the file when it cannot be used."""
    text = read_config_file(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        reason = f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
    except RecursionError:
        reason = "invalid JSON: nested too deeply"
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits
        reason = f"invalid JSON: {exc}"
    raise ConfigError([file_problem(path, "", reason)])
