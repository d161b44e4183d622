"""Render a PNG of the step-latency Grafana dashboard from a running agent's /metrics, for the README.

Run from the repository root (matplotlib needed: `.venv/bin/pip install -e '.[render]'`):

    .venv/bin/python -m bench.render_dashboard --url http://127.0.0.1:9410/metrics \\
        --seconds 120 --interval 2 --out dashboard.png [--save samples.json]
    .venv/bin/python -m bench.render_dashboard --load samples.json --out dashboard.png
    .venv/bin/python -m bench.render_dashboard --synthetic --out /tmp/dash.png

It fetches /metrics every `--interval` s for `--seconds` s, parses each page with
`prometheus_client.parser.text_string_to_metric_families` and keeps the `training_*` series in
memory (`--save` writes them to JSON, and `--load` renders from that JSON without fetching again).
It then draws the panels of helm/npu-node-agent/files/grafana-dashboard.json: the same titles, at
the same gridPos, in one dark figure of 1600x1000 px. The quantities are the ones the panels'
PromQL computes, worked out in Python from the samples:
* rate() and increase() are differences between samples over `--window` s (the panels'
  $__rate_interval), with counter resets handled. At the start they cover a shorter window, and
  nothing is drawn before half a window of samples exists.
* histogram_quantile() uses Prometheus' linear interpolation inside the bucket.
* The heat map shows, for each pair of samples in a row, the steps that completed in each
  step-time bucket in between.
* time() is the moment of the fetch.
One agent is one node, so the "stage median" is the median over the ranks of that node.

`--synthetic` needs no agent process: a seeded 16-rank job (2 pipeline stages, 4 steps/s, rank 5's
forward 15 % slower from halfway) is fed as TaskD-format lines to the agent's own StepMetrics and
collector on an injected clock, and the exposition text is sampled as a scrape would.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterable

from prometheus_client.parser import text_string_to_metric_families

from testkit import REPO

DASHBOARD = REPO / "helm" / "npu-node-agent" / "files" / "grafana-dashboard.json"
PREFIX = "training_"

STEP_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12.5, 15, 20, 25, 30, 45, 60, 90,
                120, 180, 300, 600)
PHASE_BUCKETS = {
    "forward": (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    "dataloader": (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    "save_checkpoint": (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600),
}
MISSING_MATPLOTLIB = ("render_dashboard: matplotlib is not installed; install it with "
                      ".venv/bin/pip install -e '.[render]' (or pip install matplotlib)")

Labels = tuple[tuple[str, str], ...]


# ---------------------------------------------------------------------------------------------
# Samples: the time series of a run, aligned on the fetch times.

class Samples:
    def __init__(self, source: str = ""):
        self.source = source
        self.times: list[float] = []
        self.series: dict[tuple[str, Labels], list[float | None]] = {}

    def add_exposition(self, t: float, text: str) -> None:
        values: dict[tuple[str, Labels], float] = {}
        # Only the training_* families: the parser is slow, and the agent's page has many more.
        keep = (PREFIX, f"# HELP {PREFIX}", f"# TYPE {PREFIX}")
        text = "".join(line for line in text.splitlines(keepends=True) if line.startswith(keep))
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.startswith(PREFIX) or sample.name.endswith("_created"):
                    continue
                values[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
        self.add(t, values)

    def add(self, t: float, values: dict[tuple[str, Labels], float]) -> None:
        n = len(self.times)
        self.times.append(t)
        for key, value in values.items():
            self.series.setdefault(key, [None] * n).append(value)
        for column in self.series.values():
            if len(column) == n:
                column.append(None)

    def select(self, name: str, job_id: str | None = None, **equal: str) -> list[tuple[dict, list[float | None]]]:
        out = []
        for (series_name, labels), values in self.series.items():
            if series_name != name:
                continue
            d = dict(labels)
            if job_id is not None and d.get("job_id", job_id) != job_id:
                continue
            if all(d.get(k) == v for k, v in equal.items()):
                out.append((d, values))
        return out

    def to_json(self) -> dict:
        return {"version": 1, "source": self.source, "times": self.times,
                "series": [{"name": name, "labels": dict(labels), "values": values}
                           for (name, labels), values in sorted(self.series.items())]}

    @classmethod
    def from_json(cls, document: dict) -> "Samples":
        if document.get("version") != 1:
            raise ValueError("not a samples file of bench.render_dashboard (version 1)")
        samples = cls(document.get("source", ""))
        samples.times = [float(t) for t in document["times"]]
        for entry in document["series"]:
            values = entry["values"]
            if len(values) != len(samples.times):
                raise ValueError(f"series {entry['name']} has {len(values)} values for {len(samples.times)} times")
            samples.series[(entry["name"], tuple(sorted(entry["labels"].items())))] = values
        return samples


def sample_url(url: str, seconds: float, interval: float, timeout: float = 5.0) -> Samples:
    samples = Samples(url)
    deadline = time.monotonic() + seconds
    next_at = time.monotonic()
    failures = 0
    while True:
        t = time.time()
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                samples.add_exposition(t, response.read().decode("utf-8"))
        except (OSError, ValueError) as exc:
            failures += 1
            print(f"render_dashboard: fetching {url} failed: {exc}", file=sys.stderr)
            if not samples.times and failures >= 3:
                raise SystemExit(f"render_dashboard: cannot fetch {url}: {exc}")
        next_at += interval
        if next_at > deadline:
            break
        time.sleep(max(0.0, next_at - time.monotonic()))
    return samples


# ---------------------------------------------------------------------------------------------
# PromQL semantics, in Python.

def window_start(times: list[float], i: int, window: float) -> int | None:
    """Index of the sample a window of `window` s ending at sample i starts from, or None.

    The newest sample at or before times[i] - window. At the start of a run, with less history
    than that, the oldest sample once it is at least half a window back (a shorter window, as
    rate() over the samples it has), None before (no value, rather than a noisy one)."""
    j = bisect.bisect_right(times, times[i] - window) - 1
    if j >= 0:
        return j
    return 0 if i > 0 and times[i] - times[0] >= window / 2 else None


def increase(values: list[float | None], j: int, i: int) -> float | None:
    """Counter increase from sample j to sample i, counting a drop as a reset (as increase() does,
    without its extrapolation)."""
    total, previous, seen = 0.0, None, False
    for k in range(j, i + 1):
        v = values[k]
        if v is None:
            continue
        if previous is not None:
            total += v - previous if v >= previous else v
            seen = True
        previous = v
    return total if seen else None


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over (le, cumulative count) pairs, +Inf included."""
    buckets = sorted(buckets)
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]):
        return math.nan
    counts, fixed = [], 0.0
    for _, count in buckets:
        fixed = max(fixed, count)  # cumulative counts never go down
        counts.append(fixed)
    total = counts[-1]
    if total <= 0:
        return math.nan
    rank = q * total
    b = next(k for k, c in enumerate(counts) if c >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    upper = buckets[b][0]
    if b == 0:
        lower, below = (0.0 if upper > 0 else upper), 0.0
    else:
        lower, below = buckets[b - 1][0], counts[b - 1]
    in_bucket = counts[b] - below
    if in_bucket <= 0:
        return upper
    return lower + (upper - lower) * (rank - below) / in_bucket


def group_sum(items: list[tuple[dict, list[float | None]]], by: tuple[str, ...]) -> dict[tuple, list[float | None]]:
    """sum by (...) of series aligned on the same times; None where no series has a value."""
    groups: dict[tuple, list[float | None]] = {}
    for labels, values in items:
        key = tuple(labels.get(k, "") for k in by)
        column = groups.setdefault(key, [None] * len(values))
        for k, v in enumerate(values):
            if v is not None:
                column[k] = v if column[k] is None else column[k] + v
    return groups


def rates(times: list[float], values: list[float | None], window: float) -> list[float]:
    out = []
    for i in range(len(times)):
        j = window_start(times, i, window)
        inc = None if j is None else increase(values, j, i)
        out.append(math.nan if inc is None or times[i] == times[j] else inc / (times[i] - times[j]))
    return out


def rank_order(key) -> tuple:
    return tuple(int(k) if str(k).isdigit() else math.inf for k in key) + tuple(str(k) for k in key)


def step_p50(samples: Samples, window: float, job_id: str | None) -> dict[tuple, list[float]]:
    """histogram_quantile(0.5, sum by (le, job_id, rank) (rate(..._bucket[window]))) per (job_id, rank)."""
    grouped = group_sum(samples.select("training_step_duration_seconds_bucket", job_id), ("job_id", "rank", "le"))
    per_rank: dict[tuple, dict[float, list[float | None]]] = {}
    for (job, rank, le), values in grouped.items():
        per_rank.setdefault((job, rank), {})[float(le)] = values
    out = {}
    for key, by_le in per_rank.items():
        line = []
        for i in range(len(samples.times)):
            j = window_start(samples.times, i, window)
            if j is None:
                line.append(math.nan)
                continue
            buckets = [(le, increase(v, j, i)) for le, v in by_le.items()]
            if any(c is None for _, c in buckets):
                line.append(math.nan)
                continue
            line.append(histogram_quantile(0.5, buckets))  # type: ignore[arg-type]
        out[key] = line
    return out


def step_heat(samples: Samples, job_id: str | None) -> tuple[list[float], list[list[float]]]:
    """Steps completed per bucket between samples i-1 and i: (upper bounds, rows[bucket][i-1])."""
    grouped = group_sum(samples.select("training_step_duration_seconds_bucket", job_id), ("le",))
    les = sorted(float(le) for (le,) in grouped)
    cumulative = {float(le): values for (le,), values in grouped.items()}
    n = len(samples.times)
    rows = [[0.0] * max(n - 1, 0) for _ in les]
    for i in range(1, n):
        below = 0.0
        for b, le in enumerate(les):
            c = increase(cumulative[le], i - 1, i) or 0.0
            rows[b][i - 1] = max(c - below, 0.0)
            below = max(below, c)
    return les, rows


def gauge_lines(samples: Samples, name: str, job_id: str | None, by: tuple[str, ...] = ("job_id", "rank"),
                **equal: str) -> dict[tuple, list[float]]:
    out: dict[tuple, list[float]] = {}
    for labels, values in samples.select(name, job_id, **equal):
        key = tuple(labels.get(k, "") for k in by)
        line = out.setdefault(key, [math.nan] * len(values))
        for k, v in enumerate(values):
            if v is not None:
                line[k] = v if math.isnan(line[k]) else max(line[k], v)
    return out


# ---------------------------------------------------------------------------------------------
# Synthetic samples: the agent's own pipeline fed with a seeded job, no files, no HTTP.

SYNTHETIC_JOB = "mindx-7f3c2a"


def synthetic_samples(seconds: float, interval: float, seed: int = 1) -> Samples:
    """What a scrape every `interval` s of the agent would show while a 16-rank job (2 pipeline
    stages, 4 steps/s) runs `seconds` s and rank 5's forward gets 15 % slower halfway: the job's
    TaskD-format lines go through the real StepMetrics (parser, pairing, detector) and the real
    collector, on an injected clock."""
    import tempfile

    from prometheus_client import generate_latest

    from agent.demo.job import DemoJob
    from agent.metrics import make_registry
    from agent.steps.metrics import StepCollector
    from agent.steps.records import RankKey
    from agent.steps.consumer import StepMetrics

    start = time.time() - seconds
    now = [start]
    job = DemoJob(Path("unused"), job_id=SYNTHETIC_JOB, ranks=16, stages=2, step_s=0.25,
                  slow_after_s=seconds / 2, started=start, seed=seed)
    samples = Samples("synthetic: 16 ranks, rank 5's forward +15 % from halfway")
    with tempfile.TemporaryDirectory() as state:
        steps = StepMetrics(Path(state) / "steps.json", clock=lambda: now[0])
        registry = make_registry(StepCollector("demo-node", steps, clock=lambda: now[0]))
        for rank in range(job.ranks):
            steps.on_group(RankKey(SYNTHETIC_JOB, rank), job.model.parallel_group(rank))
        for k in range(int(seconds / interval) + 1):
            now[0] = start + k * interval
            for rank, text in enumerate(job.lines_until(now[0])):
                if text:
                    steps.on_lines(RankKey(SYNTHETIC_JOB, rank), "0000000001", 0, text.encode())
            steps.on_batch_end()
            samples.add_exposition(now[0], generate_latest(registry).decode())
    return samples


# ---------------------------------------------------------------------------------------------
# Drawing (matplotlib is imported only here).

BG, PANEL, BORDER, TEXT, MUTED, GRID = "#111217", "#181b1f", "#2c3235", "#ccccdc", "#8e8e99", "#24272c"
PALETTE = ("#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1", "#BA43A9", "#705DA0",
           "#508642", "#CCA300", "#447EBC", "#C15C17", "#890F02", "#0A437C", "#6D1F62", "#584477")
GREEN, ORANGE, RED, BLUE = "#73BF69", "#FF9830", "#F2495C", "#5794F2"


def fmt_seconds(value: float, _pos=None) -> str:
    if value == 0:
        return "0"
    if abs(value) < 1:
        return f"{value * 1000:.0f} ms"
    if abs(value) < 10:
        return f"{value:.3g} s"
    if abs(value) < 120:
        return f"{value:.0f} s"
    return f"{value / 60:.3g} min"


def rank_color(key: tuple) -> str:
    rank = key[-1]
    return PALETTE[int(rank) % len(PALETTE)] if str(rank).isdigit() else PALETTE[hash(rank) % len(PALETTE)]


class Renderer:
    """Draws each dashboard panel, by title, from a Samples."""

    def __init__(self, samples: Samples, window: float, job_id: str | None):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.dates as mdates
        import matplotlib.pyplot as plt
        from matplotlib.colors import LinearSegmentedColormap
        from matplotlib.ticker import FuncFormatter, MaxNLocator
        from datetime import datetime

        self.plt, self.mdates, self.FuncFormatter, self.MaxNLocator = plt, mdates, FuncFormatter, MaxNLocator
        self.heat_cmap = LinearSegmentedColormap.from_list("grafana-oranges", ["#3d2a14", ORANGE, "#FFE0B2"])
        self.s, self.window, self.job_id = samples, window, job_id
        self.x = [mdates.date2num(datetime.fromtimestamp(t)) for t in samples.times]

    # -- helpers ----------------------------------------------------------------------------
    def _time_axis(self, ax) -> None:
        if self.x:
            ax.set_xlim(self.x[0], self.x[-1])
        ax.xaxis.set_major_locator(self.mdates.AutoDateLocator(minticks=3, maxticks=6))
        ax.xaxis.set_major_formatter(self.mdates.DateFormatter("%H:%M:%S"))

    def _lines(self, ax, lines: dict[tuple, list[float]], *, unit_seconds: bool = True, width: float = 1.2,
               style: str = "-", alpha: float = 1.0, label_outlier: bool = True) -> None:
        for key in sorted(lines, key=rank_order):
            ax.plot(self.x, lines[key], style, color=rank_color(key), lw=width, alpha=alpha)
        if unit_seconds:
            ax.yaxis.set_major_formatter(self.FuncFormatter(fmt_seconds))
        if label_outlier and len(lines) >= 3:
            self._label_outlier(ax, lines)
        self._time_axis(ax)

    def _label_outlier(self, ax, lines: dict[tuple, list[float]]) -> None:
        """Name the line that ends farthest from the others (Grafana's legend, for a picture)."""
        last = {k: next((v for v in reversed(vals) if not math.isnan(v)), math.nan) for k, vals in lines.items()}
        last = {k: v for k, v in last.items() if not math.isnan(v)}
        if len(last) < 3:
            return
        med = statistics.median(last.values())
        key = max(last, key=lambda k: abs(last[k] - med))
        if med and abs(last[key] - med) / abs(med) >= 0.03:
            ax.annotate(f"r{key[-1]}", (self.x[-1], last[key]), xytext=(3, 0), textcoords="offset points",
                        color=rank_color(key), fontsize=8, fontweight="bold", va="center", ha="left",
                        annotation_clip=False)

    def _thresholds(self, ax, steps: list[tuple[float, str]]) -> None:
        """Grafana's "line+area" threshold style: a dashed line at each step, the band above it tinted."""
        top = ax.get_ylim()[1]
        for k, (value, color) in enumerate(steps):
            upper = steps[k + 1][0] if k + 1 < len(steps) else max(top, value) * 10
            ax.axhline(value, color=color, lw=1, ls=(0, (6, 4)), alpha=0.9)
            ax.axhspan(value, upper, color=color, alpha=0.07, lw=0)

    def _empty(self, ax, text: str, keep_time: bool = False) -> None:
        """Grafana's "No data": the message, no value axis (and no time axis unless asked)."""
        ax.set_yticks([])
        if keep_time:
            self._time_axis(ax)
        else:
            ax.set_xticks([])
        ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color=MUTED, fontsize=10)

    def _too_short(self, ax, lines: Iterable[list[float]]) -> bool:
        if any(not math.isnan(v) for line in lines for v in line):
            return False
        self._empty(ax, f"fewer samples than half a {self.window:g} s rate window", keep_time=True)
        return True

    def _legend(self, ax, handles: list, labels: list[str]) -> None:
        if handles:
            ax.legend(handles, labels, loc="upper left", fontsize=7, frameon=False, labelcolor=TEXT,
                      ncol=min(len(labels), 3), handlelength=1.8)

    def _ylim_from(self, ax, lines: Iterable[list[float]], floor: float = 0.0, pad: float = 0.15,
                   at_least: float | None = None, bottom: float | None = None) -> None:
        values = [v for line in lines for v in line if not math.isnan(v)]
        if not values:
            return
        lo, hi = min(values), max(values)
        span = max(hi - lo, abs(hi) * 0.02, 1e-9)
        low = bottom if bottom is not None else max(floor, lo - pad * span)
        high = hi + pad * span
        if at_least is not None:
            high = max(high, at_least)
        ax.set_ylim(low, high)

    # -- panels -----------------------------------------------------------------------------
    def step_time(self, ax) -> None:
        p50 = step_p50(self.s, self.window, self.job_id)
        last = gauge_lines(self.s, "training_step_last_duration_seconds", self.job_id)
        if not p50 and not last:
            return self._empty(ax, "no training_step_duration_seconds")
        self._lines(ax, last, width=0.8, style="--", alpha=0.55, label_outlier=False)
        self._lines(ax, p50, width=1.6)
        self._ylim_from(ax, list(p50.values()) + list(last.values()))
        from matplotlib.lines import Line2D
        self._legend(ax, [Line2D([], [], color=TEXT, lw=1.6), Line2D([], [], color=TEXT, lw=0.8, ls="--")],
                     [f"p50 per rank ({self.window:g} s window)", "last step"])

    def heat_map(self, ax) -> None:
        les, rows = step_heat(self.s, self.job_id)
        if not les or len(self.x) < 2:
            return self._empty(ax, "no training_step_duration_seconds")
        used = [b for b, row in enumerate(rows) if any(row)]
        if not used:
            return self._empty(ax, "no steps completed")
        lo, hi = max(used[0] - 1, 0), min(used[-1] + 1, len(les) - 1)
        import numpy as np
        grid = np.ma.masked_equal(np.array(rows[lo:hi + 1]), 0.0)
        mesh = ax.pcolormesh(self.x, np.arange(lo, hi + 2), grid, cmap=self.heat_cmap, shading="flat",
                             edgecolors=PANEL, linewidth=0.3)
        ax.set_yticks([b + 0.5 for b in range(lo, hi + 1)])
        ax.set_yticklabels([("+Inf" if math.isinf(les[b]) else fmt_seconds(les[b])) for b in range(lo, hi + 1)])
        ax.set_ylim(lo, hi + 1)
        ax.tick_params(axis="y", labelsize=6)
        ax.set_ylabel("bucket upper bound (le)", color=MUTED, fontsize=7)
        self._time_axis(ax)
        bar = ax.figure.colorbar(mesh, ax=ax, pad=0.01, fraction=0.04, aspect=25)
        bar.ax.tick_params(colors=TEXT, labelsize=6)
        bar.outline.set_edgecolor(BORDER)
        bar.set_label("steps", color=MUTED, fontsize=7)

    def slowdown(self, ax) -> None:
        lines = gauge_lines(self.s, "training_rank_slowdown_ratio", self.job_id)
        if not lines:
            return self._empty(ax, "no baseline yet")
        self._lines(ax, lines, unit_seconds=False)
        ax.yaxis.set_major_formatter(self.FuncFormatter(lambda v, _p: f"{v:.2f}"))
        self._ylim_from(ax, lines.values(), at_least=1.13)
        self._thresholds(ax, [(1.05, ORANGE), (1.10, RED)])

    def compute(self, ax) -> None:
        lines = gauge_lines(self.s, "training_rank_compute_seconds", self.job_id)
        if not lines:
            return self._empty(ax, "no training_rank_compute_seconds")
        self._lines(ax, lines)
        stage_of = {(l.get("job_id", ""), l.get("rank", "")): (l.get("job_id", ""), l.get("pp_stage", ""))
                    for l, _ in self.s.select("training_rank_compute_seconds", self.job_id)}
        stages: dict[tuple, list[list[float]]] = {}
        for key, line in lines.items():
            stages.setdefault(stage_of[key], []).append(line)
        for (job, stage), members in sorted(stages.items()):
            median = [statistics.median(v) if v else math.nan
                      for v in ([m[i] for m in members if not math.isnan(m[i])] for i in range(len(self.x)))]
            ax.plot(self.x, median, color="#FFFFFF", lw=2.2, ls=(0, (5, 4)), alpha=0.9)
            last = next((v for v in reversed(median) if not math.isnan(v)), None)
            if last is not None:
                ax.annotate(f"stage {stage or '?'} median", (self.x[0], last), xytext=(3, 4),
                            textcoords="offset points", color="#FFFFFF", fontsize=7)
        self._ylim_from(ax, lines.values())

    def steps_per_second(self, ax) -> None:
        counters = group_sum(self.s.select("training_steps_completed_total", self.job_id), ("job_id", "rank"))
        if not counters:
            return self._empty(ax, "no training_steps_completed_total")
        lines = {key: rates(self.s.times, values, self.window) for key, values in counters.items()}
        if self._too_short(ax, lines.values()):
            return
        self._lines(ax, lines, unit_seconds=False)
        ax.yaxis.set_major_formatter(self.FuncFormatter(lambda v, _p: f"{v:.2f}"))
        self._ylim_from(ax, lines.values(), bottom=0.0)

    def _timeline(self, ax, rows: list[tuple[str, list[float | None]]], ok_color: str | None) -> None:
        if not rows:
            return
        for y, (_, values) in enumerate(rows):
            ax.axhspan(y + 0.08, y + 0.92, color=GRID, lw=0)
            spans: list[tuple[float, float, str]] = []
            for i in range(len(values) - 1):
                v = values[i]
                color = RED if v == 1 else (ok_color if v == 0 else None)
                if color is None:
                    continue
                if spans and spans[-1][2] == color and math.isclose(spans[-1][0] + spans[-1][1], self.x[i]):
                    spans[-1] = (spans[-1][0], self.x[i + 1] - spans[-1][0], color)
                else:
                    spans.append((self.x[i], self.x[i + 1] - self.x[i], color))
            for start, width, color in spans:
                ax.broken_barh([(start, width)], (y + 0.1, 0.8), color=color, alpha=0.85, lw=0)
        ax.set_ylim(len(rows), 0)
        ax.set_yticks([y + 0.5 for y in range(len(rows))])
        ax.set_yticklabels([name for name, _ in rows])
        ax.tick_params(axis="y", labelsize=7 if len(rows) <= 12 else 5.5, length=0)
        ax.grid(False)
        self._time_axis(ax)

    def slow_ranks(self, ax) -> None:
        rows = []
        for labels, values in self.s.select("training_rank_slow", self.job_id):
            if any(v == 1 for v in values):
                rows.append(((labels.get("rank", ""), labels.get("reason", "")), values))
        rows.sort(key=lambda r: rank_order(r[0]))
        if not rows:
            return self._empty(ax, "no slow ranks", keep_time=True)
        self._timeline(ax, [(f"r{rank} {reason}", [1 if v == 1 else None for v in values])
                            for (rank, reason), values in rows], ok_color=None)

    def slow_nodes(self, ax) -> None:
        lines = gauge_lines(self.s, "training_node_slow", self.job_id, by=("node", "reason"))
        if not lines:
            return self._empty(ax, "no training_node_slow")
        rows = [(f"{node} {reason}", [None if math.isnan(v) else v for v in values])
                for (node, reason), values in sorted(lines.items())]
        self._timeline(ax, rows, ok_color=GREEN)

    def slow_now(self, ax) -> None:
        ax.axis("off")
        if not self.s.times:
            return
        current = []
        for labels, values in self.s.select("training_rank_slow", self.job_id):
            if values[-1] == 1:
                current.append(labels)
        columns = ["node", "job_name", "rank", "pp_stage", "reason"]
        widths = [0.24, 0.30, 0.12, 0.16, 0.18]
        xs = [sum(widths[:k]) for k in range(len(columns))]
        row_h = 0.085
        for x, name in zip(xs, columns):
            ax.text(x + 0.01, 1 - row_h / 2, name, color=BLUE, fontsize=7.5, fontweight="bold", va="center",
                    transform=ax.transAxes)
        ax.plot([0, 1], [1 - row_h, 1 - row_h], color=BORDER, lw=1, transform=ax.transAxes)
        if not current:
            return self._empty(ax, "no rank is slow now")
        current.sort(key=lambda l: (rank_order((l.get("rank", ""),)), l.get("reason", "")))
        fits = int((1 - row_h) / row_h) - 1
        shown = current if len(current) <= fits + 1 else current[:fits]
        for k, labels in enumerate(shown):
            y = 1 - row_h * (k + 1.5)
            for x, name in zip(xs, columns):
                ax.text(x + 0.01, y, labels.get(name, ""), color=TEXT, fontsize=7, va="center", transform=ax.transAxes)
            ax.plot([0, 1], [y - row_h / 2] * 2, color=GRID, lw=0.6, transform=ax.transAxes)
        if len(shown) < len(current):
            ax.text(0.01, 1 - row_h * (len(shown) + 1.5), f"... {len(current) - len(shown)} more", color=MUTED,
                    fontsize=7, va="center", transform=ax.transAxes)

    def since_last_step(self, ax) -> None:
        lines = {}
        for key, values in gauge_lines(self.s, "training_step_last_completed_timestamp_seconds", self.job_id).items():
            lines[key] = [t - v for t, v in zip(self.s.times, values)]
        if not lines:
            return self._empty(ax, "no training_step_last_completed_timestamp_seconds")
        self._lines(ax, lines, label_outlier=False)  # a sawtooth: which rank ends lowest means nothing
        self._ylim_from(ax, lines.values(), bottom=0.0)
        if ax.get_ylim()[1] >= 60 / 1.3:
            self._thresholds(ax, [(60.0, RED)])

    def lag(self, ax) -> None:
        lines = gauge_lines(self.s, "training_profiling_lag_seconds", self.job_id, by=("node", "rank"))
        if not lines:
            return self._empty(ax, "no training_profiling_lag_seconds")
        self._lines(ax, lines, width=0.9, label_outlier=False)
        self._ylim_from(ax, lines.values(), bottom=0.0, at_least=8.0)
        steps = [(7.0, ORANGE)] + ([(30.0, RED)] if ax.get_ylim()[1] >= 30 else [])
        self._thresholds(ax, steps)

    def parse_errors(self, ax) -> None:
        errors = group_sum(self.s.select("training_profiling_parse_errors_total"), ("node", "reason"))
        records = group_sum(self.s.select("training_profiling_records_total", self.job_id), ("node",))
        if not errors and not records:
            return self._empty(ax, "no profiling counters")
        if self._too_short(ax, [rates(self.s.times, v, self.window) for v in list(errors.values()) + list(records.values())]):
            return
        handles, labels = [], []
        width = (self.x[1] - self.x[0]) * 0.8 if len(self.x) > 1 else 0.0001
        for (node, reason), values in sorted(errors.items()):
            r = rates(self.s.times, values, self.window)
            handles.append(ax.bar(self.x, [0 if math.isnan(v) else v for v in r], width=width, color=RED, alpha=0.8))
            labels.append(f"{node} errors {reason}")
        ax.set_ylabel("errors/s", color=MUTED, fontsize=7)
        ax.yaxis.set_major_formatter(self.FuncFormatter(lambda v, _p: f"{v:.3g}"))
        ax.set_ylim(0, max(ax.get_ylim()[1] * 1.35, 0.05))  # room for the legend above the bars
        right = ax.twinx()
        self._style_axes(right)
        right.patch.set_visible(False)  # or it hides the bars of the left axis
        for (node,), values in sorted(records.items()):
            (line,) = right.plot(self.x, rates(self.s.times, values, self.window), color=BLUE, lw=1.4)
            handles.append(line)
            labels.append(f"{node} records")
        right.set_ylabel("records/s", color=MUTED, fontsize=7)
        right.yaxis.set_major_formatter(self.FuncFormatter(lambda v, _p: f"{v:.0f}"))
        right.set_ylim(0, right.get_ylim()[1] * 1.4)  # room for the legend above the line
        right.grid(False)
        self._time_axis(ax)
        self._legend(ax, handles, labels)

    # -- figure -----------------------------------------------------------------------------
    def _style_axes(self, ax) -> None:
        ax.set_facecolor(PANEL)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.tick_params(colors=TEXT, labelsize=7, length=2)
        ax.grid(True, color=GRID, lw=0.8)
        ax.set_axisbelow(True)
        ax.yaxis.set_major_locator(self.MaxNLocator(nbins=5))

    def draw(self, dashboard: dict, out: str, drawers: dict[str, str]) -> None:
        from matplotlib.patches import FancyBboxPatch

        plt = self.plt
        width_px, height_px, dpi = 1600, 1000, 100
        fig = plt.figure(figsize=(width_px / dpi, height_px / dpi), dpi=dpi, facecolor=BG)
        panels = dashboard["panels"]
        rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
        header, margin, gap = 46 / height_px, 8 / width_px, 8
        px = 1 / width_px
        py = 1 / height_px
        names = sorted({dict(labels).get("node", "") for (_, labels) in self.s.series} - {""})
        jobs = sorted({dict(labels).get("job_name", "") for (_, labels) in self.s.series} - {""})
        span = ""
        if self.s.times:
            from datetime import datetime
            span = (f"{datetime.fromtimestamp(self.s.times[0]):%Y-%m-%d %H:%M:%S} - "
                    f"{datetime.fromtimestamp(self.s.times[-1]):%H:%M:%S}, {len(self.s.times)} samples")
        fig.text(margin, 1 - 18 * py, dashboard.get("title", ""), color="#FFFFFF", fontsize=14, fontweight="bold",
                 va="center")
        variables = f"node: {', '.join(names) or '-'}    job_name: {', '.join(jobs) or '-'}"
        if self.job_id:
            variables += f"    job_id: {self.job_id}"
        fig.text(margin, 1 - 38 * py, variables, color=MUTED, fontsize=8.5, va="center")
        fig.text(1 - margin, 1 - 18 * py, span, color=MUTED, fontsize=8.5, va="center", ha="right")
        fig.text(1 - margin, 1 - 38 * py, f"rate window {self.window:g} s    {self.s.source}", color=MUTED,
                 fontsize=8.5, va="center", ha="right")
        usable_w, usable_h = 1 - 2 * margin, 1 - header - margin
        for panel in panels:
            g = panel["gridPos"]
            x0 = margin + usable_w * g["x"] / 24 + gap / 2 * px
            w = usable_w * g["w"] / 24 - gap * px
            top = 1 - header - usable_h * g["y"] / rows - gap / 2 * py
            h = usable_h * g["h"] / rows - gap * py
            fig.patches.append(FancyBboxPatch((x0, top - h), w, h, boxstyle="round,pad=0,rounding_size=0.003",
                                              transform=fig.transFigure, facecolor=PANEL, edgecolor=BORDER, lw=1,
                                              zorder=-1))
            fig.text(x0 + 8 * px, top - 13 * py, panel["title"], color=TEXT, fontsize=9.5, fontweight="bold",
                     va="center")
            left_pad = 8 if panel["type"] == "table" else (96 if panel["type"] == "state-timeline" else 52)
            right_pad = 58 if panel["title"] in (PANEL_HEAT, PANEL_PARSE) else 26
            ax = fig.add_axes((x0 + left_pad * px, top - h + 24 * py, w - (left_pad + right_pad) * px,
                               h - 52 * py))
            self._style_axes(ax)
            getattr(self, drawers[panel["title"]])(ax)
        fig.savefig(out, dpi=dpi, facecolor=BG)
        plt.close(fig)


