"""The Prometheus series budget of one node: every series of a scrape by family, where it comes from and
how the count grows with NPUs, training ranks, workers and jobs.

Run from the repository root:  nice -n 19 .venv/bin/python -m bench.series_budget       # ~1 min on 2 cores

The real agent (`python -m agent run`, through `testkit/agent.py`) runs on the simulated backend with
`--npus` NPUs (16) and every feature that adds series: npu-exporter's telemetry (every group, its
default intervals), ClusterD (the stand-in), Kubernetes (the API stand-in: the pod watch that names
the job, the device-info ConfigMap, the node condition, events, datatrace), pod attribution (a kubelet
PodResources stand-in: one pod holds every NPU), the TaskD proxy, the disk guard and the step
metrics. A writer thread in this process plays a `testkit.training.TrainingJob` of `--ranks` ranks (16,
all on this node; `--tp` x dp x `--pp`, dp what is left), 0.1 s steps, a save_checkpoint every
`--checkpoint-every` steps, appended to `<profiling.root>/<job>/<rank>/` every 1 s as TaskD would
(every 5 s). Once every rank has `--steps` steps counted (past the 20 warm-up steps, the 50 of the
baseline and the 128 of the longest worker window, so every family a training rank can have is
there), /metrics is scraped `--scrapes` times, 1 s apart; per family the most series any scrape
had is the figure (a step or a checkpoint in progress is there in some scrapes only).

Each series is put where it grows: with ranks (it has a `rank` label), workers (`worker`: one
tensor-parallel group, `--tp` ranks), jobs (`job_id`), NPUs (`id`), or the node (none of them:
constant). Per training rank = per-rank series + per-worker series / TP: the figure the target
(<= 30) is on, printed at the run's TP and at TP 1 (a worker per rank, the most).

**Baseline, same run**: the agent at `--baseline` (default BASELINE_COMMIT, the last commit
before the series budget; `git archive` of its `agent/` package, the built native extension copied
in), run beside the current one with the same configuration on the same records, scraped at the
same moments. `--baseline none`, or no git history: the figures recorded in the issue instead
(a demo node of 8 NPUs: 2,395 series, 489 KB; 81 per training rank, 60 of them histogram buckets).

Exit 0 when it produced a report (PASS or FAIL), non-zero when it could not run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from testkit import REPO
from testkit.agent import AgentProcess
from testkit.fakes.clusterd import ClusterdStandIn
from testkit.fakes.kube import KubeStandIn
from testkit.fakes.kubelet.podresources import PodResourcesStandIn
from testkit.training.job import TrainingJob
from testkit.wait import wait_until

BASELINE_COMMIT = "bf3f28e"  # the last commit before the series budget (see bench/README.md)
RECORDED = {"series": 2395, "bytes": 489_000, "per_rank": 81, "npus": 8}  # the demo node
TARGET_PER_RANK = 30
NODE = "npu-node-0001"
NAMESPACE, JOB_NAME = "team-llm", "llama-70b-pretrain"
JOB_ID = "5c0d7c2e-2a47-4c1e-9a7f-0b3c2b9e1d44"  # MINDX_TASK_ID: the job's UID
STEP_S, FLUSH_S = 0.1, 1.0
# Where a series grows, by the label that names what it is per (in this order).
GROWS = (("rank", "rank"), ("worker", "worker"), ("job_id", "job"), ("id", "NPU"))
COLUMNS = ("rank", "worker", "job", "NPU", "node")


# ---- the training job ---------------------------------------------------------------------------


class JobWriter:
    """Plays a TrainingJob against the wall clock on its own thread: every write TaskD's worker
    would make by now, appended to the rank's file (the pacing of the thread is a schedule, not
    synchronisation)."""

    def __init__(self, root: Path, args):
        self.job = TrainingJob(tp=args.tp, dp=args.ranks // (args.tp * args.pp), pp=args.pp,
                               ranks_per_node=args.ranks, job_id=JOB_ID, steps=None, start_wall=time.time(),
                               step_s=STEP_S, forward_s=0.3 * STEP_S, flush_s=FLUSH_S,
                               checkpoint_every=args.checkpoint_every, checkpoint_s=2 * STEP_S)
        self.files = []
        for rank in range(args.ranks):
            directory = root / JOB_ID / str(rank)
            directory.mkdir(parents=True)
            (directory / "parallel_group.json").write_text(json.dumps(self.job.parallel_group(rank)))
            self.files.append(directory / f"{int(self.job.start_wall):010d}")
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(0.2):
                for flush in self.job.flushes(time.time()):
                    with open(self.files[flush.rank], "ab") as handle:
                        handle.write(flush.data)
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


# ---- the agents ---------------------------------------------------------------------------------


def config(work: Path, args, profiling: Path, clusterd: str, kubelet: Path) -> dict:
    return {
        "node_name": NODE,
        "devices": {"backend": "simulated", "poll_interval_seconds": 2, "simulated": {"devices": args.npus}},
        "profiling": {"root": str(profiling)},  # the disk guard's 5,000 MiB: it deletes nothing here
        "telemetry": {"enabled": True},
        "clusterd": {"enabled": True, "address": clusterd},
        "kubernetes": {"enabled": True, "device_info_configmap": True, "node_condition": True, "events": True,
                       "pod_resources_socket": str(kubelet), "pod_resources_refresh_seconds": 2},
        "datatrace": {"enabled": True, "root": str(work / "datatrace")},
        "taskd_proxy": {"enabled": True, "listen": "127.0.0.1:0"},
        "log": {"level": "info", "format": "json"},
    }


def baseline_tree(ref: str, into: Path) -> Path | None:
    """The `agent` package at `ref` under `into` (with the built native extension), or None without git history."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, "agent"], capture_output=True)
    if archive.returncode != 0:
        print(f"series_budget: no baseline at {ref!r} ({archive.stderr.decode().strip()}): "
              f"the recorded figures are the baseline", file=sys.stderr)
        return None
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    for native in (REPO / "agent").glob("_native*.so"):
        shutil.copy2(native, into / "agent" / native.name)
    return into


