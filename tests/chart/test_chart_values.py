"""The chart's values: lint, the schema against the agent's own configuration, and what a mistake
in the values says at install time."""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing

import pytest
import yaml

from agent.config import Config, to_dict
from testkit import REPO
from tests.chart.conftest import CHART, VALUE_FILES, VALUES
from tests.support.genconfig import CHART_SET as CHART_KEYS  # agent keys set by the chart, not by values


def _values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def test_lint_default_and_strict(helm):
    for args in (["lint", str(CHART)], ["lint", "--strict", str(CHART)]):
        done = helm.run(*args)
        assert done.returncode == 0, f"helm {' '.join(args)}:\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("values", VALUE_FILES)
def test_lint_strict_with_each_values_file(helm, values):
    done = helm.run("lint", "--strict", str(CHART), "-f", str(VALUES / f"{values}.yaml"))
    assert done.returncode == 0, f"{done.stdout}{done.stderr}"


def test_app_version_is_the_project_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert chart["version"] == "0.1.0"
    assert chart["appVersion"] == project["version"]


def test_agent_values_are_the_agent_defaults():
    """values.yaml documents every agent key with the agent's own default, so the chart's
    defaults cannot drift from the agent's (a key added to agent/config.py fails here)."""
    defaults = to_dict(Config())
    for path in CHART_KEYS:
        *sections, name = path.split(".")
        section = defaults
        for part in sections:
            section = section[part]
        del section[name]
    assert _values()["agent"] == {k: v for k, v in defaults.items() if v != {}}  # a section the chart sets whole: gone


def test_schema_accepts_exactly_the_agent_keys():
    """An unknown key is an error in the agent; the schema says so at `helm install` instead."""
    def valued(hint, path: str) -> bool:  # a key, or a section with a key, that values set
        if not dataclasses.is_dataclass(hint):
            return path not in CHART_KEYS
        return any(valued(h, f"{path}.{n}") for n, h in typing.get_type_hints(hint).items())

    def walk(cls, schema: dict, path: str):
        hints = typing.get_type_hints(cls)
        expected = {name for name, hint in hints.items() if valued(hint, f"{path}{name}")}
        assert schema.get("additionalProperties") is False, f"{path or 'agent'}: unknown keys accepted"
        assert set(schema["properties"]) == expected, path or "agent"
        for name in expected:
            if dataclasses.is_dataclass(hints[name]):
                walk(hints[name], schema["properties"][name], f"{path}{name}.")

    walk(Config, _schema()["properties"]["agent"], "")


@pytest.mark.parametrize("setting, where, reason", [
    ("agent.devcies.backend=dcmi", "/agent", "'devcies' not allowed"),             # a typo'd agent key
    ("serviceMonitor.enable=true", "/serviceMonitor", "'enable' not allowed"),     # a typo'd chart value
    ("agent.log.level=verbose", "/agent/log/level", "must be one of 'debug', 'info', 'warning', 'error'"),
    ("agent.devices.backend=npu-smi", "/agent/devices/backend", "must be one of 'dcmi', 'simulated'"),
    ("ports.http=70000", "/ports/http", "maximum"),
    ("agent.clusterd.public_codes.SeparateNPU=2001100x", "/agent/clusterd/public_codes/SeparateNPU", "[0-9]{9}"),
    ("agent.clusterd.public_codes.NormalNPU=020011001", "/agent/clusterd/public_codes", "'NormalNPU' not allowed"),
    ("terminationGracePeriodSeconds=5", "/terminationGracePeriodSeconds", "minimum"),
])
def test_schema_rejects_naming_the_key(helm, setting, where, reason):
    stderr = helm.render_error(None, setting)
    assert f"at '{where}'" in stderr and reason in stderr, stderr


@pytest.mark.parametrize("values, sets, message", [
    ("taskd-proxy", ("hostPID=false",), "agent.taskd_proxy.enabled needs hostPID: true and hostNetwork: true"),
    ("taskd-proxy", ("hostNetwork=false",), "agent.taskd_proxy.enabled needs hostPID: true and hostNetwork: true"),
    (None, ("agent.datatrace.enabled=true",), "agent.datatrace.enabled needs agent.kubernetes.enabled: true"),
    (None, ("agent.kubernetes.device_info_configmap=true",), "device_info_configmap needs agent.kubernetes.enabled"),
    (None, ("ports.grpc=9410",), "ports.http and ports.grpc are both 9410"),
    ("clusterd", ("agent.faults.customization_file=/x.json",), "files.customization and agent.faults.customization_file"),
    (None, ("serviceMonitor.enabled=true", "service.enabled=false"), "serviceMonitor.enabled needs service.enabled"),
])
def test_inconsistent_values_fail_with_the_fix(helm, values, sets, message):
    assert message in helm.render_error(values, *sets)
