"""Attributing a TCP connection to a training job through /proc (the proxy's PeerResolver), with real
processes holding real sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from pathlib import Path

import pytest
from kubernetes import client

from agent.kube.jobs import JobDirectory
from agent.taskd.peers import PeerRefused, PeerResolver, parse_peer

HOLD = "import socket, sys; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); sys.stdin.read()"
# The same from a given local port (0: any), which another socket may share (SO_REUSEADDR on both).
HOLD_FROM = ("import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
             "s.bind(('127.0.0.1', int(sys.argv[2]))); s.connect(('127.0.0.1', int(sys.argv[1]))); sys.stdin.read()")


@pytest.fixture
def listener():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server


def connect(listener, env: dict, cgroup: Path | None = None, from_port: int | None = None):
    """A child process with `env` (in `cgroup`) connected to `listener` (from `from_port`, shared, when given):
    (process, the listener's end, the child's address as gRPC names it)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("MINDX_TASK_ID", "MASTER_ADDR", "MS_SCHED_HOST")}
    join = (lambda: (cgroup / "cgroup.procs").write_text("0")) if cgroup else None
    to = str(listener.getsockname()[1])
    command = [HOLD, to] if from_port is None else [HOLD_FROM, to, str(from_port)]
    child = subprocess.Popen([sys.executable, "-c", *command], env={**clean, **env}, stdin=subprocess.PIPE,
                             preexec_fn=join)
    listener.settimeout(20)
    conn, (host, port) = listener.accept()
    return child, conn, f"ipv4:{host}:{port}"


def port_of(listener) -> int:
    return listener.getsockname()[1]


def test_connection_is_traced_to_its_process_and_job(listener):
    child, conn, peer = connect(listener, {"MINDX_TASK_ID": "job-7f3a", "MASTER_ADDR": "10.0.0.8", "RANK": "12"})
    try:
        resolver = PeerResolver()
        found = resolver.resolve(peer, port_of(listener))
        assert (found.pid, found.job, found.manager_host, found.rank) == (child.pid, "job-7f3a", "10.0.0.8", "12")
        assert resolver.cached(peer) == found  # one readlink while the socket lives
    finally:
        child.stdin.close()
        child.wait(10)
        conn.close()
    assert resolver.cached(peer) is None  # the process and its socket are gone: resolved afresh next time


def test_a_caller_is_told_from_another_jobs_process_with_the_same_local_address(listener):
    """Linux gives one ephemeral port to connections to different destinations, so on a busy node another
    process may hold a socket from the caller's very address: only the one connected to the proxy is the caller,
    whichever of the two the socket table lists first."""
    children = []
    with socket.socket() as elsewhere:
        elsewhere.bind(("127.0.0.1", 0))
        elsewhere.listen()
        try:
            child_a, conn_a, peer = connect(listener, {"MINDX_TASK_ID": "job-a", "MASTER_ADDR": "10.0.0.2"}, from_port=0)
            children.append((child_a, conn_a))
            child_b, conn_b, peer_b = connect(elsewhere, {"MINDX_TASK_ID": "job-b", "MASTER_ADDR": "10.0.0.3"},
                                              from_port=parse_peer(peer)[1])
            children.append((child_b, conn_b))
            assert peer_b == peer  # both sockets have the same local address
            for server, child, job in ((listener, child_a, "job-a"), (elsewhere, child_b, "job-b")):
                found = PeerResolver().resolve(peer, port_of(server))
                assert (found.pid, found.job) == (child.pid, job), server
        finally:
            for child, conn in children:
                child.stdin.close()
                child.wait(10)
                conn.close()


def test_manager_host_follows_taskds_launcher_rules(listener):
    cases = [({"MS_SCHED_HOST": "10.1.1.1"}, "10.1.1.1"), ({}, "127.0.0.1"),
             ({"MASTER_ADDR": "10.0.0.8", "LOCAL_PROXY_ENABLE": "on"}, "127.0.0.1")]
    for env, host in cases:
        child, conn, peer = connect(listener, {"MINDX_TASK_ID": "job", **env})
        try:
            assert PeerResolver().resolve(peer, port_of(listener)).manager_host == host, env
        finally:
            child.stdin.close()
            child.wait(10)
            conn.close()


