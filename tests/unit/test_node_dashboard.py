"""The chart's node/fault Grafana dashboard (files/grafana-node-dashboard.json), checked as the training one is:
every target is PromQL over series the agent exports, with labels that exist where they are used. The
exported series and their labels are the agent's collectors' own (what docs/metrics.md is generated from)."""

from __future__ import annotations

import json
import re

import pytest

from agent.telemetry.families import FAMILIES
from tests.support.gendocs import metric_families
from tests.unit.test_dashboard_and_rules import (FILES, GRAFANA_BUILTINS, GRAFANA_VARIABLE, LABEL_VALUES, LEGEND_LABEL,
                                                 check, grafana_to_promql)

NODE_DASHBOARD = FILES / "grafana-node-dashboard.json"
TRAINING_DASHBOARD = FILES / "grafana-dashboard.json"
LEVELS = ["NormalNPU", "NotHandleFault", "SubHealthFault", "RestartRequest", "RestartBusiness", "FreeRestartNPU",
          "RestartNPU", "PreSeparateNPU", "SeparateNPU", "ManuallySeparateNPU"]


@pytest.fixture(scope="module")
def exported() -> dict[str, frozenset[str]]:
    """Every gauge and counter the agent's collectors expose, by the name Prometheus scrapes, with its labels."""
    return {name: frozenset(labels) for name, (kind, labels, _) in metric_families().items() if kind != "histogram"}


def check_exported(expr: str, exported: dict[str, frozenset[str]]):
    return check(grafana_to_promql(expr), exported)


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(NODE_DASHBOARD.read_text())


def queried(dashboard) -> list[dict]:
    """The panels that query (rows only group them)."""
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def telemetry_row(dashboard) -> list[dict]:
    """The panels below the "Telemetry" row."""
    panels = dashboard["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "Telemetry")
    return panels[start + 1:]


def names(panel, exported) -> set[str]:
    return set().union(*(check_exported(t["expr"], exported)[1].names for t in panel["targets"]))


def test_it_is_importable_beside_the_training_dashboard(dashboard):
    training = json.loads(TRAINING_DASHBOARD.read_text())
    assert dashboard["schemaVersion"] == training["schemaVersion"]
    assert dashboard["uid"] != training["uid"] and dashboard["title"] != training["title"]
    assert dashboard["__inputs"] == training["__inputs"]
    assert "${DS_PROMETHEUS}" in NODE_DASHBOARD.read_text()
    required = {r["id"] for r in dashboard["__requires"] if r["type"] == "panel"}
    assert {p["type"] for p in queried(dashboard)} == required


def test_the_node_variable_lists_the_nodes_and_every_panel_uses_it(dashboard, exported):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"datasource", "node"}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    node = variables["node"]
    assert node["datasource"]["uid"] == "${datasource}" and node["allValue"] == ".*"
    match = LABEL_VALUES.match(node["query"]["query"])
    assert match and match.group(2) == "node"
    labels, checker = check_exported(match.group(1), exported)
    assert checker.problems == [] and "node" in labels
    for panel in queried(dashboard):
        for target in panel["targets"]:
            assert 'node=~"$node"' in target["expr"], (panel["title"], target["expr"])


def test_every_target_is_promql_over_exported_metrics_with_existing_labels(dashboard, exported):
    variables = {v["name"] for v in dashboard["templating"]["list"]} | GRAFANA_BUILTINS
    ids, titles, cells = set(), set(), {}
    for panel in dashboard["panels"]:
        title = panel["title"]
        assert panel["id"] not in ids and title not in titles
        ids.add(panel["id"]), titles.add(title)
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, title
        for cell in ((x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])):
            assert cell not in cells, f"{title} overlaps {cells[cell]}"
            cells[cell] = title
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", title
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), title
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", title
            for used in GRAFANA_VARIABLE.findall(target["expr"]):
                assert (used[0] or used[1]) in variables, (title, used)
            labels, checker = check_exported(target["expr"], exported)
            assert checker.problems == [], (title, checker.problems)
            for label in LEGEND_LABEL.findall(target.get("legendFormat", "")):
                assert labels is not None and label in labels, f"{title}: legend {{{{{label}}}}} not in {sorted(labels or ())}"


def test_it_shows_what_the_issue_asks_for(dashboard, exported):
    by_title = {p["title"]: p for p in queried(dashboard)}
    expected = {
        "npu_chip_info_health_status", "npu_agent_device_fault_level", "npu_agent_device_fault", "machine_npu_nums",
        "npu_agent_outbox_pending", "npu_agent_fault_reports_total", "npu_agent_sink_last_success_timestamp_seconds",
        "npu_agent_component_ready", "npu_agent_task_restarts_total", "npu_agent_executor_calls",
        "npu_agent_driver_call_timeouts_total", "npu_agent_fault_rule_reloads_total",
    }
    assert expected <= set().union(*(names(p, exported) for p in by_title.values()))
    level = next(p for p in dashboard["panels"] if names(p, exported) == {"npu_agent_device_fault_level"})
    assert level["type"] == "state-timeline"
    mapped = level["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert {int(v): m["text"] for v, m in mapped.items()} == dict(enumerate(LEVELS))
    health = next(p for p in dashboard["panels"] if names(p, exported) == {"npu_chip_info_health_status"})
    assert health["type"] == "state-timeline"
    assert set(health["fieldConfig"]["defaults"]["mappings"][0]["options"]) == {"1", "0", "-1"}
    table = next(p for p in dashboard["panels"] if p["type"] == "table")
    [target] = table["targets"]
    assert re.fullmatch(r'npu_agent_device_fault\{node=~"\$node"\} == 1', target["expr"]) and target["instant"]
    shown = table["transformations"][0]["options"]["indexByName"]
    assert {"id", "fault_code", "fault_level", "namespace", "pod_name", "container_name"} <= set(shown)


def test_the_telemetry_row_shows_npu_exporters_families_per_chip(dashboard, exported):
    """The panels query npu-exporter's family names as the agent defines them, so a renamed family (or a
    dashboard typo) fails here rather than as an empty panel."""
    panels = telemetry_row(dashboard)
    shown = set().union(*(names(p, exported) for p in panels))
    assert shown <= {family.name for family in FAMILIES}
    assert {"npu_chip_info_utilization", "npu_chip_info_hbm_used_memory", "npu_chip_info_hbm_total_memory",
            "npu_chip_info_temperature", "npu_chip_info_hbm_temperature", "npu_chip_info_power",
            "npu_chip_info_hbm_ecc_single_bit_error_cnt", "npu_chip_info_hbm_ecc_double_bit_error_cnt",
            "npu_chip_info_hbm_ecc_double_bit_isolated_pages_cnt", "npu_chip_info_link_status",
            "npu_chip_info_bandwidth_tx", "npu_chip_info_bandwidth_rx", "npu_chip_info_hccs_bandwidth_info_total_tx",
            "npu_chip_info_hccs_bandwidth_info_total_rx"} <= shown
    for panel in panels:
        assert panel["gridPos"]["y"] > next(p for p in dashboard["panels"] if p["type"] == "row")["gridPos"]["y"]
        for target in panel["targets"]:
            assert {"id", "pod_name"} <= set(LEGEND_LABEL.findall(target["legendFormat"])), panel["title"]
    link = next(p for p in panels if names(p, exported) == {"npu_chip_info_link_status"})
    assert link["type"] == "state-timeline"
    assert set(link["fieldConfig"]["defaults"]["mappings"][0]["options"]) == {"1", "0", "-1"}
