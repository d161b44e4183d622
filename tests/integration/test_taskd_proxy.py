"""The node TaskD proxy end to end: the real agent between TaskNet worker and manager peers, each a
separate process with its own environment, two jobs on one node with the same positions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.fakes.tasknet.driver import MGR, free_port, manager, pos, worker
from tests.integration.harness import REPO, AgentProcess, wait_until

JOBS = {"job-a": "127.0.0.2", "job-b": "127.0.0.3"}  # each job's manager on its own host, same port
RANKS = range(4)


class Node:
    """The agent with its proxy, and per job a manager peer and four worker peers."""

    def __init__(self, tmp_path, kubeconfig: str = "", **proxy_settings):
        self.manager_port = free_port(JOBS.values())
        self.agent = AgentProcess(tmp_path, {
            "devices": {"backend": "simulated"}, "profiling": {"metrics": False, "disk_guard": False},
            "kubernetes": {"enabled": bool(kubeconfig), "pod_resources_socket": ""},
            "taskd_proxy": {"enabled": True, "listen": "127.0.0.1:0", "manager_port": self.manager_port,
                            "dial_timeout_seconds": 1, **proxy_settings}},
            env={"KUBECONFIG": kubeconfig} if kubeconfig else None).start()
        listening = self.agent.wait_for_log("TaskD proxy listening")
        self.proxy = f"127.0.0.1:{listening['address'].rsplit(':', 1)[1]}"
        self.managers = {}
        self.workers = {}

    def start_manager(self, job):
        self.managers[job] = manager(f"{JOBS[job]}:{self.manager_port}")
        return self.managers[job]

    def env(self, job, rank):
        return {"MINDX_TASK_ID": job, "MASTER_ADDR": JOBS[job], "RANK": str(rank)}

    def start_worker(self, job, rank, **kwargs):
        peer = worker(self.proxy, 0, rank, env=self.env(job, rank), **kwargs)
        self.workers[job, rank] = peer
        return peer

    def close(self):
        for peer in [*self.workers.values(), *self.managers.values()]:
            peer.stop()
        self.agent.stop()


@pytest.fixture
def node(tmp_path):
    nodes = []

    def make(**settings):
        nodes.append(Node(tmp_path, **settings))
        return nodes[-1]

    yield make
    for n in nodes:
        n.close()


def received(peer, uuid):
    return peer.wait_event(lambda e: e.get("event") == "received" and e["uuid"] == uuid)


def uuids_received(peer):
    return [e["uuid"] for e in peer.events("received")]


def test_two_jobs_with_the_same_positions_never_mix(node):
    n = node()
    for job in JOBS:
        n.start_manager(job)
        for rank in RANKS:
            n.start_worker(job, rank)
    for job, mgr in n.managers.items():
        # The manager sees one proxy and exactly its own four workers routed through it.
        registered = mgr.wait_event("registered")["pos"]
        assert registered["role"] == "Proxy" and registered["server_rank"] == "0"
        wait_until(lambda: len(mgr.events("path")) >= 4, 10, f"{job}: four path discoveries")
        routed = {json.dumps(dst, sort_keys=True) for dst, hop in mgr.routes() if hop == registered}
        assert routed == {json.dumps(pos("Worker", 0, r), sort_keys=True) for r in RANKS} | {
            json.dumps(registered, sort_keys=True)}

    # Up: every worker's message reaches its own job's manager only, with the manager's ack.
    for (job, rank), peer in n.workers.items():
        sent = peer.transfer(MGR, body=f'{{"from":"{job}/{rank}"}}', sync=True, uuid=f"up-{job}-{rank}")
        assert (sent["code"], sent["error"]) == (0, None)
        assert sent["ack_src"] == MGR
    for job, mgr in n.managers.items():
        assert sorted(uuids_received(mgr)) == [f"up-{job}-{r}" for r in RANKS]
        assert received(mgr, f"up-{job}-2")["body"] == f'{{"from":"{job}/2"}}'

    # Down, unicast and synchronous: only that job's worker 2 gets it, and its own ack comes back.
    sent = n.managers["job-a"].transfer(pos("Worker", 0, 2), body="to a2", sync=True, uuid="down-a2")
    assert (sent["code"], sent["ack_src"]) == (0, pos("Worker", 0, 2))
    assert received(n.workers["job-a", 2], "down-a2")["body"] == "to a2"

    # Broadcast: each of job b's workers exactly once.
    sent = n.managers["job-b"].transfer(pos("Worker", "All", "All"), body="all b", uuid="bcast-b")
    assert sent["code"] == 0
    for rank in RANKS:
        received(n.workers["job-b", rank], "bcast-b")

    # Worker to worker, through the proxy, inside the job.
    sent = n.workers["job-a", 0].transfer(pos("Worker", 0, 3), body="a0->a3", sync=True, uuid="local-a")
    assert (sent["code"], sent["ack_src"]) == (0, pos("Worker", 0, 3))
    received(n.workers["job-a", 3], "local-a")

    # Nothing crossed: job a's peers never saw b's traffic and the reverse; b's broadcast came once.
    for (job, rank), peer in n.workers.items():
        got = uuids_received(peer)
        assert all(u.endswith(job[-1] + str(rank)) or u.endswith("-" + job[-1]) or u == f"local-{job[-1]}"
                   for u in got), (job, rank, got)
        assert got.count("bcast-b") == (1 if job == "job-b" else 0)
    assert n.agent.metric("npu_agent_taskd_proxy_connected", job="job-a", role="Worker") == 4
    assert n.agent.metric("npu_agent_taskd_proxy_messages_total", direction="up", result="delivered") == 8


def test_manager_restart_loses_no_accepted_message_and_reaches_workers_again(node):
    n = node()
    mgr = n.start_manager("job-a")
    for rank in RANKS:
        n.start_worker("job-a", rank)
    wait_until(lambda: len(mgr.events("path")) >= 4, 10, "four path discoveries")
    first = n.workers["job-a", 0].transfer(MGR, sync=True, uuid="before")
    assert first["code"] == 0

    mgr.kill()
    n.agent.wait_for_log("TaskD manager unreachable; holding messages for it", job="job-a")
    # Messages sent while the manager is dead are held; their callers wait for the real ack.
    held = [f"held-{rank}-{i}" for rank in RANKS for i in range(5)]
    for uid in held:
        n.workers["job-a", int(uid.split("-")[1])].send(op="send", uuid=uid, dst=MGR, body=uid, sync=True,
                                                         mtype="DEFAULT")
    wait_until(lambda: n.agent.metric("npu_agent_taskd_proxy_queue_depth", job="job-a") == len(held), 10,
               "all messages held")

    restarted = n.start_manager("job-a")
    # The proxy registers again and replays every worker's path; then the held messages arrive.
    wait_until(lambda: len(restarted.events("path")) >= 4, 10, "paths replayed to the new manager")
    for uid in held:
        rank = int(uid.split("-")[1])
        sent = n.workers["job-a", rank].wait_event(lambda e: e.get("event") == "sent" and e["uuid"] == uid)
        assert sent["code"] == 0, sent
    assert sorted(uuids_received(restarted)) == sorted(held)
    # Held messages keep their order per sender.
    order = uuids_received(restarted)
    for rank in RANKS:
        mine = [u for u in order if u.startswith(f"held-{rank}-")]
        assert mine == [f"held-{rank}-{i}" for i in range(5)]
    # The workers never reconnected, yet the new manager reaches them.
    for rank in RANKS:
        assert not n.workers["job-a", rank].events("rejoined")
    sent = restarted.transfer(pos("Worker", 0, 1), body="after restart", sync=True, uuid="after")
    assert (sent["code"], sent["ack_src"]) == (0, pos("Worker", 0, 1))
    assert n.agent.metric("npu_agent_taskd_proxy_manager_connects_total", job="job-a") == 2


def test_disconnected_worker_leaves_routing_and_unreachable_manager_is_reported(node):
    n = node(hold_seconds=1, queue_limit=2)
    mgr = n.start_manager("job-a")
    for rank in (0, 1):
        n.start_worker("job-a", rank)
    wait_until(lambda: len(mgr.events("path")) >= 2, 10, "two path discoveries")
    n.workers["job-a", 1].stop()
    n.agent.wait_for_log("TaskD process disconnected; its routes removed", position="Worker/0/1")
    sent = mgr.transfer(pos("Worker", 0, 1), sync=True, body="gone?")
    assert sent["code"] == 5002  # no route: the proxy forgot the worker
    assert n.agent.metric("npu_agent_taskd_proxy_connected", job="job-a", role="Worker") == 1

    mgr.kill()
    n.agent.wait_for_log("TaskD manager unreachable; holding messages for it", job="job-a")
    sent = n.workers["job-a", 0].transfer(MGR, sync=True, uuid="lost", wait=10)
    assert sent["code"] == 6000 and "unreachable for 1 s" in sent["error"]
    # Three at once against a queue of two: one is refused at once as busy, two wait and expire.
    for uid in ("o1", "o2", "o3"):
        n.workers["job-a", 0].send(op="send", uuid=uid, dst=MGR, body=uid, sync=True, mtype="DEFAULT")
    codes = sorted(n.workers["job-a", 0].wait_event(lambda e: e.get("event") == "sent" and e["uuid"] == uid)["code"]
                   for uid in ("o1", "o2", "o3"))
    assert codes == [5001, 6000, 6000]
    assert n.agent.metric("npu_agent_taskd_proxy_messages_total", direction="up", result="not_delivered") == 4


def test_bad_input_gets_taskd_codes_and_strangers_are_refused(node):
    n = node()
    n.start_manager("job-a")
    peer = n.start_worker("job-a", 0)
    for dst, code in ((pos("Boss", 0), 4003), (pos("Worker", "x", 1), 4004), (pos("Worker", 0, "-5"), 4005),
                      (pos("Worker", 0, 9), 5002)):
        sent = peer.transfer(dst, sync=True)
        assert sent["code"] == code, (dst, sent)
        assert "TaskD code" in sent["error"]
    # A process that is not part of a training job: refused with the reason, and logged.
    script = ("import grpc, sys\nfrom agent._proto import tasknet_pb2 as pb, tasknet_pb2_grpc as g\n"
              "stub = g.TaskNetStub(grpc.insecure_channel(sys.argv[1]))\n"
              "try:\n    stub.Register(pb.RegisterReq(uuid='x', pos=pb.Position(role='Worker', serverRank='0',"
              " processRank='0')), timeout=10)\nexcept grpc.RpcError as e:\n    print(e.code().name, e.details())\n")
    env = {k: v for k, v in os.environ.items() if k != "MINDX_TASK_ID"}
    out = subprocess.run([sys.executable, "-c", script, n.proxy], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=30)
    assert out.stdout.startswith("PERMISSION_DENIED") and "no MINDX_TASK_ID" in out.stdout, out
    n.agent.wait_for_log("TaskD proxy refused a connection")
    assert n.agent.metric("npu_agent_taskd_proxy_connections_refused_total") == 1
    # The refused call changed nothing for the job's own worker.
    assert peer.transfer(MGR, sync=True)["code"] == 0


def test_with_kubernetes_a_worker_speaks_only_for_the_job_of_its_pod(node, kube, pod_cgroup):
    standin, kubeconfig = kube
    uids = {}  # the API server gives each pod its UID
    for job in ("job-a", "job-b"):
        created = standin.put({
            "kind": "Pod", "metadata": {"namespace": "team", "name": f"{job}-0", "labels": {"volcano.sh/job-name": job}},
            "spec": {"nodeName": "test-node", "containers": [
                {"name": "train", "image": "t:1", "env": [{"name": "MINDX_TASK_ID", "value": job}]}]}})
        uids[job] = created["metadata"]["uid"]
    n = node(kubeconfig=kubeconfig)
    mgr = n.start_manager("job-a")
    peer = worker(n.proxy, 0, 0, env=n.env("job-a", 0), cgroup=pod_cgroup(uids["job-a"]))
    n.workers["job-a", 0] = peer
    assert received(mgr, peer.transfer(MGR, sync=True)["uuid"])  # its pod is job-a's: through
    # A process of job-b's pod that claims to be job-a's is refused, and says why.
    impostor = worker(n.proxy, 0, 1, env=n.env("job-a", 1), cgroup=pod_cgroup(uids["job-b"]), wait_ready=False)
    n.workers["job-b", 1] = impostor
    refused = n.agent.wait_for_log("TaskD proxy refused a connection")
    assert "belongs to job job-b (team/job-b)" in refused["reason"], refused
    assert n.agent.metric("npu_agent_taskd_proxy_connected", job="job-a", role="Worker") == 1
