"""Profiling switch files: the real agent, its real Kubernetes client and a Kubernetes API stand-in.

Whatever order pods and ConfigMaps come and go in, across a watch broken by 410 and agent
restarts, the files under datatrace.root converge to: one directory per job with a pod on this
node, holding the ConfigMap's profilingSwitch byte for byte.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from testkit.wait import wait_until

NODE = "test-node"
ON = '{"CommunicationOperator":"off","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}'
OFF = '{"CommunicationOperator":"off","Step":"off","SaveCheckpoint":"off","FP":"off","DataLoader":"off"}'


def pod(ns: str, name: str, job: str, node: str = NODE, label: str = "volcano.sh/job-name",
        phase: str = "Running", mount: bool = True) -> dict:
    container = {"name": "train", "image": "train:1"}
    if mount:
        container["volumeMounts"] = [{"name": "dt", "mountPath": "/user/cluster-info/datatrace-config"}]
    return {"kind": "Pod", "metadata": {"namespace": ns, "name": name, "labels": {label: job}},
            "spec": {"nodeName": node, "containers": [container]}, "status": {"phase": phase}}


def switch_cm(ns: str, job: str, value: str | None, reset: bool = True) -> dict:
    return {"kind": "ConfigMap",
            "metadata": {"namespace": ns, "name": f"data-trace-{job}", "labels": {"reset": "true"} if reset else {}},
            "data": {} if value is None else {"profilingSwitch": value}}


def tree(root: Path) -> dict[str, str | None]:
    """{directory: switch file content or None} under root."""
    if not root.is_dir():
        return {}
    result = {}
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            switch = entry / "profilingSwitch"
            result[entry.name] = switch.read_text() if switch.exists() else None
    return result


def converges(root: Path, want: dict, timeout: float = 5.0) -> None:
    wait_until(lambda: tree(root) == want, timeout, f"datatrace tree == {want} (is {tree(root)})")


@pytest.fixture
def datatrace(start_agent, kube, tmp_path):
    standin, kubeconfig = kube
    root = tmp_path / "datatrace"

    def start(kubernetes: dict | None = None):
        agent, _ = start_agent(kubernetes=kubernetes or {"enabled": True},
                               datatrace={"enabled": True, "root": str(root)}, env={"KUBECONFIG": kubeconfig})
        return agent

    return standin, root, start


def test_pod_first_then_configmap_updates_and_deletions(datatrace):
    standin, root, start = datatrace
    agent = start()
    standin.put(pod("team-a", "llama-0", "llama"))
    converges(root, {"team-a.data-trace-llama": None})
    standin.put(switch_cm("team-a", "llama", ON))
    converges(root, {"team-a.data-trace-llama": ON})
    assert oct((root / "team-a.data-trace-llama" / "profilingSwitch").stat().st_mode & 0o777) == "0o644"
    standin.put(switch_cm("team-a", "llama", OFF))
    converges(root, {"team-a.data-trace-llama": OFF})
    standin.delete("ConfigMap", "team-a", "data-trace-llama")
    converges(root, {"team-a.data-trace-llama": None})
    standin.put(switch_cm("team-a", "llama", ON))
    converges(root, {"team-a.data-trace-llama": ON})
    standin.delete("Pod", "team-a", "llama-0")
    converges(root, {})
    assert agent.metric("npu_agent_datatrace_switch_files") == 0
    assert agent.metric("npu_agent_datatrace_operations_total", operation="removed_dirs") == 1


def test_configmap_first_other_nodes_and_the_last_local_pod(datatrace):
    standin, root, start = datatrace
    start()
    standin.put(switch_cm("team-b", "gpt", ON))
    standin.put(switch_cm("team-b", "elsewhere", ON))
    standin.put(pod("team-b", "elsewhere-0", "elsewhere", node="other-node"))
    standin.put(pod("team-b", "gpt-0", "gpt", label="training.kubeflow.org/job-name"))
    standin.put(pod("team-b", "gpt-1", "gpt", label="training.kubeflow.org/job-name"))
    standin.put(pod("team-b", "web-0", "web", mount=False))  # not a training pod: no NPU, no datatrace mount
    converges(root, {"team-b.data-trace-gpt": ON})
    standin.delete("Pod", "team-b", "gpt-0")  # the device plugin would remove the directory here
    standin.put(switch_cm("team-b", "gpt", OFF))
    converges(root, {"team-b.data-trace-gpt": OFF})
    standin.put(pod("team-b", "gpt-1", "gpt", label="training.kubeflow.org/job-name", phase="Succeeded"))
    converges(root, {})


def test_a_watch_broken_by_410_relists_and_converges(datatrace):
    standin, root, start = datatrace
    standin.put(switch_cm("ns1", "unused", OFF))  # so that the first lists have a version > 0 ("any")
    agent = start()
    standin.put(pod("ns1", "a-0", "a"))
    converges(root, {"ns1.data-trace-a": None})
    # The API server goes away; meanwhile things change and its history is compacted, so the
    # agent's watches, resuming from the last version they saw, get 410 Gone and must relist.
    standin.stop()
    standin.put(switch_cm("ns1", "a", ON))
    standin.put(pod("ns1", "b-0", "b"))
    standin.delete("Pod", "ns1", "a-0")
    standin.put(pod("ns1", "a-1", "a"))
    standin.compact()
    standin.start()
    converges(root, {"ns1.data-trace-a": ON, "ns1.data-trace-b": None}, timeout=10)
    for watch in ("pods", "configmaps"):
        assert agent.metric("npu_agent_kube_watch_restarts_total", watch=watch, reason="expired") >= 1
        assert agent.metric("npu_agent_kube_lists_total", watch=watch) >= 2
    standin.delete("Pod", "ns1", "a-1")  # and the new watches work
    converges(root, {"ns1.data-trace-b": None})


def test_watches_time_out_and_resume_without_relisting(datatrace):
    standin, root, start = datatrace
    agent = start(kubernetes={"enabled": True, "watch_timeout_seconds": 1})
    standin.put(pod("ns4", "a-0", "a"))
    converges(root, {"ns4.data-trace-a": None})
    wait_until(lambda: sum(1 for m, _ in standin.requests if m == "GET" and "watch=true" in _
                           and "/pods" in _) >= 3, 10, "watches resumed after their time-out")
    standin.put(switch_cm("ns4", "a", ON))
    converges(root, {"ns4.data-trace-a": ON})
    assert agent.metric("npu_agent_kube_lists_total", watch="pods") == 1


def test_changes_while_the_agent_is_down_converge_after_restart(datatrace):
    standin, root, start = datatrace
    agent = start()
    standin.put(pod("ns2", "x-0", "x"))
    standin.put(pod("ns2", "y-0", "y"))
    standin.put(switch_cm("ns2", "x", ON))
    standin.put(switch_cm("ns2", "y", ON))
    converges(root, {"ns2.data-trace-x": ON, "ns2.data-trace-y": ON})
    agent.stop()
    standin.delete("Pod", "ns2", "x-0")
    standin.put(switch_cm("ns2", "y", OFF))
    standin.put(pod("ns2", "z-0", "z"))
    start()
    converges(root, {"ns2.data-trace-y": OFF, "ns2.data-trace-z": None})


def test_bad_names_bad_values_and_symlinks_are_refused(datatrace, tmp_path):
    standin, root, start = datatrace
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "profilingSwitch").write_text("precious")
    root.mkdir()
    os.symlink(outside, root / "ns3.data-trace-linked")  # planted: must be neither followed nor removed
    (root / "unrelated").mkdir()  # not ours by name: left alone
    agent = start()
    standin.put(pod("ns3", "good-0", "good"))
    standin.put(switch_cm("ns3", "good", ON))
    converges(root, {"ns3.data-trace-good": ON, "unrelated": None})
    standin.put(switch_cm("ns3", "good", '{"Step": "on"'))  # not JSON: the previous file stays
    standin.put(pod("ns3", "evil-0", "../../etc"))
    standin.put(pod("ns3", "long-0", "j" * 250))
    standin.put(pod("ns3", "linked-0", "linked"))
    standin.put(switch_cm("ns3", "linked", OFF))
    wait_until(lambda: agent.metric("npu_agent_datatrace_rejected_total", reason="switch") == 1
               and agent.metric("npu_agent_datatrace_rejected_total", reason="name") == 2, 5, "rejections counted")
    wait_until(lambda: (agent.metric("npu_agent_datatrace_operations_total", operation="errors") or 0) >= 1, 5,
               "the symlinked directory refused")
    assert tree(root) == {"ns3.data-trace-good": ON, "unrelated": None}
    assert (outside / "profilingSwitch").read_text() == "precious"
    assert os.path.islink(root / "ns3.data-trace-linked")
    assert not (tmp_path / "etc").exists() and not any("etc" in p.name for p in root.iterdir())
    standin.put(switch_cm("ns3", "good", OFF))  # fixed: flushed again
    converges(root, {"ns3.data-trace-good": OFF, "unrelated": None})
    assert (outside / "profilingSwitch").read_text() == "precious"
    refusals = [r for r in agent.logs if r.get("msg") == "profiling switch not flushed"]
    assert {r["object"] for r in refusals} >= {"configmap ns3/data-trace-good", "pod ns3/evil-0", "pod ns3/long-0"}
    assert any("not valid JSON" in r["reason"] for r in refusals)


# Removes every directory made in the root the moment it is made. It runs SCHED_FIFO on the one
# CPU the agent is pinned to, so the kernel switches to it as soon as the agent's mkdir wakes it
# (the inotify event is queued inside the mkdir): the agent's next call always finds it gone.
REMOVER = r"""
import os, sys
from inotify_simple import INotify, flags
root, cpu = sys.argv[1], int(sys.argv[2])
os.sched_setaffinity(0, {cpu})
os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
inotify = INotify()
inotify.add_watch(root, flags.CREATE | flags.ONLYDIR)
print("ready", flush=True)
while True:
    for event in inotify.read():
        if event.mask & flags.ISDIR:
            try:
                os.rmdir(os.path.join(root, event.name))
            except OSError:
                continue
            print("removed", flush=True)