def start_agent(work: Path, settings: dict, env: dict, tree: Path | None) -> AgentProcess:
    agent = AgentProcess(work, settings, env)
    if tree is not None:  # the baseline's package first on the path (the agent runs from the repository root)
        agent.program = [sys.executable, "-c", "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
                         "runpy.run_module('agent', run_name='__main__', alter_sys=True)", str(tree)]
    return agent.start(ready_timeout=60)


# ---- counting -----------------------------------------------------------------------------------


@dataclass
class Scrape:
    """The most series seen per family over the scrapes, each series put where it grows."""

    series: Counter = field(default_factory=Counter)  # family -> series
    grows: dict = field(default_factory=dict)  # family -> "rank", "worker", "job", "NPU" or "node"
    kinds: dict = field(default_factory=dict)  # family -> type
    units: dict = field(default_factory=dict)  # "rank", "worker", ... -> how many the scrape had
    bytes: int = 0
    gzip_bytes: int = 0

    def add(self, text: str) -> None:
        body = text.encode()
        self.bytes = max(self.bytes, len(body))
        self.gzip_bytes = max(self.gzip_bytes, len(gzip.compress(body)))
        seen: dict[str, set] = {unit: set() for unit, _ in GROWS}
        for family in text_string_to_metric_families(text):
            count = len(family.samples)
            if not count:
                continue
            self.series[family.name] = max(self.series[family.name], count)
            self.kinds[family.name] = family.type
            labels = family.samples[0].labels
            self.grows[family.name] = next((unit for label, unit in GROWS if label in labels), "node")
            for sample in family.samples:
                for label, _ in GROWS:
                    if label in sample.labels:
                        key = (sample.labels.get("job_id"), sample.labels[label])
                        seen[label].add(key)
        for label, unit in GROWS:
            self.units[unit] = max(self.units.get(unit, 0), len(seen[label]))

    def by_growth(self) -> Counter:
        totals = Counter()
        for name, count in self.series.items():
            totals[self.grows[name]] += count
        return totals

    @property
    def total(self) -> int:
        return sum(self.series.values())

    def per(self, unit: str) -> float:
        """Series per one of `unit` (0 without any)."""
        return self.by_growth()[unit] / self.units[unit] if self.units.get(unit) else 0.0

    def per_rank(self, tp: int) -> float:
        """Everything that grows with ranks, per rank: its own series and its worker's share."""
        return self.per("rank") + self.per("worker") / tp


