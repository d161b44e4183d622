"""Run `npu-node-agent demo` under a real Prometheus: do the dashboards' queries return data, which alerts fire, and
the pictures of both dashboards for docs/steps.md.

    .venv/bin/pip install -e '.[render]'     # matplotlib, for the pictures
    .venv/bin/python -m bench.demo_prometheus [--seconds 200] [--out-dir bench] [--prometheus /usr/bin/prometheus]

Starts the demo (its 60 s fault scenario, the simulated 16-rank job whose rank 5 gets slower after
--slow-after s, the demo ClusterD) and a Prometheus of its own (temporary storage, a free port on
127.0.0.1) that scrapes the demo agent's /metrics at the chart's scrape interval and timeout
(serviceMonitor in helm/npu-node-agent/values.yaml) with honor_labels, as the ServiceMonitor does,
and loads the chart's rule file. While the demo runs it polls /api/v1/alerts and prints each alert
as it goes pending, firing and away, in seconds since the demo started. At the end it sends every
panel target of both dashboards to /api/v1/query_range over the whole run (variables at "All",
$__rate_interval = 4 scrape intervals, Grafana's floor), lists which return data, and draws both
dashboards to <out-dir>/dashboard-training.png and dashboard-node.png. Exit 1 when a query
returned nothing (the list says which), 2 on a usage or set-up problem.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from bench.render_dashboard import DASHBOARDS, MISSING_MATPLOTLIB, fetch, get_json, promql, render, targets
from testkit import REPO

CHART = REPO / "helm" / "npu-node-agent"
RULES = CHART / "files" / "prometheus-rules.yaml"
METRICS_URL = re.compile(r"metrics:\s+(http://127\.0\.0\.1:\d+/metrics)")


def seconds(duration: str) -> float:
    """A Prometheus duration as the chart's values write it (30s, 1m, 1m30s)."""
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    if not parts or not duration:
        raise ValueError(f"not a duration: {duration!r}")
    return int(parts.group(1) or 0) * 60 + int(parts.group(2) or 0)


def chart_scrape() -> tuple[str, str]:
    monitor = yaml.safe_load((CHART / "values.yaml").read_text())["serviceMonitor"]
    return monitor["interval"], monitor["scrapeTimeout"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(what: str, check, deadline_s: float, process: subprocess.Popen | None = None):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"demo_prometheus: {what}: the process exited with {process.returncode}")
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"demo_prometheus: {what}: not within {deadline_s:g} s")


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:  # URLError is one
        return False


class AlertLog:
    """Alert states over time, from polling /api/v1/alerts: one line per change."""

    def __init__(self, base: str, started: float):
        self.base, self.started = base, started
        self.state: dict[tuple, str] = {}
        self.events: list[tuple[float, str, str, dict]] = []  # (s since start, alert, state, labels)

    def poll(self) -> None:
        now = time.monotonic() - self.started
        try:
            alerts = get_json(f"{self.base}/api/v1/alerts", timeout=5)["data"]["alerts"]
        except (OSError, ValueError) as exc:
            print(f"demo_prometheus: /api/v1/alerts: {exc}", file=sys.stderr)
            return
        current = {}
        for alert in alerts:
            labels = {k: v for k, v in alert["labels"].items() if k not in ("alertname", "job", "instance")}
            current[(alert["labels"]["alertname"], tuple(sorted(labels.items())))] = alert["state"]
        for key in sorted(set(current) | set(self.state)):
            state = current.get(key, "resolved")
            if self.state.get(key, "resolved") != state:
                self.events.append((now, key[0], state, dict(key[1])))
                print(f"[{now:6.1f}s] alert {key[0]:<26} {state:<8} {short(dict(key[1]))}", flush=True)
        self.state = current


def short(labels: dict) -> str:
    keep = ("severity", "worker", "ranks", "rank", "reason", "cause", "node", "job_name", "id", "fault_level")
    return " ".join(f"{k}={labels[k]}" for k in keep if k in labels)