"""


def test_a_job_directory_removed_as_it_is_made_never_sends_a_write_outside_the_root(datatrace):
    standin, root, start = datatrace
    root.mkdir()
    agent = start()
    cwd = Path(os.readlink(f"/proc/{agent.process.pid}/cwd"))

    def strays() -> list[str]:  # a switch file or its temporary file, in the agent's working directory
        return sorted(p.name for p in cwd.iterdir() if p.name.lstrip(".").startswith("profilingSwitch"))

    assert strays() == []
    cpu = min(os.sched_getaffinity(0))
    remover = subprocess.Popen([sys.executable, "-c", REMOVER, str(root), str(cpu)], stdout=subprocess.PIPE, text=True)
    removals = []
    try:
        assert remover.stdout.readline() == "ready\n"
        threading.Thread(target=lambda: removals.extend(remover.stdout), daemon=True).start()
        for task in os.listdir(f"/proc/{agent.process.pid}/task"):  # threads made later inherit it
            os.sched_setaffinity(int(task), {cpu})
        standin.put(switch_cm("ns5", "race", ON))
        standin.put(pod("ns5", "race-0", "race"))

        def made_again():  # the first pass and the ones after it: each finds its directory gone
            assert not strays(), f"written outside the root, in {cwd}: {strays()}"
            return len(removals) >= 5

        wait_until(made_again, 30, "the sync to keep making the directory")
        remover.kill()
        remover.wait(10)
        converges(root, {"ns5.data-trace-race": ON}, timeout=90)  # at its next retry
        assert strays() == []
        standin.put(switch_cm("ns5", "race", OFF))
        converges(root, {"ns5.data-trace-race": OFF})
        assert agent.metric("npu_agent_datatrace_operations_total", operation="errors") >= 1
        assert agent.metric("npu_agent_task_restarts_total", task="datatrace/sync") is None
        assert agent.http("/readyz")[0] == 200
    finally:
        remover.kill()
        remover.wait(10)
        for task in os.listdir(f"/proc/{agent.process.pid}/task"):
            os.sched_setaffinity(int(task), os.sched_getaffinity(0))
        for name in strays():  # left by a writer that went around the root
            (cwd / name).unlink()


def test_listed_namespaces_are_watched_each_on_its_own_and_no_other(start_agent, kube, tmp_path):
    """agent.datatrace.namespaces: one watch per namespace (what per-namespace Roles allow); a job
    elsewhere gets no switch file."""
    standin, kubeconfig = kube
    root = tmp_path / "datatrace"
    agent, _ = start_agent(kubernetes={"enabled": True}, env={"KUBECONFIG": kubeconfig},
                           datatrace={"enabled": True, "root": str(root), "namespaces": ["team-a", "team-c"]})
    for namespace in ("team-a", "team-b", "team-c"):
        standin.put(pod(namespace, "job-0", "job"))
        standin.put(switch_cm(namespace, "job", ON))
    converges(root, {"team-a.data-trace-job": ON, "team-c.data-trace-job": ON, "team-b.data-trace-job": None})
    standin.put(switch_cm("team-c", "job", OFF))
    converges(root, {"team-a.data-trace-job": ON, "team-c.data-trace-job": OFF, "team-b.data-trace-job": None})
    assert agent.wait_for_log("datatrace sync started")["namespaces"] == ["team-a", "team-c"]