PANEL_HEAT = "Step time heat map"
PANEL_PARSE = "Profiling records and parse errors"
# Dashboard panel title -> Renderer method. Every panel of the dashboard must have one (tested).
DRAWERS: dict[str, str] = {
    "Step time per rank (p50, last)": "step_time",
    PANEL_HEAT: "heat_map",
    "Slowdown ratio per rank": "slowdown",
    "Compute time per rank vs stage median": "compute",
    "Steps/s per rank": "steps_per_second",
    "Slow ranks": "slow_ranks",
    "Slow nodes": "slow_nodes",
    "Slow ranks now": "slow_now",
    "Time since last step (hung ranks)": "since_last_step",
    "Profiling lag": "lag",
    PANEL_PARSE: "parse_errors",
}


def load_dashboard(path: Path = DASHBOARD) -> dict:
    dashboard = json.loads(Path(path).read_text())
    missing = [p["title"] for p in dashboard["panels"] if p["title"] not in DRAWERS]
    if missing:
        raise SystemExit(f"render_dashboard: no drawing for the dashboard panels {missing}")
    return dashboard


def render(samples: Samples, out: str, window: float, job_id: str | None = None, dashboard_path: Path = DASHBOARD) -> None:
    dashboard = load_dashboard(dashboard_path)
    Renderer(samples, window, job_id).draw(dashboard, out, DRAWERS)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.render_dashboard",
        description="Render a PNG of the step-latency dashboard from a running agent's /metrics (or from saved "
                    "or synthetic samples).")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--url", default="http://127.0.0.1:9410/metrics", help="the agent's /metrics (default %(default)s)")
    source.add_argument("--load", metavar="JSON", help="render saved samples instead of fetching")
    source.add_argument("--synthetic", action="store_true",
                        help="generate the samples from a model of 16 ranks (rank 5 15%% slower from halfway)")
    parser.add_argument("--seconds", type=float, default=120.0, help="how long to sample (default %(default)s)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between fetches (default %(default)s)")
    parser.add_argument("--window", type=float, default=30.0,
                        help="rate()/quantile window in seconds, the panels' $__rate_interval (default %(default)s)")
    parser.add_argument("--job-id", help="only this job_id (default: every job the agent exports)")
    parser.add_argument("--save", metavar="JSON", help="also write the samples to this file")
    parser.add_argument("--out", metavar="PNG", help="the picture to write")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD, help="dashboard JSON (default: the chart's)")
    parser.add_argument("--seed", type=int, default=1, help="--synthetic: random seed")
    args = parser.parse_args(argv)
    if not args.out and not args.save:
        parser.error("nothing to do: give --out (and/or --save)")
    if args.interval <= 0 or args.seconds <= 0 or args.window <= 0:
        parser.error("--seconds, --interval and --window must be positive")
    if args.load and args.save:
        parser.error("--save with --load would only copy the file")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(MISSING_MATPLOTLIB, file=sys.stderr)
            return 2
        load_dashboard(args.dashboard)  # fail before sampling, not after
    if args.load:
        samples = Samples.from_json(json.loads(Path(args.load).read_text()))
    elif args.synthetic:
        samples = synthetic_samples(args.seconds, args.interval, args.seed)
    else:
        print(f"render_dashboard: sampling {args.url} every {args.interval:g} s for {args.seconds:g} s", file=sys.stderr)
        samples = sample_url(args.url, args.seconds, args.interval)
    if not samples.times:
        print("render_dashboard: no samples", file=sys.stderr)
        return 1
    if not samples.series:
        print(f"render_dashboard: no {PREFIX}* series in {samples.source}", file=sys.stderr)
    if args.save:
        Path(args.save).write_text(json.dumps(samples.to_json()))
        print(f"render_dashboard: {len(samples.times)} samples of {len(samples.series)} series -> {args.save}",
              file=sys.stderr)
    if args.out:
        render(samples, args.out, args.window, args.job_id, args.dashboard)
        print(f"render_dashboard: wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
