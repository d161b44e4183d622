"""What the configuration's declarations (agent/config.py, `key()`) generate beside the agent's own
validation: docs/configuration.md's table, the chart's `agent:` values, their part of
values.schema.json and the chart README's table of agent keys. `python -m tests.support.gendocs`
writes them all; tests/unit/test_docs.py fails while one differs.

The chart's own facts about a key (which values set it, what mounting it means) are in
CHART_NOTES: a key added to the agent needs none.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import textwrap
import typing
from pathlib import Path

from agent.config import NAMESPACE, Config, Key

REPO = Path(__file__).resolve().parents[2]
CONFIGURATION = REPO / "docs" / "configuration.md"
CHART = REPO / "helm" / "npu-node-agent"
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"
CHART_README = CHART / "README.md"

TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean"}  # YAML's, and JSON Schema's
SHAPE_SCHEMAS = {"host_port": {"$ref": "#/definitions/hostPort"}, "absolute_path": {"$ref": "#/definitions/absolutePath"},
                 "absolute_path_or_empty": {"type": "string", "pattern": "^(/.*)?$"},
                 "not_empty": {"type": "string", "minLength": 1},
                 "namespaces": {"type": "array", "items": {"type": "string", "pattern": f"^{NAMESPACE.pattern}$"},
                                "uniqueItems": True}}

CHART_SET = {"node_name": "each pod's node (the downward API)", "http.listen": "ports.http", "grpc.listen": "ports.grpc"}
CHART_NOTES = {
    "state_dir": "A hostPath, created if missing: how a restarted or upgraded agent remembers.",
    "devices.backend": "With `dcmi` the container runs privileged (see `dcmi`).",
    "devices.dcmi_library": "The image sets `LD_LIBRARY_PATH` to the driver's directories.",
    "devices.simulated.scenario": "Set by the chart from `files.scenario`.",
    "faults.fault_code_file": "Set by the chart from `files.faultCode`.",
    "faults.customization_file": "Set by the chart from `files.customization`.",
    "clusterd.address": "`MINDX_SERVER_IP` comes from `extraEnv`.",
    "clusterd.resource": "ClusterD's publicCustomization.json must list it (docs/faults.md).",
    "clusterd.public_codes": "Helm merges maps: remove a default level with `LevelName: null`.",
    "kubernetes.enabled": "Off: no RBAC object, no service account token mounted.",
    "kubernetes.pod_resources_socket": "Its directory is mounted read-only from `podResources.hostPath`; "
                                       "connecting needs root.",
    "profiling.root": "A hostPath, created if missing; mounted only when `metrics` or `disk_guard` is on, "
                      "read-only without `disk_guard`.",
    "profiling.disk_guard": "It deletes the training processes' record files, so the container runs as root with "
                            "CAP_DAC_OVERRIDE.",
    "datatrace.root": "A hostPath.",
    "taskd_proxy.enabled": "Needs `hostNetwork` and `hostPID`, and root with CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH "
                           "(the render fails without them); docs/taskd-proxy.md.",
    "taskd_proxy.node_buffer_mb": "The default fits `resources.limits.memory` (512Mi) with room.",
    "telemetry.enabled": "With backend `dcmi`, true also turns on `hostPID`: each NPU process is mapped to its "
                         "container through the host's /proc.",
}


def declared_keys(schema: type = Config, prefix: str = "") -> list[tuple[str, type, object, Key]]:
    """(key path, type, default, declaration) of every key, in the schema's order."""
    keys = []
    hints = typing.get_type_hints(schema)
    defaults = schema()
    for field in dataclasses.fields(schema):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            keys += declared_keys(hint, f"{prefix}{field.name}.")
        else:
            keys.append((f"{prefix}{field.name}", hint, getattr(defaults, field.name), field.metadata["key"]))
    return keys


def _type_name(hint) -> str:
    origin = typing.get_origin(hint)
    return {dict: "mapping of string to string", list: "list of strings"}.get(origin) or TYPE_NAMES[hint]


def config_keys(schema: type = Config) -> list[tuple[str, str, str]]:
    """(key path, type, default as JSON) of every key."""
    return [(path, _type_name(hint), json.dumps(default)) for path, hint, default, _ in declared_keys(schema)]


def environment_variables() -> list[str]:
    """The variables the configuration reads from the environment."""
    source = inspect.getsource(inspect.getmodule(Config))
    return sorted(set(re.findall(r"""environ\.get\(["']([A-Z_]+)["']""", source)))


def _cell(text: str) -> str:
    return text.replace("|", "&#124;")


