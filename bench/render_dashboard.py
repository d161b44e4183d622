"""Draw a Grafana dashboard of the chart to PNG from a real Prometheus, for docs/steps.md.

Run from the repository root (matplotlib needed: `.venv/bin/pip install -e '.[render]'`):

    .venv/bin/python -m bench.render_dashboard --prometheus http://127.0.0.1:9090 \\
        --dashboard helm/npu-node-agent/files/grafana-node-dashboard.json --minutes 10 --out node.png

Every target of every panel is sent to Prometheus's /api/v1/query_range as Grafana would send it
(the dashboard's variables set to "All", `$__rate_interval` to `--rate-interval`), and the result is
drawn by panel type, at the panel's gridPos, under its title: time series as lines (dashed, wider or
of a fixed colour where the panel's overrides say so; `percentunit` as percent; with more series than fit
in the legend, the styled ones and the highest peaks are named), state
timelines as coloured bands with the panel's value mappings, the heat map as per-bucket counts
(Grafana's "heatmap" format: cumulative `le` buckets made into per-bucket counts), tables as the
series' labels at the last point, arranged as the panel's "organize" transformation says.
`bench.demo_prometheus` runs the demo and a Prometheus and calls this for both dashboards.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path

from testkit import REPO

FILES = REPO / "helm" / "npu-node-agent" / "files"
DASHBOARDS = {"training": FILES / "grafana-dashboard.json", "node": FILES / "grafana-node-dashboard.json"}
MISSING_MATPLOTLIB = ("render_dashboard: matplotlib is not installed; install it with "
                      ".venv/bin/pip install -e '.[render]' (or pip install matplotlib)")
DRAWN_TYPES = {"timeseries", "state-timeline", "heatmap", "table"}
HEADING = "row"  # a row only titles the panels below it: drawn as a heading, nothing queried

# Series: one result of query_range, {"metric": {label: value}, "values": [[t, "v"], ...]}.
Series = dict


# ---------------------------------------------------------------------------------------------
# From the dashboard to PromQL, and from results to what a panel shows (no matplotlib).

def promql(expr: str, rate_interval: str) -> str:
    """The query Grafana sends with every variable at "All" (allValue .*)."""
    expr = re.sub(r"\$(?:__rate_interval|__interval|__range)\b", rate_interval, expr)
    return re.sub(r"\$(?:\{[A-Za-z_]\w*(?::[a-z]+)?\}|[A-Za-z_]\w*)", ".*", expr)


def targets(dashboard: dict) -> list[tuple[dict, dict]]:
    """(panel, target) for every query of the dashboard, in panel order."""
    return [(panel, target) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def legend(target: dict, labels: dict[str, str]) -> str:
    fmt = target.get("legendFormat")
    if not fmt or fmt == "__auto":
        shown = {k: v for k, v in labels.items() if k not in ("__name__", "job", "instance")}
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(shown.items())) + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def natural(text: str) -> tuple:
    """Sort key that puts NPU2 before NPU10 and r5 before r12."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def table_rows(panel: dict, series: list[Series]) -> tuple[list[str], list[list[str]]]:
    """Columns and rows of a table panel: each series' labels, organised as the panel's transformation says."""
    organize = next((t["options"] for t in panel.get("transformations", []) if t["id"] == "organize"), {})
    hidden = {k for k, v in organize.get("excludeByName", {}).items() if v}
    order = organize.get("indexByName", {})
    rename = organize.get("renameByName", {})
    names = sorted({k for s in series for k in s["metric"]} - hidden, key=lambda k: (order.get(k, len(order)), k))
    rows = sorted(([s["metric"].get(k, "") for k in names] for s in series), key=lambda row: [natural(c) for c in row])
    return [rename.get(k) or k for k in names], rows


def heat_counts(series: list[Series]) -> tuple[list[float], list[float], list[list[float]]]:
    """Upper bounds, times and counts[bucket][time] from cumulative `le` series (Grafana's heatmap format)."""
    by_le = sorted(((float(s["metric"]["le"]), dict(s["values"])) for s in series), key=lambda item: item[0])
    times = sorted({t for _, values in by_le for t in values})
    bounds = [le for le, _ in by_le]
    counts, below = [], [0.0] * len(times)
    for _, values in by_le:
        cumulative = [float(values.get(t, "nan")) for t in times]
        counts.append([max(0.0, c - b) if not math.isnan(c) else 0.0 for c, b in zip(cumulative, below)])
        below = [b if math.isnan(c) else c for c, b in zip(cumulative, below)]
    return bounds, times, counts


