"""What npu-exporter's telemetry costs the agent: CPU, RSS and scrape size and time, 16 fake NPUs.

Two real agents run side by side in the same window, both with the chart's default `agent:` block
(as bench.footprint renders it) on the fake libdcmi.so: the idle agent (telemetry off, the baseline)
and the telemetry agent (`telemetry.enabled: true`, npu-exporter's default intervals). Beside them, as
in bench.footprint, a bare interpreter that imports the agent's dependencies gives the RSS floor the
footprint goal is stated against. The telemetry agent runs hccn_tool as subprocesses, so its CPU
counts its reaped children's too (the fake hccn_tool is a shell script, so
each run costs a fork and exec of sh, as the real tool's would). After the CPU window, each agent's /metrics is scraped N times
(size, series, wall time and the agent's CPU per scrape).

The 60 s groups run once a minute: a window that is a multiple of 60 s weighs them fairly, a shorter
one is a check that it runs.

Run from the repository root:  .venv/bin/python -m bench.telemetry [--window 120]
"""

from __future__ import annotations

import argparse
import compileall
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from agent.telemetry.families import BY_NAME, GROUPS
from bench.footprint import (TARGET_RSS_RATIO, Sampled, chart_default_config, ratio, start_baseline,
                             stop_baseline)
from testkit import REPO
from testkit.agent import AgentProcess
from testkit.fakes.dcmi import build_fake_dcmi
from testkit.fakes.hccn import FakeHccn
from testkit.fakes.kubelet.podresources import PodResourcesStandIn
from testkit.wait import wait_until

TARGET_EXTRA_CPU_PERCENT = 1.0  # of one core, over the idle agent
TARGET_EXTRA_RSS_MIB = 5.0  # over the footprint goal (and over the idle agent)


class WithChildren(Sampled):
    """Sampled, with the CPU of the children the agent has reaped (hccn_tool runs)."""

    def cpu_time(self) -> float:
        t = self.process.cpu_times()
        return t.user + t.system + t.children_user + t.children_system


def scrape(agent: AgentProcess) -> tuple[float, bytes]:
    """One plain-text scrape of /metrics: (wall ms, body)."""
    started = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.http_port}/metrics", timeout=10) as response:
        body = response.read()
    return (time.perf_counter() - started) * 1000, body


class Scrapes:
    """N scrapes of one agent: wall times, body size, series, the agent's CPU per scrape."""

    def __init__(self, agent: AgentProcess, n: int):
        process = WithChildren("", agent.process.pid)
        cpu_before = process.cpu_time()
        results = [scrape(agent) for _ in range(n)]
        self.cpu_ms = (process.cpu_time() - cpu_before) / n * 1000  # the collection in between is included
        self.ms = sorted(ms for ms, _ in results)
        self.bytes = len(results[-1][1])
        self.samples = [sample for family in text_string_to_metric_families(results[-1][1].decode())
                        for sample in family.samples]
        self.families = Counter(sample.name for sample in self.samples)
        self.series = len(self.samples)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m bench.telemetry",
        description="CPU, RSS and scrape cost of telemetry.enabled: two agents on the fake libdcmi.so (telemetry "
                    "off = baseline, on), plus a bare interpreter for the RSS floor, sampled in the same window. "
                    "Prints PASS/FAIL against the targets (extra CPU < %g %% of a core; RSS <= the footprint goal "
                    "+ %g MiB); exits 0 either way (non-zero only when the benchmark could not run)."
                    % (TARGET_EXTRA_CPU_PERCENT, TARGET_EXTRA_RSS_MIB))
    parser.add_argument("--window", type=float, default=120.0, help="sampled window in seconds (default 120)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before the window (default 10)")
    parser.add_argument("--interval", type=float, default=1.0, help="RSS sampling interval in seconds (default 1)")
    parser.add_argument("--cards", type=int, default=16, help="NPUs on the fake node (default 16)")
    parser.add_argument("--scrapes", type=int, default=20, help="scrapes of each agent after the window (default 20)")
    parser.add_argument("--hccn-tool", default=None,
                        help="telemetry.hccn_tool (\"\" turns the network, roce and optical groups off); default "
                             "the fake testkit/fakes/hccn (a shell script answering healthy ports for every chip)")
    args = parser.parse_args(argv)
    if args.window <= 0 or args.warmup < 0 or not 0 < args.interval <= args.window or args.scrapes < 1:
        parser.error("--window, --interval and --scrapes must be positive (interval <= window), --warmup not negative")
    if not 1 <= args.cards <= 64:
        parser.error("--cards must be 1..64 (the fake's limit)")
    return args