def check_queries(base: str, start: float, end: float, step: float, rate_interval: str) -> tuple[dict, dict]:
    """({dashboard: [(panel title, refId, query sent, series returned)]}, {dashboard: fetch() results})."""
    report, results = {}, {}
    for name, path in DASHBOARDS.items():
        dashboard = json.loads(path.read_text())
        results[name] = fetch(base, dashboard, start, end, step, rate_interval)
        report[name] = [(panel["title"], target["refId"], promql(target["expr"], rate_interval),
                         len(results[name][(panel["id"], target["refId"])])) for panel, target in targets(dashboard)]
    return report, results


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.demo_prometheus", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=200.0,
                        help="how long the demo runs under Prometheus (default 200: a scenario cycle of 60 s and "
                             "the slow rank's detection and alerts after --slow-after)")
    parser.add_argument("--slow-after", type=float, default=60.0, help="when rank 5 gets slower (demo's option)")
    parser.add_argument("--out-dir", default="bench", help="where the two PNGs go")
    parser.add_argument("--prometheus", default=shutil.which("prometheus") or "/usr/bin/prometheus")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import matplotlib  # noqa: F401  (fail before a run of minutes, not after)
    except ImportError:
        print(MISSING_MATPLOTLIB, file=sys.stderr)
        return 2
    if not Path(args.prometheus).exists():
        print(f"demo_prometheus: no Prometheus at {args.prometheus} (--prometheus)", file=sys.stderr)
        return 2
    interval, timeout = chart_scrape()
    scrape = seconds(interval)
    rate_interval = f"{4 * scrape:g}s"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="demo-prometheus-") as tmp, \
            open(Path(tmp) / "demo.out", "w+") as demo_log, open(Path(tmp) / "prometheus.out", "w") as prometheus_log:
        work = Path(tmp)
        demo = subprocess.Popen([sys.executable, "-m", "agent", "demo", "--duration", f"{args.seconds + 30:g}",
                                 "--slow-after", f"{args.slow_after:g}", "--workdir", str(work / "demo")],
                                cwd=REPO, stdout=demo_log, stderr=subprocess.STDOUT, text=True)
        started = time.monotonic()
        prometheus = None
        try:
            def metrics_url():
                demo_log.seek(0)
                found = METRICS_URL.search(demo_log.read())
                return found and found.group(1)
            target = wait_for("the demo's metrics URL", metrics_url, 60, demo)
            host_port = target.split("/")[2]
            port = free_port()
            config = {
                "global": {"scrape_interval": interval, "scrape_timeout": timeout, "evaluation_interval": interval},
                "rule_files": [str(RULES)],
                "scrape_configs": [{"job_name": "npu-node-agent", "honor_labels": True,
                                    "static_configs": [{"targets": [host_port]}]}],
            }
            (work / "prometheus.yml").write_text(yaml.safe_dump(config))
            prometheus = subprocess.Popen(
                [args.prometheus, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=prometheus_log, stderr=subprocess.STDOUT)
            base = f"http://127.0.0.1:{port}"
            wait_for("Prometheus ready", lambda: ready(f"{base}/-/ready"), 60, prometheus)
            start_wall = time.time()
            print(f"demo: {target}; Prometheus {base} scraping every {interval} (timeout {timeout}), "
                  f"rules {RULES.relative_to(REPO)}; {args.seconds:g} s", flush=True)
            alerts = AlertLog(base, started)
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline:
                if demo.poll() is not None:
                    raise SystemExit(f"demo_prometheus: the demo exited early ({demo.returncode}); see its output:\n"
                                     + (work / "demo.out").read_text()[-2000:])
                alerts.poll()
                time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
            end_wall = time.time()
            step = max(1.0, scrape / 2)
            report, results = check_queries(base, start_wall, end_wall, step, rate_interval)
        finally:
            for process in (prometheus, demo):
                if process is not None and process.poll() is None:
                    process.terminate()
                    try:
                        process.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait()
    print(f"\nalerts (seconds since the demo started; rank 5 slower from {args.slow_after:g} s):")
    firing = [e for e in alerts.events if e[2] == "firing"]
    for t, name, state, labels in alerts.events:
        print(f"  {t:6.1f}s  {name:<26} {state:<8} {short(labels)}")
    by_name: dict[str, int] = {}
    for _, name, _, _ in firing:
        by_name[name] = by_name.get(name, 0) + 1
    print("  firing, by alert: " + (", ".join(f"{k} x{v}" for k, v in sorted(by_name.items())) or "none"))
    missing = []
    for name, rows in report.items():
        with_data = sum(1 for row in rows if row[3])
        print(f"\n{name} dashboard: {with_data}/{len(rows)} queries returned data")
        for title, ref, expr, count in rows:
            print(f"  {'ok ' if count else 'NO '} {count:4d} series  {title} [{ref}]")
            if not count:
                missing.append(f"{name}: {title} [{ref}]: {expr}")
    for name, dashboard_path in DASHBOARDS.items():
        out = out_dir / f"dashboard-{name}.png"
        render(json.loads(dashboard_path.read_text()), results[name], out, start_wall, end_wall, step,
               note=f"demo under Prometheus, {interval} scrapes, $__rate_interval = {rate_interval}")
        print(f"wrote {out}")
    print(f"\ntook {time.monotonic() - began:.0f} s")
    if missing:
        print("queries that returned no data:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