@pytest.mark.parametrize("env, reason", [({}, "has no MINDX_TASK_ID"),
                                         ({"MINDX_TASK_ID": "../etc"}, "is not a valid job id")])
def test_processes_outside_training_jobs_are_refused_with_the_reason(listener, env, reason):
    child, conn, peer = connect(listener, env)
    try:
        with pytest.raises(PeerRefused, match=reason) as refused:
            PeerResolver().resolve(peer, port_of(listener))
        assert f"pid {child.pid}" in str(refused.value)
    finally:
        child.stdin.close()
        child.wait(10)
        conn.close()


def test_addresses_that_are_not_local_tcp_connections():
    with pytest.raises(PeerRefused, match="not a TCP connection"):
        parse_peer("unix:/run/x.sock")
    assert parse_peer("ipv6:[::1]:9602") == ("::1", 9602)
    with pytest.raises(PeerRefused, match="hostNetwork"):
        PeerResolver().resolve("ipv4:127.0.0.1:1", 9602)  # nothing connected from there


class PodList:
    """In place of the shared pod watch: hands the real JobDirectory the pods a test lists."""

    def __init__(self):
        self.synced = False
        self._subscribers = []

    def subscribe(self, convert, on_change) -> None:
        self._subscribers.append((convert, on_change))

    def set(self, *pods: client.V1Pod) -> None:
        self.synced = True
        for convert, on_change in self._subscribers:
            on_change({(p.metadata.namespace, p.metadata.name): convert(p) for p in pods if convert(p)})


def pod(uid: str, job: str) -> client.V1Pod:
    return client.V1Pod(metadata=client.V1ObjectMeta(namespace="team-a", name=f"{job}-0", uid=uid,
                                                     labels={"volcano.sh/job-name": job}),
                        spec=client.V1PodSpec(containers=[client.V1Container(
                            name="train", env=[client.V1EnvVar(name="MINDX_TASK_ID", value=job)])]))


UID_A, UID_B, UID_GONE = (f"{n}1234abc-0000-4111-8222-333344445555" for n in "abc")


def test_with_kubernetes_the_process_pod_must_belong_to_the_job_it_claims(listener, pod_cgroup):
    pods = PodList()
    resolver = PeerResolver(jobs=JobDirectory(pods))
    cases = [  # (cgroup of, claimed job, refusal or None)
        (UID_A, "job-a", "pods are not listed yet"),
        (UID_A, "job-a", None),
        (UID_B, "job-a", f"belongs to job job-b \\(team-a/job-b\\)"),
        (UID_GONE, "job-a", "not a pod of a training job"),
        (None, "job-a", "not in a Kubernetes pod"),
    ]
    for index, (uid, job, refusal) in enumerate(cases):
        if index == 1:
            pods.set(pod(UID_A, "job-a"), pod(UID_B, "job-b"))
        child, conn, peer = connect(listener, {"MINDX_TASK_ID": job}, pod_cgroup(uid) if uid else None)
        try:
            if refusal is None:
                assert resolver.resolve(peer, port_of(listener)).job == job
            else:
                with pytest.raises(PeerRefused, match=refusal):
                    resolver.resolve(peer, port_of(listener))
        finally:
            child.stdin.close()
            child.wait(10)
            conn.close()


def test_the_pod_uid_is_read_from_cgroupfs_and_systemd_cgroup_paths(tmp_path):
    from agent.taskd.peers import pod_uid

    lines = {
        1: "0::/kubepods/burstable/pod1234abcd-0000-4111-8222-333344445555/0123456789ab\n",
        2: "12:pids:/kubepods.slice/kubepods-besteffort.slice/"
           "kubepods-besteffort-pod1234abcd_0000_4111_8222_333344445555.slice/cri-containerd-0a.scope\n",
        3: "0::/system.slice/sshd.service\n",
    }
    for pid, text in lines.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
    assert pod_uid(str(tmp_path), 1) == pod_uid(str(tmp_path), 2) == "1234abcd-0000-4111-8222-333344445555"
    assert pod_uid(str(tmp_path), 3) is None and pod_uid(str(tmp_path), 4) is None