def sample_window(procs: list[Sampled], window: float, interval: float) -> float:
    """RSS every `interval` and CPU over `window` seconds for every process; the wall time taken."""
    for p in procs:
        p.start()
    start, n = time.monotonic(), 0
    while True:
        for p in procs:
            p.sample()
        n += 1
        due = start + n * interval
        if due > start + window + 1e-9:
            break
        time.sleep(max(0.0, due - time.monotonic()))  # sampling interval
    for p in procs:
        p.finish()
    return time.monotonic() - start


def report(args, wall: float, idle: Sampled, tele: Sampled, bare: Sampled, s_idle: Scrapes, s_tele: Scrapes) -> None:
    extra_cpu = tele.cpu_percent(wall) - idle.cpu_percent(wall)
    extra_rss = tele.rss_mean() - idle.rss_mean()
    rss_goal = TARGET_RSS_RATIO * bare.rss_mean() + TARGET_EXTRA_RSS_MIB
    cpu_ok, rss_ok, delta_ok = extra_cpu < TARGET_EXTRA_CPU_PERCENT, tele.rss_mean() <= rss_goal, \
        extra_rss <= TARGET_EXTRA_RSS_MIB
    telemetry_series = {name: n for name, n in s_tele.families.items() if name in BY_NAME}
    groups = sorted({BY_NAME[name].group for name in telemetry_series})
    print()
    print(f"window {wall:.1f} s, {len(tele.rss)} samples each")
    print(f"{'':30} {'telemetry':>10} {'idle agent':>10} {'tele/idle':>10} {'bare py':>10} {'tele/bare':>10}")
    row = "{:30} {:>10.{d}f} {:>10.{d}f} {:>10} {:>10.{d}f} {:>10}"
    print(row.format("RSS mean (MiB)", tele.rss_mean(), idle.rss_mean(), ratio(tele.rss_mean(), idle.rss_mean()),
                     bare.rss_mean(), ratio(tele.rss_mean(), bare.rss_mean()), d=1))
    print(row.format("RSS max in window (MiB)", tele.rss_max(), idle.rss_max(), ratio(tele.rss_max(), idle.rss_max()),
                     bare.rss_max(), ratio(tele.rss_max(), bare.rss_max()), d=1))
    print(row.format("CPU (% of one core, +children)", tele.cpu_percent(wall), idle.cpu_percent(wall),
                     ratio(tele.cpu_percent(wall), idle.cpu_percent(wall), 1), bare.cpu_percent(wall),
                     ratio(tele.cpu_percent(wall), bare.cpu_percent(wall), 1), d=3))
    print(f"{'threads':30} {tele.threads:>10} {idle.threads:>10}")
    print()
    print(f"/metrics, {args.scrapes} scrapes each (text format, after the window):")
    print(f"{'':30} {'telemetry':>10} {'idle agent':>10} {'tele/idle':>10}")
    for label, a, b, d in (("bytes", s_tele.bytes, s_idle.bytes, 0), ("series", s_tele.series, s_idle.series, 0),
                           ("wall ms, median", statistics.median(s_tele.ms), statistics.median(s_idle.ms), 2),
                           ("wall ms, max", s_tele.ms[-1], s_idle.ms[-1], 2),
                           ("agent CPU ms per scrape", s_tele.cpu_ms, s_idle.cpu_ms, 2)):
        print(f"{label:30} {a:>10.{d}f} {b:>10.{d}f} {ratio(a, b):>10}")
    print(f"telemetry series: {sum(telemetry_series.values())} in {len(telemetry_series)} families; groups seen: "
          f"{', '.join(groups) or 'none'} (of {', '.join(g.name for g in GROUPS)})")
    failing = {(s.labels["group"], s.labels["result"]): int(s.value) for s in s_tele.samples
               if s.name == "npu_agent_telemetry_reads_total" and s.labels["result"] != "ok" and s.value}
    print("reads that did not answer in time or failed (npu_agent_telemetry_reads_total, whole run): "
          + (", ".join(f"{group} {result} {n}" for (group, result), n in sorted(failing.items())) or "none"))
    if not telemetry_series:
        print("NOTE: no telemetry family in the scrape: telemetry is not wired in this build, the figures are two idle "
              "agents")
    print()
    print(f"telemetry over the idle agent: +{extra_cpu:.3f} % of a core (target < {TARGET_EXTRA_CPU_PERCENT:g}): "
          f"{'PASS' if cpu_ok else 'FAIL'}; +{extra_rss:.1f} MiB RSS (target <= {TARGET_EXTRA_RSS_MIB:g}): "
          f"{'PASS' if delta_ok else 'FAIL'}; RSS {tele.rss_mean():.1f} MiB = {ratio(tele.rss_mean(), bare.rss_mean())} "
          f"the bare interpreter (target <= {TARGET_RSS_RATIO:g}x + {TARGET_EXTRA_RSS_MIB:g} MiB = {rss_goal:.1f} MiB): "
          f"{'PASS' if rss_ok else 'FAIL'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="npa-tele-", dir="/tmp"))
    agents: list[AgentProcess] = []
    bare = kubelet = None
    try:
        library = build_fake_dcmi(workdir / "lib")
        kubelet = PodResourcesStandIn(workdir / "kubelet.sock").start()
        env = {"FAKE_DCMI_CARDS": str(args.cards), "FAKE_DCMI_CONTROL": "", "FAKE_DCMI_TRACE": ""}
        if args.hccn_tool is None:
            args.hccn_tool = str(FakeHccn(workdir / "hccn", chips=args.cards).path)
        compileall.compile_dir(REPO / "agent", quiet=1)  # as the image does (bench.footprint says why)
        for name, enabled in (("idle", False), ("telemetry", True)):
            home = workdir / name
            (home / "profiling").mkdir(parents=True)
            config = chart_default_config(home, library, workdir / "kubelet.sock", None)
            config["telemetry"].update(enabled=enabled, hccn_tool=args.hccn_tool)
            agents.append(AgentProcess(home, config, env).start())
        bare = start_baseline()
        for agent in agents:
            wait_until(lambda: agent.http("/readyz")[0] == 200, 20, "agent /readyz 200")
        intervals = ", ".join(f"{group} {seconds:g} s" for group, seconds in config["telemetry"]["intervals"].items())
        print(f"telemetry cost: two agents with the chart's defaults, backend dcmi on the fake libdcmi.so "
              f"({args.cards} NPUs), one with telemetry.enabled (hccn_tool {args.hccn_tool or 'off'}; intervals "
              f"{intervals}), and a bare interpreter")
        print(f"  warm-up {args.warmup:g} s, then sampled every {args.interval:g} s for {args.window:g} s ...", flush=True)
        time.sleep(args.warmup)  # warm-up before the window, not synchronisation
        idle, tele = (WithChildren(name, agent.process.pid) for name, agent in zip(("idle", "telemetry"), agents))
        bare_sampled = Sampled("bare", bare.pid)
        wall = sample_window([idle, tele, bare_sampled], args.window, args.interval)
        for agent in agents:
            if agent.process.poll() is not None:
                raise RuntimeError(f"an agent exited during the window (code {agent.process.returncode})")
        report(args, wall, idle, tele, bare_sampled, *(Scrapes(agent, args.scrapes) for agent in agents))
        return 0
    except Exception as exc:  # noqa: BLE001 - the benchmark could not run: say why, exit non-zero
        print(f"benchmark error: {exc}", file=sys.stderr)
        for agent in agents:
            print("last agent log lines:\n" + "".join(agent.raw_stderr[-15:]), file=sys.stderr)
        return 1
    finally:
        if bare is not None:
            stop_baseline(bare)
        if kubelet is not None:
            kubelet.stop()
        for agent in agents:
            try:
                agent.stop()
            except AssertionError as exc:
                print(f"warning: agent stop: {exc}", file=sys.stderr)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
