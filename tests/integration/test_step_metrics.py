"""Step-latency metrics end to end: TaskD-format files written live while the real agent runs; /metrics scraped."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from agent.demo.job import DemoJob
from agent.demo.synthetic import RankTiming
from testkit.wait import wait_until

JOB = "0f4c1ad2-job-uid"
FILE = "1800000000"
STEP_S = 0.5
# Without the pod watch a job is named by its id, in a namespace no real one can be called.
NO_KUBE = dict(namespace="_unknown", job_name=JOB, job_id=JOB)


class Writer:
    """Four ranks of one job in two pipeline stages, writing steps as TaskD would, split mid-line."""

    def __init__(self, root):
        self.job = DemoJob(root, job_id=JOB, ranks=4, stages=2, step_s=STEP_S, slow_after_s=10**9, started=1.8e9)
        self.job.prepare()
        self.step, self.start_s = 1, 1.8e9
        self.pending = [""] * 4

    def steps(self, count: int, slow_rank: int | None = None) -> None:
        for _ in range(count):
            timings = self.job.model.step(self.step)
            if slow_rank is not None:
                slow = timings[slow_rank]
                extra = slow.forward_s * 0.3
                timings = [RankTiming(t.rank, t.duration_s + extra, t.forward_s + (extra if t.rank == slow_rank else 0),
                                      t.dataloader_s, 0.0) for t in timings]
            for t in timings:
                self.pending[t.rank] += "".join(self.job.records(t, self.step, self.start_s))
            self.start_s += max(t.duration_s for t in timings)
            self.step += 1

    def flush(self, keep_partial: bool = False) -> None:
        """Append what is pending; with keep_partial, hold back the second half of the last line."""
        for rank, text in enumerate(self.pending):
            cut = len(text) - 40 if keep_partial and text else len(text)
            self.job.append(rank, FILE, text[:cut])
            self.pending[rank] = text[cut:]


def steps_counted(agent, rank: int) -> float | None:
    return agent.metric("training_steps_completed_total", **NO_KUBE, rank=rank,
                        pp_stage=rank // 2)


def test_live_records_become_step_metrics_a_slow_rank_is_flagged_and_a_restart_counts_nothing_twice(
        start_agent, tmp_path):
    root = tmp_path / "profiling"
    writer = Writer(root)
    agent, _ = start_agent(profiling={"root": str(root)})
    # Every reason is there from the start, so that an alert's rate() sees the first bad line.
    wait_until(lambda: agent.metric("training_profiling_parse_errors_total", reason="not_json") == 0, 10,
               "the parse errors at 0")

    writer.steps(30)
    writer.flush(keep_partial=True)  # a write may end inside a line
    writer.steps(50)
    writer.flush()
    wait_until(lambda: all(steps_counted(agent, r) == 80 for r in range(4)), 10, "80 steps of every rank")
    labels = dict(**NO_KUBE, rank=3, pp_stage=1)
    assert agent.metric("training_step_duration_seconds_count", clock="device", **labels) == 80
    total = agent.metric("training_step_duration_seconds_sum", clock="device", **labels)
    assert 80 * STEP_S * 0.95 < total < 80 * STEP_S * 1.05
    # The distributions are the job's on the node: every rank's steps in one histogram.
    assert agent.metric("training_node_step_duration_seconds_count", clock="device", **NO_KUBE) == 4 * 80
    assert agent.metric("training_node_phase_duration_seconds_count", phase="forward", **NO_KUBE) == 4 * 80
    assert agent.metric("training_node_step_duration_seconds_bucket", clock="device", le="+Inf", **NO_KUBE) == 4 * 80
    assert abs(agent.metric("training_step_last_completed_timestamp_seconds", **labels) - writer.start_s) < 0.01
    assert 0.95 * STEP_S < agent.metric("training_step_baseline_seconds", **labels) < 1.05 * STEP_S
    assert agent.metric("training_rank_slow", reason="compute", **labels) == 0
    assert agent.metric("training_profiling_records_total", **NO_KUBE, rank=3) == 80 * 14
    assert agent.metric("training_profiling_lag_seconds", **NO_KUBE, rank=3) >= 0
    # Every series of a training family names its job in full (an empty label would be no label).
    # (The rank's pod is not known without the pod watch: testkit matches an empty pod_name without
    # its pod labels, namespace among them.)
    assert agent.metric("training_rank_info", job_name=JOB, job_id=JOB, rank=3) == 1
    training = [dict(labels) for name, labels in agent.metrics()
                if name.startswith("training_") and name not in ("training_rank_info", "training_worker_info")]
    assert agent.metric("training_worker_info", job_name=JOB, job_id=JOB, worker=3, ranks=3, pp_stage=1) == 1
    assert all(labels.items() >= NO_KUBE.items() for labels in training if "job_id" in labels)
    assert all("job_id" in labels for labels in training if not labels.keys() <= {"reason"})

    # Bad lines are counted by reason and skipped; the steps around them still count.
    writer.job.append(0, FILE, "this is not json\n" + '{"Kind":1,"Flag":"2"}\n')
    writer.steps(5)
    writer.flush()
    wait_until(lambda: steps_counted(agent, 0) == 85, 10, "steps after the bad lines")
    assert agent.metric("training_profiling_parse_errors_total", reason="not_json") == 1
    assert agent.metric("training_profiling_parse_errors_total", reason="missing_field") == 1

    # Rank 2's forward 30 % slower: flagged on its fourth slow step (half its window of 8), the others not.
    onset = time.monotonic()
    writer.steps(4, slow_rank=2)
    writer.flush()
    wait_until(lambda: agent.metric("training_rank_slow", **NO_KUBE, rank=2, pp_stage=1,
                                    reason="compute") == 1, 10, "rank 2 flagged")
    assert time.monotonic() - onset < 5
    for rank in (0, 1, 3):
        assert agent.metric("training_rank_slow", **NO_KUBE, rank=rank,
                            pp_stage=rank // 2, reason="compute") == 0
    wait_until(lambda: all(steps_counted(agent, r) == 89 for r in range(4)), 10, "89 steps")

    # Restart: what was written while the agent was down is counted once, what it had counted is not again.
    agent.stop()
    writer.steps(7)
    writer.flush()
    agent, _ = start_agent(profiling={"root": str(root)})
    writer.steps(3)
    writer.flush()
    wait_until(lambda: all(steps_counted(agent, r) == 10 for r in range(4)), 10, "the 10 new steps of every rank")
    deadline = time.monotonic() + 1.0  # and they stay there: no late duplicate
    while time.monotonic() < deadline:
        assert all(steps_counted(agent, r) == 10 for r in range(4))


def test_series_carry_the_namespace_and_job_name_of_the_local_pods(start_agent, kube, tmp_path):
    # The directory is named by MINDX_TASK_ID (the job's UID): a pod that sets it literally, or
    # whose controller has that UID, names the job; its job label gives the name.
    standin, kubeconfig = kube
    root = tmp_path / "profiling"
    standin.put({"kind": "Pod", "metadata": {"namespace": "team-a", "name": "llama-0",
                                             "labels": {"volcano.sh/job-name": "llama"}},
                 "spec": {"nodeName": "test-node", "containers": [
                     {"name": "train", "image": "t:1", "env": [{"name": "MINDX_TASK_ID", "value": JOB}]}]}})
    standin.put({"kind": "Pod", "metadata": {"namespace": "team-b", "name": "gpt-0", "ownerReferences": [
        {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "name": "gpt", "uid": "uid-gpt",
         "controller": True}]}, "spec": {"nodeName": "test-node", "containers": [{"name": "t", "image": "t:1"}]}})
    agent, _ = start_agent(kubernetes={"enabled": True}, profiling={"root": str(root)},
                           datatrace={"enabled": True, "root": str(tmp_path / "datatrace")},
                           env={"KUBECONFIG": kubeconfig})
    writer = Writer(root)
    other = DemoJob(root, job_id="uid-gpt", ranks=2, stages=1, step_s=STEP_S, started=1.8e9)
    other.prepare()
    writer.steps(3)
    writer.flush()
    for timing in other.model.step(1):
        other.append(timing.rank, FILE, "".join(other.records(timing, 1, 1.8e9)))
    wait_until(lambda: agent.metric("training_steps_completed_total", namespace="team-a", job_name="llama",
                                    job_id=JOB, rank=0, pp_stage=0) == 3, 10, "llama's steps with its labels")
    wait_until(lambda: agent.metric("training_steps_completed_total", namespace="team-b", job_name="gpt",
                                    job_id="uid-gpt", rank=1, pp_stage=0) == 1, 10, "gpt's step with its labels")
    assert agent.metric("training_node_slow", namespace="team-a", job_name="llama", job_id=JOB, reason="ranks") == 0
    # Each job has one pod here, so an alert can name a rank's pod.
    assert agent.metric("training_rank_info", namespace="team-a", job_name="llama", job_id=JOB, rank=3,
                        pod_name="llama-0") == 1
    assert agent.metric("training_rank_info", namespace="team-b", job_name="gpt", job_id="uid-gpt", rank=0,
                        pod_name="gpt-0") == 1
    assert agent.metric("training_profiling_lag_seconds", namespace="team-b", job_name="gpt", job_id="uid-gpt",
                        rank=0) >= 0
    # Job labels and datatrace share one list and one watch of this node's pods.
    pod_calls = [path for method, path in standin.requests if method == "GET" and path.startswith("/api/v1/pods")]
    assert [("watch=true" in path) for path in pod_calls] == [False, True], pod_calls


def test_a_job_directory_whose_name_is_not_utf8_is_skipped_and_every_scrape_answers(start_agent, tmp_path):
    root = tmp_path / "profiling"
    writer = Writer(root)
    bad = DemoJob(root, job_id=os.fsdecode(b"job-\xff"), ranks=1, stages=1, step_s=STEP_S, started=1.8e9)
    bad.prepare()  # there at start-up
    agent, _ = start_agent(profiling={"root": str(root)})
    later = DemoJob(root, job_id=os.fsdecode(b"\xfe"), ranks=1, stages=1, step_s=STEP_S, started=1.8e9)
    later.prepare()  # and one that appears while the agent runs
    for job in (bad, later):
        [timing] = job.model.step(1)
        job.append(0, FILE, "".join(job.records(timing, 1, 1.8e9)))
    writer.steps(3)
    writer.flush()
    wait_until(lambda: all(steps_counted(agent, r) == 3 for r in range(4)), 10, "the good job's steps")
    wait_until(lambda: agent.metric("training_profiling_parse_errors_total", reason="job_dir") == 2, 10,
               "both bad job directories counted")
    reports = [r for r in agent.logs if r.get("msg") == "bad profiling input skipped" and r.get("reason") == "job_dir"]
    assert sorted(r["detail"] for r in reports) == ["\\xfe", "job-\\xff"]
    assert not any(key[0].startswith("training_") and ("job_id", JOB) not in key[1] and "job_id" in dict(key[1])
                   for key in agent.metrics())  # no series of the bad jobs


@pytest.mark.parametrize("content", ['{"version": 1, "ranks": {"x/0": {"1": 1e400}}, "baselines": {}}',
                                     "[" * 100_000 + "]" * 100_000, '{"version": 1, "ranks": []}'])
def test_state_files_of_the_wrong_shape_are_moved_aside_and_the_agent_starts(start_agent, tmp_path, content):
    root, state = tmp_path / "profiling", tmp_path / "state"
    state.mkdir()
    for name in ("steps.json", "profiling-offsets.json"):
        (state / name).write_text(content)
    writer = Writer(root)
    agent, _ = start_agent(profiling={"root": str(root)})
    for what in ("step state", "profiling tailer state"):
        line = agent.wait_for_log(f"{what} of the wrong shape; moved aside, starting without it")
        assert Path(line["moved_to"]).read_text() == content
    writer.steps(3)
    writer.flush()
    wait_until(lambda: all(steps_counted(agent, r) == 3 for r in range(4)), 10, "steps counted after the restart")
    for name in ("steps.json", "profiling-offsets.json"):
        assert agent.metric("npu_agent_state_files_moved_aside_total", file=name) == 1
