"""The dashboards' pictures (bench/render_dashboard.py, bench/demo_prometheus.py) without Prometheus or matplotlib:
what is sent to Prometheus, and how its answers become what a panel shows.

It lives with the renderer, so the tests never import bench (pytest collects it through testpaths)."""

from __future__ import annotations

import json
import subprocess
import sys

import promql_parser
import pytest

from bench import render_dashboard
from bench.demo_prometheus import chart_scrape, seconds
from bench.render_dashboard import (DASHBOARDS, MAX_LEGEND, heat_counts, labelled, legend, overrides, promql,
                                    table_rows, targets)
from testkit import REPO


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_query_sent_is_promql_and_every_panel_type_is_drawn(name):
    dashboard = json.loads(DASHBOARDS[name].read_text())
    assert {p["type"] for p in dashboard["panels"]} <= render_dashboard.DRAWN_TYPES | {render_dashboard.HEADING}
    for kind in render_dashboard.DRAWN_TYPES:
        assert callable(getattr(render_dashboard.Renderer, kind.replace("-", "_")))
    sent = [promql(target["expr"], "2m") for _, target in targets(dashboard)]
    assert len(sent) == sum(len(p.get("targets", [])) for p in dashboard["panels"])
    for expr in sent:
        assert "$" not in expr, expr
        promql_parser.parse(expr)  # raises on what Prometheus would refuse
    assert any('=~".*"' in expr for expr in sent) and any("[2m]" in expr for expr in sent)


def test_legends_tables_and_heat_maps_are_what_grafana_shows():
    labels = {"node": "n1", "id": "3", "fault_code": "80E18005", "instance": "x:1", "__name__": "m"}
    assert legend({"legendFormat": "{{node}} NPU{{ id }}"}, labels) == "n1 NPU3"
    assert legend({}, labels) == '{fault_code="80E18005", id="3", node="n1"}'

    panel = {"transformations": [{"id": "organize", "options": {
        "excludeByName": {"instance": True, "__name__": True}, "indexByName": {"node": 0, "id": 1},
        "renameByName": {"id": "NPU"}}}]}
    series = [{"metric": dict(labels, id=i), "values": []} for i in ("10", "2")]
    columns, rows = table_rows(panel, series)
    assert columns == ["node", "NPU", "fault_code"]
    assert rows == [["n1", "2", "80E18005"], ["n1", "10", "80E18005"]]  # NPU2 before NPU10

    cumulative = {"0.5": ["1", "4"], "1": ["3", "4"], "+Inf": ["3", "9"]}
    series = [{"metric": {"le": le}, "values": [[100, a], [115, b]]} for le, (a, b) in cumulative.items()]
    bounds, times, counts = heat_counts(series)
    assert bounds == [0.5, 1.0, float("inf")] and times == [100, 115]
    assert counts == [[1, 4], [2, 0], [0, 5]]


def test_overrides_apply_to_the_series_they_match():
    dash = {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}
    panel = {"fieldConfig": {"overrides": [
        {"matcher": {"id": "byRegexp", "options": "/reference$/"}, "properties": [dash]},
        {"matcher": {"id": "byRegexp", "options": "s1 .*"}, "properties": [{"id": "custom.lineWidth", "value": 3}]},
        {"matcher": {"id": "byName", "options": "s1 reference"}, "properties": [{"id": "custom.lineWidth", "value": 2}]},
    ]}}
    assert overrides(panel, "s0 reference") == {"custom.lineStyle": dash["value"]}
    assert overrides(panel, "s1 reference") == {"custom.lineStyle": dash["value"], "custom.lineWidth": 2}
    assert overrides(panel, "s1 w5") == {"custom.lineWidth": 3}
    assert overrides(panel, "s0 w1") == {} and overrides({}, "x") == {}
    assert overrides(panel, "s10 reference x") == {}  # a bare pattern matches the whole name

    nan = float("nan")
    lines = [(f"s0 w{i}", [0, 1], [1.0, 1.0 + i / 100]) for i in range(MAX_LEGEND + 4)]
    lines += [("s0 reference", [0, 1], [0.5, 0.5]), ("s0 w99", [0, 1], [nan, nan])]
    named = {lines[i][0] for i in labelled(panel, lines)}
    assert len(named) == MAX_LEGEND and "s0 reference" in named and "s0 w99" not in named
    assert {f"s0 w{i}" for i in range(MAX_LEGEND + 4 - (MAX_LEGEND - 1), MAX_LEGEND + 4)} <= named  # the highest
    assert labelled(panel, lines[:3]) == {0, 1, 2}


def test_the_scrape_interval_is_the_charts():
    interval, timeout = chart_scrape()
    assert seconds(interval) >= seconds(timeout) > 0
    assert seconds("1m30s") == 90 and seconds("15s") == 15
    with pytest.raises(ValueError):
        seconds("")


@pytest.mark.parametrize("module, args", [("bench.render_dashboard", ["--prometheus", "http://127.0.0.1:9"]),
                                          ("bench.demo_prometheus", ["--seconds", "1"])])
def test_matplotlib_is_needed_only_to_draw_and_its_absence_is_one_line_before_any_work(tmp_path, module, args):
    code = f"import sys, {module}; assert 'matplotlib' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    code = (f"import sys; sys.modules['matplotlib'] = None\nfrom {module} import main\n"
            f"sys.exit(main({args + ['--out' if 'render' in module else '--out-dir', str(out)]!r}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "matplotlib is not installed" in done.stderr, done.stderr
    assert not out.exists()
