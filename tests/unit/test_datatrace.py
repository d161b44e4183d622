"""The desired switch files: job names, validation of names and values, one directory per job."""

from __future__ import annotations

import pytest

from agent.kube.jobs import job_of
from agent.datatrace.desired import (Keep, PodInfo, SwitchConfigMap, desired, directory_name,
                                       parse_directory_name)

SWITCH = b'{"CommunicationOperator":"off","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}'


def pod(ns="team-a", name="p0", job="llama", uses=True, running=True):
    return PodInfo(ns, name, job, uses, running)


def cm(ns="team-a", job="llama", value=SWITCH):
    return {(ns, f"data-trace-{job}"): SwitchConfigMap(ns, f"data-trace-{job}", value)}


def test_job_name_from_the_first_label_present_in_the_device_plugin_order():
    assert job_of({"deploy-name": "d", "training.kubeflow.org/job-name": "k", "volcano.sh/job-name": "v"}) == "v"
    assert job_of({"deploy-name": "d", "training.kubeflow.org/job-name": "k"}) == "k"
    assert job_of({"deploy-name": "d"}) == "d"
    assert job_of({"volcano.sh/job-name": "", "deploy-name": "d"}) == "d"
    assert job_of({"app": "x"}) is None


def test_a_local_job_gets_its_configmap_value_byte_for_byte():
    want = desired([pod(), pod(name="p1")], cm())
    assert want.directories == {"team-a.data-trace-llama": SWITCH} and not want.rejected


def test_a_job_without_configmap_gets_a_directory_and_no_file():
    assert desired([pod()], {}).directories == {"team-a.data-trace-llama": None}


def test_pods_that_do_not_train_here_or_finished_get_nothing():
    pods = [pod(uses=False), pod(job=None, name="p2"), pod(running=False, name="p3")]
    assert desired(pods, cm()).directories == {}


def test_a_configmap_without_a_local_pod_writes_nothing():
    assert desired([pod(job="other")], cm()).directories == {"team-a.data-trace-other": None}


@pytest.mark.parametrize("namespace, job", [
    ("team-a", "../etc"), ("team-a", "a/b"), ("team-a", ".."), ("team-a", "Upper"), ("team-a", "a" * 243),
    ("..", "llama"), ("team_a", "llama"), ("a" * 64, "llama"), ("", "llama"), ("team-a", "-x"),
])
def test_names_that_are_not_kubernetes_names_never_become_paths(namespace, job):
    want = desired([pod(ns=namespace, job=job)], cm(ns=namespace, job=job))
    assert want.directories == {}
    assert len(want.rejected) == 1 and "not a valid directory name" in want.rejected[0][1]


def test_a_directory_name_longer_than_one_path_component_is_refused():
    assert directory_name("a" * 63, "b" * 181) is None  # 63 + 1 + 11 + 181 > 255 bytes
    assert directory_name("a" * 63, "b" * 180) is not None
    assert directory_name("a" * 63, "b" * 170) is not None


@pytest.mark.parametrize("value, reason", [
    (b'{"Step":"on"', "not valid JSON"), (b"on", "not valid JSON"), (b"", "not valid JSON"),
    (b'{"x":"' + b"a" * (1 << 20) + b'"}', "larger than"), (None, "no profilingSwitch key"),
])
def test_a_bad_switch_value_keeps_the_previous_file_and_says_why(value, reason):
    want = desired([pod()], cm(value=value))
    assert want.directories == {"team-a.data-trace-llama": Keep.PREVIOUS}
    assert want.rejected[0][0] == "configmap team-a/data-trace-llama" and reason in want.rejected[0][1]


def test_only_valid_directory_names_parse_back_as_ours():
    assert parse_directory_name("team-a.data-trace-llama.v2") == ("team-a", "llama.v2")
    for name in ("team-a.data-trace-", "lost+found", "team-a.reset-config-llama", "x.data-trace-../y",
                 "TEAM.data-trace-x", "profilingSwitch"):
        assert parse_directory_name(name) is None