def overrides(panel: dict, name: str) -> dict:
    """The properties of the panel's byName and byRegexp overrides that match a series' display name (later win)."""
    found = {}
    for override in panel.get("fieldConfig", {}).get("overrides", []):
        matcher, pattern = override.get("matcher", {}).get("id"), override.get("matcher", {}).get("options", "")
        if matcher == "byRegexp":
            # Grafana's "/re/" is a regex searched in the name; a bare pattern must match it whole.
            wrapped = re.fullmatch(r"/(.*)/", pattern, re.S)
            hit = re.search(wrapped.group(1), name) if wrapped else re.fullmatch(pattern, name)
        else:
            hit = matcher == "byName" and pattern == name
        if hit:
            found.update({p["id"]: p.get("value") for p in override.get("properties", [])})
    return found


def labelled(panel: dict, lines: list[tuple[str, list[float], list[float]]]) -> set[int]:
    """Which lines get a legend entry when not all fit: those the panel styles (reference lines), then the
    highest peaks, which are what a reader looks for (a slow worker, a late rank)."""
    if len(lines) <= MAX_LEGEND:
        return set(range(len(lines)))

    def peak(values):
        return max((v for v in values if not math.isnan(v)), default=-math.inf)
    order = sorted(range(len(lines)), key=lambda i: (not overrides(panel, lines[i][0]), -peak(lines[i][2]), i))
    return set(order[:MAX_LEGEND])


def mappings(panel: dict) -> dict[str, tuple[str, str]]:
    """Value -> (text, colour) of the panel's value mappings."""
    out = {}
    for mapping in panel.get("fieldConfig", {}).get("defaults", {}).get("mappings", []):
        if mapping.get("type") == "value":
            for value, shown in mapping["options"].items():
                out[value] = (shown.get("text", value), shown.get("color", ""))
    return out


# ---------------------------------------------------------------------------------------------
# Prometheus.

