"""Slow workers found on realistic jobs across nodes: the agents' real step pipelines on simulated
nodes, their scrapes judged by the chart's rules under the real promtool (testkit.training).

One run of five jobs, each on nodes of its own, all finishing before the end of the run; each test
asserts on the alerts that fired. Every job here made the detector before this one wrong
(docs/steps.md, "Detection: what is found, how fast, how often it is wrong"):
* the published 64-rank job (dp4 pp4 tp4), one worker 2.5x from the first step: nothing was found
  (its TP group is 4 of its node's 8 stage-0 ranks, and at most max(1, 5 %) could be slow);
* tp8 on 8-rank nodes, a whole node is one worker, 10 % slower from step 30: the node rule could
  never see it;
* sequence-length imbalance (the published spread, nobody slow; here with GC pauses of a third
  of a forward on a quarter of the ranks every 10 steps, and a 20 s checkpoint every 50):
  innocent ranks were blamed;
* stage imbalance (the last of 4 stages 2.07x): no signal at all;
* one rank per worker, 10 % slower from the start: found only at its 24th step;
* every finished job: lag alerts on every rank, and a straggler "confirmed" from frozen values.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from testkit.training import SlowWorker, TrainingJob
from testkit.training.cluster import Cluster
from testkit.training.promtool import PROMTOOL, Recording, fired

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed: install Debian's `prometheus` "
                                                         "package; CI does (.ci/run)")
WARMUP = 20
TAIL_S = 240.0  # simulated after the last job ended


def jobs() -> dict[str, TrainingJob]:
    return {job.job_id: job for job in (
        TrainingJob(job_id="published", tp=4, dp=4, pp=4, seed=1, steps=40, step_s=23.5, forward_s=7.0,
                    slow=(SlowWorker(4, 2.5),)),
        TrainingJob(job_id="tp8", tp=8, dp=4, pp=2, seed=2, steps=60, step_s=5.0, forward_s=2.0,
                    slow=(SlowWorker(16, 1.10, from_step=30),)),
        TrainingJob(job_id="seq", tp=2, dp=32, pp=2, seed=3, steps=120, step_s=9.07, forward_s=3.0,
                    seq_imbalance=True, gc_every=10, gc_s=1.0, checkpoint_every=50, checkpoint_s=20.0),
        TrainingJob(job_id="stage", tp=1, dp=2, pp=4, seed=4, steps=250, step_s=2.17, forward_s=0.5,
                    stage_factors=(1, 1, 1, 2.07)),
        TrainingJob(job_id="easy", tp=1, dp=8, pp=2, seed=5, steps=60, step_s=5.0, forward_s=2.0,
                    slow=(SlowWorker(3, 1.10),)),
    )}


MEMORY_FS = Path("/dev/shm")


@contextmanager
def node_states(fallback: Path):
    """Where the simulated nodes keep their step state. Each node saves it (written, fsynced, renamed,
    as on a real node) at every scrape that counted steps: some 3,000 saves in this run, 35 nodes' worth
    in a few seconds, which cost 7-11 s of disk waits here and more on a disk shared with other jobs.
    What is saved does not matter to this test (restarts: tests/integration/test_step_metrics.py), so
    it goes to a memory file system when the machine has one."""
    if MEMORY_FS.is_dir() and os.access(MEMORY_FS, os.W_OK | os.X_OK):
        with tempfile.TemporaryDirectory(prefix="stragglers-", dir=MEMORY_FS) as path:
            yield Path(path)
    else:
        yield fallback


# The jobs share no node, so the run is split over two processes and their scrapes merged: the
# sequence-length job (two thirds of the work) beside the four others.
SPLIT = (("seq",), ("published", "tp8", "stage", "easy"))


def simulate(job_ids: tuple[str, ...], until: float, states: Path) -> tuple[float, Recording]:
    """Those jobs on their nodes, scraped slot by slot up to `until`: (the run's start, the scrapes)."""
    every = jobs()
    cluster = Cluster([every[job_id] for job_id in job_ids], states)
    recording = Recording()
    cluster.run(until, recording.add)
    return cluster.start, recording


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("stragglers")
    cluster_jobs = jobs()
    assert sorted(sum(SPLIT, ())) == sorted(cluster_jobs)
    until = max(j.last_wall for j in cluster_jobs.values()) + TAIL_S
    with node_states(directory / "nodes") as states, \
            ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:  # no fork of pytest
        other = pool.submit(simulate, SPLIT[0], until, states)
        start, recording = simulate(SPLIT[1], until, states)
        other_start, other_recording = other.result()
    # The same start and slots: together their series are what one process would have recorded.
    assert (other_start, other_recording.slots) == (start, recording.slots)
    recording.series.update(other_recording.series)
    alerts = fired(recording, directory / "promtool")
    return start, cluster_jobs, alerts


def of(alerts, job_id: str) -> list:
    return [a for a in alerts if a.labels.get("job_id") == job_id]


def steps_by(job: TrainingJob, start: float, seconds: float) -> int:
    """The last step that had ended `seconds` into the run (begun at `start`)."""
    at = start + seconds
    return max((s for s in range(1, job.steps + 1) if job.step_end(s) <= at), default=0)


def test_the_published_slow_worker_is_one_alert_naming_its_tp_group(run):
    start, all_jobs, alerts = run
    [alert] = of(alerts, "published")
    assert alert.name == "TrainingWorkerStraggler"
    assert {k: alert.labels[k] for k in ("worker", "ranks", "node", "pp_stage", "reason")} == {
        "worker": "4", "ranks": "4-7", "node": "published-n0", "pp_stage": "0", "reason": "compute"}
    # Found once a window of 8 judged steps is full: within 10 of its steps after the warm-up.
    assert steps_by(all_jobs["published"], start, alert.first_s) <= WARMUP + 10


def test_a_whole_node_that_is_one_worker_is_found_across_nodes(run):
    start, all_jobs, alerts = run
    [alert] = of(alerts, "tp8")
    assert (alert.labels["worker"], alert.labels["ranks"], alert.labels["node"]) == ("16", "16-23", "tp8-n2")
    assert 30 < steps_by(all_jobs["tp8"], start, alert.first_s) <= 30 + 10


def test_random_sequence_length_imbalance_raises_nothing(run):
    assert of(run[2], "seq") == []


def test_stage_imbalance_is_a_job_signal_not_a_worker_fault(run):
    start, all_jobs, alerts = run
    [alert] = of(alerts, "stage")
    assert (alert.name, alert.labels["cause"], alert.labels["severity"]) == ("TrainingJobSlow", "stage", "info")


def test_one_rank_per_worker_is_found_within_ten_steps_after_warm_up(run):
    start, all_jobs, alerts = run
    [alert] = of(alerts, "easy")
    assert (alert.labels["worker"], alert.labels["ranks"]) == ("3", "3")
    assert steps_by(all_jobs["easy"], start, alert.first_s) <= WARMUP + 10


def test_finished_jobs_raise_nothing_and_their_alerts_resolve(run):
    start, all_jobs, alerts = run
    assert not [a for a in alerts if a.name == "TrainingProfilingLagHigh"]
    for alert in alerts:
        end = all_jobs[alert.labels["job_id"]].last_wall - start
        assert alert.first_s <= end, alert
        assert alert.last_s <= end + 40, alert  # TaskD's last write, 30 s of grace, one evaluation
