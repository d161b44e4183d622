"""Training jobs on many nodes, each node running the agent's real step pipeline, in simulated time.

Per node, the agent's own consumer and collector (agent.steps.consumer.StepMetrics,
agent.steps.metrics.StepCollector) on a simulated clock: each TaskD write of a rank on the node is
handed over as the tailer hands it (its lines and their file position), and every `scrape_s` the
batch ends and every node is scraped as Prometheus would. The tailer reads a write within 0.1 s
and ends a batch per read; here a node's batch holds all it read since the last scrape, which
shows the same steps at each scrape for a tenth of the work. What the scrapes held is the input of
the shipped rules (testkit.training.promtool).

Each job runs on nodes of its own, named `<job_id>-n<index>`, holding `ranks_per_node`
consecutive ranks (the layout's). Not simulated: the tailer's file handling (tested on real files
elsewhere), the pod watch (jobs are named by their id in namespace "_unknown").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from agent import __version__
from agent.steps.consumer import StepMetrics
from agent.steps.metrics import StepCollector
from agent.steps.records import RankKey
from testkit.training.job import TrainingJob

# The families the training rules read (what a scrape keeps; histograms and counters are left out).
RULE_INPUTS = frozenset({
    "training_worker_compute_seconds", "training_worker_compute_stderr_seconds", "training_worker_info",
    "training_worker_slow", "training_node_slow", "training_rank_slowdown_ratio", "training_rank_active",
    "training_step_open_since_timestamp_seconds", "training_step_baseline_seconds",
    "training_checkpoint_open_since_timestamp_seconds", "training_profiling_lag_seconds",
})
SeriesKey = tuple[str, tuple[tuple[str, str], ...]]  # (name, sorted labels)


class SimClock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Node:
    """One node's agent pipeline."""

    name: str
    clock: SimClock
    steps: StepMetrics
    collector: StepCollector
    offsets: dict[int, int] = field(default_factory=dict)  # rank -> bytes handed over

    def scrape(self, keep: frozenset[str] = RULE_INPUTS) -> dict[SeriesKey, float]:
        # Every agent exports its build info, which the presence rules look for (NPUAgentMetricsAbsent).
        out = {("npu_agent_build_info", (("node", self.name), ("version", __version__))): 1.0}
        for family in self.collector.collect():
            for sample in family.samples:
                if sample.name in keep:
                    out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out


class Cluster:
    def __init__(self, jobs: Iterable[TrainingJob], state_dir: Path, *, start: float | None = None,
                 scrape_s: float = 10.0, groups: bool = True):
        self.jobs = list(jobs)
        self.scrape_s, self.groups = scrape_s, groups
        self.start = start if start is not None else min(j.start_wall for j in self.jobs)
        self.nodes: dict[tuple[str, int], Node] = {}
        for job in self.jobs:
            layout = job.layout
            for index in range(math.ceil(layout.ranks / layout.ranks_per_node)):
                clock = SimClock(self.start)
                name = f"{job.job_id}-n{index}"
                steps = StepMetrics(state_dir / f"{name}.json", clock=clock)
                collector = StepCollector(name, lambda s=steps: s, clock, histograms=False)  # the rules read none
                self.nodes[(job.job_id, index)] = Node(name, clock, steps, collector)
        self._told: set[tuple[str, int]] = set()  # ranks whose parallel_group.json was read
        self.slot = 0  # scrapes taken

    def node_of(self, job: TrainingJob, rank: int) -> Node:
        return self.nodes[(job.job_id, job.layout.node(rank))]

    def advance(self) -> dict[SeriesKey, float]:
        """Hand over every write read by the next scrape time, then scrape every node: one slot."""
        self.slot += 1
        now = self.start + self.slot * self.scrape_s
        for job in self.jobs:
            for flush in job.flushes(now):
                node = self.node_of(job, flush.rank)
                node.clock.now = flush.wall
                key = RankKey(job.job_id, flush.rank)
                if self.groups and (job.job_id, flush.rank) not in self._told:
                    self._told.add((job.job_id, flush.rank))
                    node.steps.on_group(key, job.parallel_group(flush.rank))
                offset = node.offsets.get(flush.rank, 0)
                node.steps.on_lines(key, f"{int(job.start_wall):010d}", offset, flush.data)
                node.offsets[flush.rank] = offset + len(flush.data)
        samples: dict[SeriesKey, float] = {}
        for node in self.nodes.values():
            node.clock.now = now
            node.steps.on_batch_end()
            node.steps.upkeep()
            samples.update(node.scrape())
        return samples

    def run(self, until: float, on_scrape: Callable[[int, dict[SeriesKey, float]], None]) -> None:
        """Slots up to `until` (wall seconds); `on_scrape(slot, samples)` for each."""
        while self.start + (self.slot + 1) * self.scrape_s <= until:
            samples = self.advance()
            on_scrape(self.slot, samples)