def get_json(url: str, timeout: float = 30.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def query_range(base: str, expr: str, start: float, end: float, step: float) -> list[Series]:
    query = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    answer = get_json(f"{base}/api/v1/query_range?{query}")
    if answer.get("status") != "success":
        raise RuntimeError(f"{expr}: {answer}")
    return answer["data"]["result"]


def fetch(base: str, dashboard: dict, start: float, end: float, step: float,
          rate_interval: str) -> dict[tuple[int, str], list[Series]]:
    """(panel id, refId) -> query_range result of that target."""
    return {(panel["id"], target["refId"]): query_range(base, promql(target["expr"], rate_interval), start, end, step)
            for panel, target in targets(dashboard)}


# ---------------------------------------------------------------------------------------------
# Drawing (matplotlib is imported only here).

BG, PANEL, BORDER, TEXT, MUTED, GRID = "#111217", "#181b1f", "#2c3235", "#ccccdc", "#8e8e99", "#24272c"
PALETTE = ("#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1", "#BA43A9", "#705DA0",
           "#508642", "#CCA300", "#447EBC", "#C15C17", "#890F02", "#0A437C", "#6D1F62", "#584477")
# Grafana's named colours as it draws them on a dark theme.
NAMED = {"green": "#73BF69", "red": "#F2495C", "orange": "#FF9830", "yellow": "#FADE2A", "blue": "#5794F2",
         "purple": "#B877D9", "dark-red": "#C4162A", "dark-green": "#37872D", "dark-orange": "#FA6400",
         "dark-yellow": "#E0B400", "dark-purple": "#8F3BB8", "transparent": PANEL, "": MUTED}
MAX_LEGEND = 8


def colour(name: str) -> str:
    from matplotlib.colors import is_color_like
    name = NAMED.get(name, name)
    return name if is_color_like(name) else MUTED


class Renderer:
    def __init__(self, dashboard: dict, results: dict[tuple[int, str], list[Series]], start: float, end: float,
                 note: str = ""):
        try:
            import matplotlib
        except ImportError:
            raise SystemExit(MISSING_MATPLOTLIB) from None
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        self.plt, self.MaxNLocator = plt, MaxNLocator
        self.dashboard, self.results, self.start, self.end, self.note = dashboard, results, start, end, note

    def lines(self, panel: dict) -> list[tuple[str, list[float], list[float]]]:
        """(legend, seconds since start, values) of every series of the panel's targets."""
        out = []
        for target in panel["targets"]:
            for s in self.results.get((panel["id"], target["refId"]), []):
                ts, values = [], []
                for t, v in s["values"]:
                    t = float(t) - self.start
                    if ts and t - ts[-1] > 1.5 * self.step:  # no sample in between: a gap, as Grafana leaves it
                        ts.append(ts[-1] + self.step)
                        values.append(math.nan)
                    ts.append(t)
                    values.append(float(v))
                out.append((legend(target, s["metric"]), ts, values))
        return sorted(out, key=lambda line: natural(line[0]))

    def timeseries(self, ax, panel: dict) -> None:
        lines = self.lines(panel)
        if not lines:
            return  # "No data", as Grafana shows it: no threshold lines either
        named = labelled(panel, lines)
        for i, (name, ts, values) in enumerate(lines):
            style = overrides(panel, name)  # the dashed reference lines and the like
            fixed = style.get("color") or {}
            dashed = (style.get("custom.lineStyle") or {}).get("fill") == "dash"
            ax.plot(ts, values, lw=1.2 * style.get("custom.lineWidth", 1), ls="--" if dashed else "-",
                    color=colour(fixed["fixedColor"]) if fixed.get("mode") == "fixed" else PALETTE[i % len(PALETTE)],
                    label=name if i in named else None)
        thresholds = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
        for step in thresholds:
            if step.get("value") is not None and colour(step["color"]) != PANEL:
                ax.axhline(step["value"], color=colour(step["color"]), lw=0.8, ls="--")
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        if unit in ("s", "ms"):
            ax.set_ylabel("seconds", color=MUTED, fontsize=7)
        elif unit == "percentunit":
            from matplotlib.ticker import PercentFormatter
            ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=None))
        more = f" (+{len(lines) - MAX_LEGEND})" if len(lines) > MAX_LEGEND else ""
        shown = ax.legend(loc="upper left", fontsize=6, ncol=min(3, len(lines)), frameon=False, labelcolor=TEXT,
                          title=f"{len(lines)} series{more}" if more else None, title_fontsize=6)
        shown.get_title().set_color(MUTED)

    def state_timeline(self, ax, panel: dict) -> None:
        shown = mappings(panel)
        lines = self.lines(panel)
        seen: dict[str, str] = {}
        for row, (name, ts, values) in enumerate(lines):
            for i, (t, v) in enumerate(zip(ts, values)):
                if math.isnan(v):
                    continue
                width = (ts[i + 1] - t) if i + 1 < len(ts) else self.step
                text, col = shown.get(f"{v:g}", (f"{v:g}", PALETTE[int(v) % len(PALETTE)]))
                ax.barh(row, width, left=t, height=0.8, color=colour(col), lw=0)
                seen[text] = colour(col)
        ax.set_yticks(range(len(lines)), [name for name, _, _ in lines], fontsize=6.5)
        ax.set_ylim(len(lines) - 0.5, -0.5)
        ax.grid(False)
        from matplotlib.patches import Patch
        handles = [Patch(color=c, label=t) for t, c in seen.items()]
        ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=6, ncol=min(5, len(handles)) or 1,
                  frameon=False, labelcolor=TEXT)

    def heatmap(self, ax, panel: dict) -> None:
        series = [s for target in panel["targets"] for s in self.results.get((panel["id"], target["refId"]), [])]
        if not series:
            return
        bounds, times, counts = heat_counts(series)
        rows = [i for i, row in enumerate(counts) if any(row)] or [0]
        lo, hi = max(0, rows[0] - 1), min(len(counts) - 1, rows[-1] + 1)  # and a bucket either side
        shown = counts[lo:hi + 1]
        ts = [t - self.start for t in times]
        ax.imshow(shown, aspect="auto", origin="lower", cmap="inferno", interpolation="nearest",
                  extent=(ts[0], ts[-1] + self.step, -0.5, len(shown) - 0.5))
        ax.set_yticks(range(len(shown)), [f"≤{b:g}" for b in bounds[lo:hi + 1]], fontsize=6.5)
        ax.grid(False)

    def table(self, ax, panel: dict) -> None:
        last = []
        for target in panel["targets"]:
            for s in self.results.get((panel["id"], target["refId"]), []):
                if s["values"] and float(s["values"][-1][0]) >= self.end - self.step / 2:
                    last.append(s)  # a table is an instant query: what holds at the end of the range
        columns, rows = table_rows(panel, last)
        ax.axis("off")
        if not columns:
            ax.text(0.5, 0.5, "No data", color=MUTED, ha="center", va="center", transform=ax.transAxes)
            return
        cut = 12
        cells = rows[:cut] + ([[f"... {len(rows) - cut} more"] + [""] * (len(columns) - 1)] if len(rows) > cut else [])
        table = ax.table(cellText=cells or [[""] * len(columns)], colLabels=columns, loc="upper left",
                         cellLoc="left", colLoc="left")
        table.auto_set_font_size(False)
        table.set_fontsize(6.5)
        for (r, _), cell in table.get_celld().items():
            cell.set_facecolor(PANEL)
            cell.set_edgecolor(GRID)
            cell.get_text().set_color("#5794F2" if r == 0 else TEXT)

    def draw(self, out: Path, step: float) -> None:
        from matplotlib.patches import FancyBboxPatch

        self.step = step
        plt = self.plt
        panels = self.dashboard["panels"]
        rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
        width_px, height_px, dpi = 1600, 34 * rows + 56, 100
        fig = plt.figure(figsize=(width_px / dpi, height_px / dpi), dpi=dpi, facecolor=BG)
        px, py = 1 / width_px, 1 / height_px
        header, margin, gap = 46 * py, 8 * px, 8
        fig.text(margin, 1 - 18 * py, self.dashboard.get("title", ""), color="#FFFFFF", fontsize=14,
                 fontweight="bold", va="center")
        span = f"{datetime.fromtimestamp(self.start):%Y-%m-%d %H:%M:%S} + {self.end - self.start:.0f} s, step {step:g} s"
        fig.text(margin, 1 - 38 * py, "all variables: All    x axis: seconds since the start", color=MUTED,
                 fontsize=8.5, va="center")
        fig.text(1 - margin, 1 - 18 * py, span, color=MUTED, fontsize=8.5, va="center", ha="right")
        fig.text(1 - margin, 1 - 38 * py, self.note, color=MUTED, fontsize=8.5, va="center", ha="right")
        usable_w, usable_h = 1 - 2 * margin, 1 - header - margin
        for panel in panels:
            g = panel["gridPos"]
            x0 = margin + usable_w * g["x"] / 24 + gap / 2 * px
            w = usable_w * g["w"] / 24 - gap * px
            top = 1 - header - usable_h * g["y"] / rows - gap / 2 * py
            h = usable_h * g["h"] / rows - gap * py
            if panel["type"] == HEADING:
                fig.text(x0, top - h / 2, panel["title"], color="#FFFFFF", fontsize=11, fontweight="bold", va="center")
                continue
            fig.patches.append(FancyBboxPatch((x0, top - h), w, h, boxstyle="round,pad=0,rounding_size=0.003",
                                              transform=fig.transFigure, facecolor=PANEL, edgecolor=BORDER, lw=1,
                                              zorder=-1))
            fig.text(x0 + 8 * px, top - 13 * py, panel["title"], color=TEXT, fontsize=9.5, fontweight="bold",
                     va="center")
            kind = panel["type"]
            left = {"table": 8, "state-timeline": 110, "heatmap": 52}.get(kind, 46)
            ax = fig.add_axes((x0 + left * px, top - h + 22 * py, w - (left + 14) * px,
                               h - (62 if kind == "state-timeline" else 44) * py))
            ax.set_facecolor(PANEL)
            for spine in ax.spines.values():
                spine.set_visible(False)
            ax.tick_params(colors=TEXT, labelsize=7, length=2)
            ax.grid(True, color=GRID, lw=0.8)
            ax.set_axisbelow(True)
            if kind != "table":
                ax.set_xlim(0, self.end - self.start)
            if kind == "timeseries":
                ax.yaxis.set_major_locator(self.MaxNLocator(nbins=5))
            getattr(self, kind.replace("-", "_"))(ax, panel)
            if kind != "table" and not ax.has_data():
                ax.text(0.5, 0.5, "No data", color=MUTED, ha="center", va="center", transform=ax.transAxes)
        fig.savefig(out, dpi=dpi, facecolor=BG)
        plt.close(fig)


def render(dashboard: dict, results: dict[tuple[int, str], list[Series]], out: Path, start: float, end: float,
           step: float, note: str = "") -> None:
    Renderer(dashboard, results, start, end, note).draw(out, step)


# ---------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.render_dashboard", description=__doc__.split("\n")[0])
    parser.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--dashboard", default="node", help="training, node, or a dashboard JSON file")
    parser.add_argument("--minutes", type=float, default=10.0, help="the time range, ending now")
    parser.add_argument("--step", type=float, default=5.0, help="query_range step, seconds")
    parser.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for")
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    path = DASHBOARDS.get(args.dashboard, Path(args.dashboard))
    dashboard = json.loads(path.read_text())
    end = time.time()
    start = end - args.minutes * 60
    try:
        import matplotlib  # noqa: F401  (fail before querying)
    except ImportError:
        print(MISSING_MATPLOTLIB, file=sys.stderr)
        return 2
    results = fetch(args.prometheus.rstrip("/"), dashboard, start, end, args.step, args.rate_interval)
    render(dashboard, results, Path(args.out), start, end, args.step, note=f"$__rate_interval = {args.rate_interval}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
