"""Label names every dashboard and alert relies on, checked over every family of every collector of the
agent (those without a series included: each family keeps its label names)."""

from __future__ import annotations

from agent.steps.consumer import StepMetrics
from agent.steps.reasons import PARSE_ERRORS
from agent.steps.metrics import StepCollector
from tests.support import gendocs

JOB_LABELS = {"node", "namespace", "job_name", "job_id"}


def test_no_family_has_a_label_named_job():
    # `job` is Prometheus's own target label: with honorLabels the agent's value would replace it.
    families = gendocs.metric_families()
    assert "npu_agent_taskd_proxy_connected" in families  # the proxy's families are among them
    assert [name for name, (_, labels, _) in families.items() if "job" in labels] == []


def test_every_training_family_of_a_job_names_the_job_in_full():
    families = {name: set(labels) for name, (_, labels, _) in gendocs.metric_families().items()
                if name.startswith("training_")}
    per_node = {"training_profiling_parse_errors_total"}  # see its HELP: not every reason has a job
    assert [name for name, labels in families.items() if name not in per_node and not JOB_LABELS <= labels] == []
    # Below the job, a family is per rank or per worker (a TP group, named by its first rank), or
    # `training_node_*`: the job's ranks on this node together.
    assert [name for name, labels in families.items() if "job_id" in labels and not name.startswith("training_node_")
            and not labels & {"rank", "worker"}] == []
    assert all("pp_stage" in labels for name, labels in families.items() if "worker" in labels)


def test_unknown_jobs_are_named_by_their_id_a_lone_pod_is_the_ranks_and_parse_errors_start_at_0(tmp_path):
    known = {"uid-1": ("team-a", "llama")}
    steps = StepMetrics(tmp_path / "steps.json", job_labels=lambda job_id: known.get(job_id, ("", "")))
    assert steps.job_labels("uid-1") == ("team-a", "llama")
    assert steps.job_labels("uid-2") == ("_unknown", "uid-2")
    assert StepMetrics(tmp_path / "other.json").job_labels("uid-1") == ("_unknown", "uid-1")  # no pod watch

    pods = {"uid-1": ("llama-0",), "uid-3": ("a-0", "a-1")}
    steps = StepMetrics(tmp_path / "steps.json", job_pods=lambda job_id: pods.get(job_id, ()))
    assert [steps.pod_of(job) for job in ("uid-1", "uid-2", "uid-3")] == ["llama-0", "", ""]  # one pod: that one

    [errors] = [f for f in StepCollector("n", lambda: steps).collect() if f.name == "training_profiling_parse_errors"]
    assert {s.labels["reason"]: s.value for s in errors.samples if s.name.endswith("_total")} == \
        dict.fromkeys(PARSE_ERRORS, 0)