def scrape_text(agent: AgentProcess) -> str:
    status, text = agent.http("/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    return text


def ready(agent: AgentProcess, ranks: int, steps: int) -> bool:
    """Every rank has `steps` steps counted and every worker its longest window."""
    samples = [s for family in text_string_to_metric_families(scrape_text(agent)) for s in family.samples]
    counted = [s.value for s in samples if s.name == "training_steps_completed_total"]
    windows = {s.labels["window"] for s in samples if s.name == "training_worker_compute_seconds"}
    return len(counted) == ranks and min(counted) >= steps and "128" in windows


# ---- the report ---------------------------------------------------------------------------------


def report(current: Scrape, old: Scrape | None, args) -> bool:
    names = sorted(set(current.series) | set(old.series if old else ()),
                   key=lambda n: (COLUMNS.index(current.grows.get(n) or old.grows[n]), n))
    head = f"{'family':<58} {'type':<9} {'grows with':<10} {'series':>7}"
    print(head + (f" {'baseline':>8}" if old else ""))
    for name in names:
        grows = current.grows.get(name) or old.grows[name]
        kind = current.kinds.get(name) or old.kinds[name]
        line = f"{name:<58} {kind:<9} {grows:<10} {current.series.get(name, 0):>7}"
        if old:
            line += f" {old.series.get(name, 0):>8}"
        print(line)
    print()
    units = ", ".join(f"{current.units.get(u, 0)} {u}{'' if current.units.get(u) == 1 else 's'}"
                      for u in ("rank", "worker", "job", "NPU"))
    print(f"one scrape of the node ({units}):")
    same_node = args.npus == RECORDED["npus"]  # the totals are of a demo node of 8 NPUs
    rows = [("series", current.total, old.total if old else RECORDED["series"] if same_node else None),
            ("bytes (text format)", current.bytes, old.bytes if old else RECORDED["bytes"] if same_node else None),
            ("bytes gzip-compressed", current.gzip_bytes, old.gzip_bytes if old else None)]
    for unit in COLUMNS:
        rows.append((f"  of which grow with {unit}s", current.by_growth()[unit],
                     old.by_growth()[unit] if old else None))
    for unit in ("rank", "worker", "job", "NPU"):
        rows.append((f"series per {unit}", current.per(unit), old.per(unit) if old else None))
    if args.tp != 1:
        rows.append((f"series per training rank, TP {args.tp}", current.per_rank(args.tp),
                     old.per_rank(args.tp) if old else None))
    rows.append(("series per training rank, TP 1 (the most)", current.per_rank(1),
                 old.per_rank(1) if old else RECORDED["per_rank"]))
    label = "baseline" if old else "recorded (issue)"
    print(f"  {'':<44} {'current':>10} {label:>17} {'ratio':>6}")
    for what, now, before in rows:
        ratio = f"{now / before:.2f}" if before else ""
        before_text = "" if before is None else _fmt(before)
        print(f"  {what:<44} {_fmt(now):>10} {before_text:>17} {ratio:>6}")
    constant = current.by_growth()["node"]
    print(f"\nthe node's series = {constant} + {current.per('NPU'):.1f} per NPU + {current.per('rank'):.1f} per rank "
          f"+ {current.per('worker'):.1f} per worker (TP ranks) + {current.per('job'):.1f} per job "
          f"(+ 1 per active fault code)")
    for npus, tp, jobs in ((8, 1, 1), (16, 1, 1), (16, 8, 1), (16, 1, 2)):
        total = constant + npus * current.per("NPU") + npus * current.per_rank(tp) + jobs * current.per("job")
        print(f"  {npus:>2} NPUs, a rank on each, TP {tp}, {jobs} job{'s' if jobs > 1 else ''}: {total:,.0f} series, "
              f"{total * 1000 / 1e6:.2f} M at 1,000 such nodes")
    worst = current.per_rank(1)
    verdict = worst <= TARGET_PER_RANK
    at_tp = f" (at TP {args.tp}: {current.per_rank(args.tp):.1f})" if args.tp != 1 else ""
    print(f"\nseries per training rank at TP 1 = {worst:.1f}{at_tp}; target <= {TARGET_PER_RANK}: "
          f"{'PASS' if verdict else 'FAIL'}")
    return verdict


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() or value >= 100 else f"{value:.1f}"


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.series_budget", description=__doc__.split("\n")[0])
    parser.add_argument("--npus", type=int, default=16, help="NPUs of the simulated node (default 16)")
    parser.add_argument("--ranks", type=int, default=16, help="training ranks on the node, one job (default 16)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1: a worker per rank, the "
                        "most series)")
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages (default 4)")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between save_checkpoints (0: none)")
    parser.add_argument("--steps", type=int, default=200, help="steps every rank has before the scrapes (default 200)")
    parser.add_argument("--scrapes", type=int, default=5, help="scrapes, 1 s apart (default 5)")
    parser.add_argument("--baseline", default=BASELINE_COMMIT,
                        help=f"git ref of the agent to compare with (default {BASELINE_COMMIT}); `none`: the issue's "
                             "recorded figures")
    args = parser.parse_args(argv)
    if args.ranks % (args.tp * args.pp):
        parser.error(f"{args.ranks} ranks do not split into TP {args.tp} x PP {args.pp}")
    if not 1 <= args.npus <= 64 or args.scrapes < 1 or args.steps < 150:
        parser.error("--npus 1..64, --scrapes >= 1, --steps >= 150 (the longest window after the warm-up)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="series-budget-", dir="/tmp"))
    agents: list[AgentProcess] = []
    writer = None
    try:
        profiling = work / "profiling"
        profiling.mkdir()
        tree = None if args.baseline == "none" else baseline_tree(args.baseline, work / "baseline-tree")
        with ClusterdStandIn() as clusterd, KubeStandIn() as kube, \
                PodResourcesStandIn(work / "kubelet.sock") as kubelet:
            kubelet.set_pods((NAMESPACE, f"{JOB_NAME}-worker-0", "train", "huawei.com/Ascend910",
                              [f"Ascend910-{i}" for i in range(args.npus)]))
            kube.put({"kind": "Pod", "metadata": {"namespace": NAMESPACE, "name": f"{JOB_NAME}-worker-0",
                                                  "labels": {"volcano.sh/job-name": JOB_NAME}},
                      "spec": {"nodeName": NODE, "containers": [
                          {"name": "train", "image": "train:1", "env": [{"name": "MINDX_TASK_ID", "value": JOB_ID}]}]}})
            env = {"KUBECONFIG": kube.write_kubeconfig(work / "kubeconfig")}
            for name, source in (("current", None), ("baseline", tree)):
                if name == "baseline" and tree is None:
                    continue
                (work / name).mkdir()
                agents.append(start_agent(work / name, config(work / name, args, profiling, clusterd.address,
                                                              work / "kubelet.sock"), env, source))
            started = time.monotonic()
            writer = JobWriter(profiling, args)
            for agent in agents:
                wait_until(lambda: writer.error is None and ready(agent, args.ranks, args.steps),
                           args.steps * STEP_S * 3 + 120, f"{args.steps} steps of every rank and the 128-step windows")
            if writer.error is not None:
                raise writer.error
            scrapes = [Scrape() for _ in agents]
            for index in range(args.scrapes):
                if index:
                    time.sleep(1.0)  # scrapes spread over time, as Prometheus's (a schedule, not synchronisation)
                for agent, scrape in zip(agents, scrapes):
                    scrape.add(scrape_text(agent))
            print(f"series_budget: {args.npus} simulated NPUs, one job of {args.ranks} ranks (TP {args.tp}, "
                  f"PP {args.pp}, DP {args.ranks // (args.tp * args.pp)}), every feature on; "
                  f"{args.scrapes} scrapes after {time.monotonic() - started:.0f} s; baseline = "
                  f"{'agent at ' + args.baseline if tree else 'recorded in the issue'}\n")
            report(scrapes[0], scrapes[1] if len(scrapes) > 1 else None, args)  # PASS or FAIL: a report either way
    finally:
        if writer is not None:
            writer.stop()
        for agent in agents:
            agent.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
