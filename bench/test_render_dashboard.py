"""The renderer of the dashboard's picture (bench/render_dashboard.py), without matplotlib.

It lives with the renderer, so the tests never import bench (pytest collects it through testpaths)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from bench import render_dashboard
from bench.render_dashboard import (Samples, gauge_lines, histogram_quantile, increase, step_p50,
                                    synthetic_samples, window_start)
from testkit import REPO


def test_the_renderer_draws_every_panel_of_the_dashboard_by_its_title():
    dashboard = json.loads(render_dashboard.DASHBOARD.read_text())
    assert set(render_dashboard.DRAWERS) == {p["title"] for p in dashboard["panels"]}
    for method in render_dashboard.DRAWERS.values():
        assert callable(getattr(render_dashboard.Renderer, method))


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_renderer_needs_matplotlib_only_to_draw_and_says_so_in_one_line(tmp_path):
    done = run_python("import sys, bench.render_dashboard; assert 'matplotlib' not in sys.modules")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "dash.png"
    done = run_python("import sys; sys.modules['matplotlib'] = None\n"
                      "from bench.render_dashboard import main\n"
                      f"sys.exit(main(['--synthetic', '--seconds', '4', '--out', {str(out)!r}]))")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "matplotlib is not installed" in done.stderr, done.stderr
    assert not out.exists()


def test_histogram_quantile_and_increase_follow_prometheus():
    inf = math.inf
    assert histogram_quantile(0.5, [(1.0, 0), (1.25, 10), (inf, 10)]) == pytest.approx(1.125)
    assert histogram_quantile(0.5, [(0.75, 4), (1.0, 6), (inf, 10)]) == pytest.approx(0.75 + 0.25 * 0.5)
    assert histogram_quantile(0.5, [(0.5, 10), (inf, 10)]) == pytest.approx(0.25)  # first bucket starts at 0
    assert histogram_quantile(0.9, [(1.0, 1), (inf, 10)]) == 1.0  # in +Inf: the highest finite bound
    assert math.isnan(histogram_quantile(0.5, [(1.0, 0), (inf, 0)]))
    assert increase([10, 12, 3, 5, None, 9], 0, 5) == 2 + 3 + 2 + 4  # a reset counts from 0
    times = [0, 2, 4, 6, 8, 10]
    assert window_start(times, 5, 4) == 3 and window_start(times, 1, 4) == 0 and window_start(times, 0, 4) is None
    assert window_start(times, 1, 30) is None  # less than half a window of history: no value


def test_synthetic_samples_show_rank_5_slow_and_survive_a_save(tmp_path):
    samples = synthetic_samples(seconds=48, interval=4)
    assert len(samples.times) == 13
    slow = {(labels["rank"], labels["reason"]): values for labels, values in samples.select("training_rank_slow")}
    assert len(slow) == 16 * 3
    assert slow[("5", "compute")][0] == 0 and slow[("5", "compute")][-1] == 1
    assert [rank for (rank, reason), v in slow.items() if reason == "compute" and 1 in v] == ["5"]
    assert all(v[-1] == 1 for (_, reason), v in slow.items() if reason == "temporal")  # synchronous: all wait
    compute = gauge_lines(samples, "training_rank_compute_seconds", None)
    assert compute[("mindx-7f3c2a", "5")][-1] > 1.10 * compute[("mindx-7f3c2a", "4")][-1]
    p50 = step_p50(samples, 12, None)
    assert 0.25 < p50[("mindx-7f3c2a", "0")][-1] <= 0.5  # inside the bucket that holds 0.25-0.3 s steps
    last = gauge_lines(samples, "training_step_last_duration_seconds", None)[("mindx-7f3c2a", "0")]
    assert last[4] * 1.08 < last[-1]  # every rank waits for rank 5
    path = tmp_path / "samples.json"
    path.write_text(json.dumps(samples.to_json()))
    loaded = Samples.from_json(json.loads(path.read_text()))
    assert loaded.times == samples.times and loaded.series == samples.series