def configuration_table(schema: type = Config) -> str:
    rows = ["| key | type | default | accepts | meaning |", "|---|---|---|---|---|"]
    for path, hint, default, declared in declared_keys(schema):
        rows.append(f"| `{path}` | {_type_name(hint)} | `{json.dumps(default)}` | {_cell(declared.text())} "
                    f"| {_cell(declared.meaning)} |")
    return "\n".join(rows)


def meanings(document: str) -> dict[str, str]:
    """Key -> the meaning a configuration table (the last column) gives it."""
    found = {}
    for line in document.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if line.startswith("| `") and len(cells) >= 2:
            found[cells[0].strip("`")] = cells[-1]
    return found


def _charted(schema: type = Config) -> list[tuple[str, type, object, Key]]:
    return [entry for entry in declared_keys(schema) if entry[0] not in CHART_SET]


def _sentence(text: str) -> str:
    return f"{text[0].upper()}{text[1:]}{'' if text.endswith('.') else '.'}"


def _yaml_scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(value)  # a JSON string or number is YAML too


def values_block(schema: type = Config) -> str:
    """The chart's `agent:` block: every key with its default, its meaning and what it accepts."""
    lines, opened = ["agent:"], []
    for path, _, default, declared in _charted(schema):
        *sections, name = path.split(".")
        same = next((depth for depth, pair in enumerate(zip(opened, sections)) if pair[0] != pair[1]),
                    min(len(opened), len(sections)))
        lines += [f"{'  ' * (depth + 1)}{sections[depth]}:" for depth in range(same, len(sections))]
        opened = sections
        indent = "  " * (len(sections) + 1)
        said = _sentence(declared.meaning) + (f" Accepts: {declared.text()}." if declared.text() else "")
        said += f" {CHART_NOTES[path]}" if path in CHART_NOTES else ""
        lines += textwrap.wrap(said, 100, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ",
                               break_on_hyphens=False)
        if isinstance(default, dict) and default:
            lines.append(f"{indent}{name}:")
            lines += [f"{indent}  {k}: {_yaml_scalar(v)}" for k, v in default.items()]
        else:
            lines.append(f"{indent}{name}: {_yaml_scalar(default)}")
    return "\n".join(lines)


def _key_schema(hint, declared: Key) -> dict:
    if declared.mapping:
        names, pattern, name = declared.mapping
        return {"type": "object", "description": f"{declared.text()} (null removes a default)",
                "additionalProperties": False,
                "properties": {k: {"type": ["string", "null"], "pattern": f"^{pattern}$"} for k in names}}
    if declared.shape:
        return dict(SHAPE_SCHEMAS[declared.shape])
    described: dict = {"type": TYPE_NAMES[hint]}
    if declared.choices:
        described["enum"] = list(declared.choices)
    if declared.between:
        low, high = declared.between
        described["minimum"] = low
        if high is not None:
            described["maximum"] = high
    if declared.off is not None:
        return {"description": declared.text(), "anyOf": [{"const": declared.off}, described]}
    return described


def agent_schema(schema: type = Config) -> dict:
    """values.schema.json's `agent` property: exactly the keys the agent knows, each as it accepts it."""
    root: dict = {"type": "object", "description": "the agent's configuration (docs/configuration.md); "
                  + ", ".join(CHART_SET) + " are set by the chart", "additionalProperties": False, "properties": {}}
    for path, hint, _, declared in _charted(schema):
        *sections, name = path.split(".")
        node = root
        for section in sections:
            node = node["properties"].setdefault(section, {"type": "object", "additionalProperties": False,
                                                           "properties": {}})
        node["properties"][name] = _key_schema(hint, declared)
    return root


def chart_table(schema: type = Config) -> str:
    rows = ["| value | default | accepts | meaning |", "|---|---|---|---|"]
    for path, _, default, declared in _charted(schema):
        meaning = _sentence(declared.meaning) + (f" {CHART_NOTES[path]}" if path in CHART_NOTES else "")
        rows.append(f"| `agent.{path}` | `{json.dumps(default)}` | {_cell(declared.text())} | {_cell(meaning)} |")
    return "\n".join(rows)


def documents(with_section) -> dict[Path, str]:
    """Each file the declarations generate, as it should read now (`with_section(text, generated,
    begin, end)` puts a generated part between its markers)."""
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    schema["properties"]["agent"] = agent_schema()
    return {
        CONFIGURATION: with_section(CONFIGURATION.read_text(encoding="utf-8"), configuration_table()),
        VALUES: with_section(VALUES.read_text(encoding="utf-8"), values_block(),
                             "# BEGIN generated by `python -m tests.support.gendocs`", "# END generated"),
        SCHEMA: json.dumps(schema, indent=2, ensure_ascii=False) + "\n",
        CHART_README: with_section(CHART_README.read_text(encoding="utf-8"), chart_table()),
    }
