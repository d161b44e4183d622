"""The node TaskD proxy end to end: the real agent between TaskNet worker and manager peers, each a
separate process with its own environment, two jobs on one node with the same positions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from contextlib import contextmanager

import pytest

from testkit import REPO
from testkit.agent import AgentProcess
from testkit.fakes.tasknet.driver import MGR, free_port, manager, pos, worker
from testkit.wait import wait_until

JOBS = {"job-a": "127.0.0.2", "job-b": "127.0.0.3"}  # each job's manager on its own host, same port
RANKS = range(4)


class Node:
    """The agent with its proxy, and per job a manager peer and four worker peers."""

    def __init__(self, tmp_path, kubeconfig: str = "", listen: str = "127.0.0.1:0", **proxy_settings):
        self.manager_port = free_port(JOBS.values())
        self.agent = AgentProcess(tmp_path, {
            "devices": {"backend": "simulated"}, "profiling": {"metrics": False, "disk_guard": False},
            "kubernetes": {"enabled": bool(kubeconfig), "pod_resources_socket": ""},
            "taskd_proxy": {"enabled": True, "listen": listen, "manager_port": self.manager_port,
                            "dial_timeout_seconds": 1, **proxy_settings}},
            env={"KUBECONFIG": kubeconfig} if kubeconfig else None).start()
        listening = self.agent.wait_for_log("TaskD proxy listening")
        self.proxy = f"127.0.0.1:{listening['address'].rsplit(':', 1)[1]}"
        self.managers = {}
        self.workers = {}

    def start_manager(self, job, config=None):
        self.managers[job] = manager(f"{JOBS[job]}:{self.manager_port}", config=config)
        return self.managers[job]

    def env(self, job, rank):
        return {"MINDX_TASK_ID": job, "MASTER_ADDR": JOBS[job], "RANK": str(rank)}

    def start_worker(self, job, rank, **kwargs):
        peer = worker(self.proxy, 0, rank, env=self.env(job, rank), **kwargs)
        self.workers[job, rank] = peer
        return peer

    def start_job(self, job, ranks=RANKS):
        """The job's manager and its workers, once the manager has every worker's path."""
        mgr = self.start_manager(job)
        for rank in ranks:
            self.start_worker(job, rank)
        wait_until(lambda: len(mgr.events("path")) >= len(ranks), 10, f"{len(ranks)} path discoveries")
        return mgr

    def close(self):
        peers = [*self.workers.values(), *self.managers.values()]
        for peer in peers:  # all told first: each takes ~0.1 s to exit, and they need not take turns
            if peer.process.poll() is None:
                try:
                    peer.send(op="quit")
                except (BrokenPipeError, ValueError, OSError):
                    pass  # gone already; stop() below reaps it
        for peer in peers:
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
        for r in RANKS:  # the manager's own report may trail the worker's ack through another pipe
            received(mgr, f"up-{job}-{r}")
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
    # No call was taken for another process's: no worker was refused, or lost its stream to a join of the
    # same position counted in the wrong job.
    assert [peer.name for peer in n.workers.values() if peer.events("stream_lost")] == []
    assert n.agent.metric("npu_agent_taskd_proxy_connections_refused_total") == 0
    assert n.agent.metric("npu_agent_taskd_proxy_connected", job_id="job-a", role="Worker") == 4
    assert n.agent.metric("npu_agent_taskd_proxy_messages_total", direction="up", result="delivered") == 8


def test_manager_restart_loses_no_accepted_message_and_reaches_workers_again(node):
    n = node()
    mgr = n.start_job("job-a")
    first = n.workers["job-a", 0].transfer(MGR, sync=True, uuid="before")
    assert first["code"] == 0

    mgr.kill()
    n.agent.wait_for_log("TaskD manager unreachable; holding messages for it", job="job-a")
    # Messages sent while the manager is dead are held; their callers wait for the real ack.
    held = [f"held-{rank}-{i}" for rank in RANKS for i in range(5)]
    for uid in held:
        n.workers["job-a", int(uid.split("-")[1])].send(op="send", uuid=uid, dst=MGR, body=uid, sync=True,
                                                         mtype="DEFAULT")
    wait_until(lambda: n.agent.metric("npu_agent_taskd_proxy_queue_depth", job_id="job-a") == len(held), 10,
               "all messages held")

    restarted = n.start_manager("job-a")
    # The proxy registers again and replays every worker's path; then the held messages arrive.
    wait_until(lambda: len(restarted.events("path")) >= 4, 10, "paths replayed to the new manager")
    for uid in held:
        rank = int(uid.split("-")[1])
        sent = n.workers["job-a", rank].wait_event(lambda e: e.get("event") == "sent" and e["uuid"] == uid)
        assert sent["code"] == 0, sent
    for uid in held:
        received(restarted, uid)
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
    assert n.agent.metric("npu_agent_taskd_proxy_manager_connects_total", job_id="job-a") == 2


def test_disconnected_worker_leaves_routing_and_unreachable_manager_is_reported(node):
    n = node(hold_seconds=1, queue_limit=2)
    mgr = n.start_job("job-a", ranks=(0, 1))
    n.workers["job-a", 1].stop()
    n.agent.wait_for_log("TaskD process disconnected; its routes removed", position="Worker/0/1")
    sent = mgr.transfer(pos("Worker", 0, 1), sync=True, body="gone?")
    assert sent["code"] == 5002  # no route: the proxy forgot the worker
    assert n.agent.metric("npu_agent_taskd_proxy_connected", job_id="job-a", role="Worker") == 1

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


def test_with_kubernetes_a_worker_speaks_only_for_the_job_of_its_pod(pod_cgroup, kube, node):
    # (In this order, the peers are stopped before their cgroups are removed.)
    standin, kubeconfig = kube
    uids = {}  # the API server gives each pod its UID
    for job in ("job-a", "job-b"):
        created = standin.put({
            "kind": "Pod", "metadata": {"namespace": "team", "name": f"{job}-0", "labels": {"volcano.sh/job-name": job}},
            "spec": {"nodeName": "test-node", "containers": [
                {"name": "train", "image": "t:1", "env": [{"name": "MINDX_TASK_ID", "value": job}]}]}})
        uids[job] = created["metadata"]["uid"]
    n = node(kubeconfig=kubeconfig)
    wait_until(lambda: n.agent.http("/readyz")[0] == 200, 20, "the agent ready: the node's pods listed")
    mgr = n.start_manager("job-a")
    peer = worker(n.proxy, 0, 0, env=n.env("job-a", 0), cgroup=pod_cgroup(uids["job-a"]))
    n.workers["job-a", 0] = peer
    assert received(mgr, peer.transfer(MGR, sync=True)["uuid"])  # its pod is job-a's: through
    # A process of job-b's pod that claims to be job-a's is refused, and says why.
    impostor = worker(n.proxy, 0, 1, env=n.env("job-a", 1), cgroup=pod_cgroup(uids["job-b"]), wait_ready=False)
    n.workers["job-b", 1] = impostor
    refused = refusals_of(n.agent, impostor, wait=10)[0]
    assert "belongs to job job-b (team/job-b)" in refused["reason"], refused
    assert refusals_of(n.agent, peer) == []
    assert n.agent.metric("npu_agent_taskd_proxy_connected", job_id="job-a", role="Worker") == 1


def refusals_of(agent, peer, wait: float = 0) -> list[dict]:
    """The agent's "refused a connection" lines about `peer`'s process (waiting up to `wait` s for one)."""
    def mine():
        return [r for r in list(agent.logs) if r.get("msg") == "TaskD proxy refused a connection"
                and r["reason"].startswith(f"pid {peer.process.pid} ")]
    return wait_until(mine, wait, f"a refusal of {peer.name}") if wait else mine()


def reached(mgr, peer):
    """The manager's sync unicast to `peer` came back acknowledged by that worker itself."""
    sent = mgr.transfer(peer.pos, body="ping", sync=True)
    return sent["code"] == 0 and sent["ack_src"] == peer.pos, sent


# A manager slow from its first call: the link's set-up (a path replay per worker, then the three held
# messages) lasts 2 s in the first round and 0.6 s more each round, several times what a worker takes
# to join (0.3-0.5 s here).
SLOW_SETUP = {"path_delay": 0.2, "transfer_delay": 0.6}


def test_routes_are_never_lost_whatever_the_order_of_joins(node):
    """Workers join before the manager is up, while the proxy's link to it is being set up (the
    manager answers path discoveries slowly and held messages are still going out), and after.
    Every round restarts the manager; afterwards every worker so far must be reachable from it."""
    n = node()
    peers = []
    for round_ in range(4):
        before = n.start_worker("job-a", 3 * round_)
        peers.append(before)
        for i in range(3):  # held for the absent manager: the link is busy flushing them later
            before.send(op="send", uuid=f"held-{round_}-{i}", dst=MGR, body="", sync=True, mtype="DEFAULT")
        wait_until(lambda: n.agent.metric("npu_agent_taskd_proxy_queue_depth", job_id="job-a") == 3, 10,
                   "three messages held")
        mgr = n.start_manager("job-a", config=SLOW_SETUP)
        mgr.wait_event(lambda e: e["event"] == "registered" and e["pos"]["role"] == "Proxy", 15)
        # The proxy is registered and now replays paths and flushes the held messages: join now
        # (the proxy answers a join at once, link or not).
        during = n.start_worker("job-a", 3 * round_ + 1)
        peers.append(during)
        # Joined: the slowness has done its part, and the rest of the set-up may go at full speed.
        mgr.config(path_delay=0, transfer_delay=0)
        wait_until(lambda: n.agent.metric("npu_agent_taskd_proxy_manager_up", job_id="job-a") == 1, 20, "link up")
        # It did join during the set-up: the link counted it among the workers it announced on connecting.
        connected = n.agent.wait_for_log("connected to the TaskD manager", job="job-a")
        assert connected["workers_announced"] == len(peers), (round_, connected)
        peers.append(n.start_worker("job-a", 3 * round_ + 2))
        for i in range(3):
            sent = before.wait_event(lambda e: e.get("event") == "sent" and e["uuid"] == f"held-{round_}-{i}")
            assert sent["code"] == 0, sent
        lost = [peer.pos for peer in peers if not reached(mgr, peer)[0]]
        assert lost == [], f"round {round_}: the manager has no route to {lost}"
        mgr.kill()
        n.agent.wait_for_log("TaskD manager unreachable; holding messages for it", job="job-a")
        n.agent.logs.clear()


def test_proxy_restart_every_worker_rejoins_and_is_reached(node):
    n = node(listen=f"127.0.0.1:{free_port()}")  # the workers dial the same address again
    mgr = n.start_job("job-a")
    for restart in range(2):
        marks = {rank: n.workers["job-a", rank].mark() for rank in RANKS}
        n.agent.stop()
        n.agent.start()
        for rank in RANKS:
            n.workers["job-a", rank].wait_event("rejoined", 20, since=marks[rank])
        wait_until(lambda: n.agent.metric("npu_agent_taskd_proxy_manager_up", job_id="job-a") == 1, 20, "link up")
        for rank in RANKS:
            peer = n.workers["job-a", rank]
            ok, sent = reached(mgr, peer)
            assert ok, (restart, sent)
            up = peer.transfer(MGR, sync=True, uuid=f"up-{restart}-{rank}")
            assert (up["code"], up["ack_src"]) == (0, MGR)


def test_rank_lists_and_broadcasts_as_taskd_routes_them(node):
    n = node()
    mgr = n.start_job("job-a")
    sender = n.workers["job-a", 0]
    # A rank list is one key to TaskD: no route, and no worker would take it anyway.
    for dst in (pos("Worker", 0, "1,2"), pos("Worker", "All", "1,2"), pos("Worker", 1, "All")):
        sent = sender.transfer(dst, body="list", sync=True)
        assert sent["code"] == 5002 and "NO_ROUTE" in sent["error"], (dst, sent)
    # The manager broadcasts one copy per route it has through this proxy (four); each worker
    # receives the message once, and the extra copies are counted.
    sent = mgr.transfer(pos("Worker", "All", "All"), body="everyone", uuid="bcast")
    assert sent["code"] == 0 and len(sent["hops"]) == 4
    for rank in RANKS:
        peer = n.workers["job-a", rank]
        marker = mgr.transfer(peer.pos, body="marker", sync=True)  # arrives after any broadcast copy
        assert marker["code"] == 0
        received(peer, marker["uuid"])
        assert uuids_received(peer).count("bcast") == 1, uuids_received(peer)
        assert not peer.events("dropped")
    wait_until(lambda: n.agent.metric("npu_agent_taskd_proxy_messages_total", direction="down",
                                      result="duplicate") == 3, 10, "three duplicate copies counted")
    # Worker to worker broadcast within the node: each other worker once (the sender's own copy
    # stays in its process at TaskD's sender, so it never sends Worker/0/All up).
    sent = mgr.transfer(pos("Worker", 0, "All"), body="node 0", uuid="node0")
    assert sent["code"] == 0
    for rank in RANKS:
        received(n.workers["job-a", rank], "node0")


def vm_kib(pid: int, key: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def test_a_flood_of_held_messages_is_bounded_in_bytes(node):
    """105 MiB for an absent manager, one 7 MiB message after another: the 16 MiB budget holds two,
    the rest are refused with RecvBufBusy at once, and the agent's peak memory stays bounded."""
    n = node(job_buffer_mb=16, node_buffer_mb=16, hold_seconds=60)
    peer = n.start_worker("job-a", 0)  # its job and the job's (failing) manager link exist now
    pid = n.agent.process.pid
    before = vm_kib(pid, "VmRSS")
    uids = [f"big-{i}" for i in range(15)]
    outcome = {}
    for uid in uids:
        held = n.agent.metric("npu_agent_taskd_proxy_queue_depth", job_id="job-a")
        peer.send(op="send", uuid=uid, dst=MGR, body_size=7 << 20, sync=True, mtype="DEFAULT")
        outcome[uid] = wait_until(
            lambda: next((e["code"] for e in peer.events("sent") if e["uuid"] == uid), None)
            or ("held" if n.agent.metric("npu_agent_taskd_proxy_queue_depth", job_id="job-a") > held else None),
            30, f"{uid} refused or held")
    held = [uid for uid in uids if outcome[uid] == "held"]
    assert [outcome[uid] for uid in uids] == ["held"] * 2 + [5001] * 13, outcome
    assert n.agent.metric("npu_agent_taskd_proxy_buffer_bytes", job_id="job-a") > 14 << 20
    assert n.agent.metric("npu_agent_taskd_proxy_overflows_total", job_id="job-a") == 13
    grown_mib = (vm_kib(pid, "VmHWM") - before) / 1024
    assert grown_mib < 100, f"the agent grew {grown_mib:.0f} MiB holding 14 MiB of messages"
    n.agent.wait_for_log("TaskD proxy refused a message: no room (RecvBufBusy 5001)", job="job-a")
    # The two that fitted are delivered once the manager comes, and the budget is empty again.
    mgr = n.start_manager("job-a")
    for uid in held:
        sent = peer.wait_event(lambda e: e.get("event") == "sent" and e["uuid"] == uid, 30)
        assert sent["code"] == 0, sent
        assert len(received(mgr, uid)["body"]) == 7 << 20
    assert sorted(u for u in uuids_received(mgr) if u.startswith("big-")) == held
    wait_until(lambda: n.agent.metric("npu_agent_taskd_proxy_buffer_bytes", job_id="job-a") == 0, 10, "budget empty")


REGISTER = '{"msg_type":"REGISTER","code":101,"message":"","extension":null}'
# A manager that takes 1.5 s to install a down stream it accepted (TaskD's handler runs late on a busy
# manager) and answers every REGISTER at once with an ACTION, once.
SLOW_STREAM = {"stream_delay": 1.5, "register_reply": 710}


@contextmanager
def busy(threads: int = 2):
    """Busy-looping threads for the duration: every process of the test gets less of the (shared) CPU."""
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    spinners = [threading.Thread(target=spin, name="busy", daemon=True) for _ in range(threads)]
    for t in spinners:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in spinners:
            t.join()


def assert_registers_answered(mgr, registers: dict) -> None:
    """Each REGISTER ({worker peer: uuid}) delivered once with the manager's ack, and the ACTION the
    manager answered it with at once delivered to that worker; nothing reached the manager before the
    proxy's down stream was installed."""
    for peer, uid in registers.items():
        sent = peer.wait_event(lambda e: e.get("event") == "sent" and e["uuid"] == uid, 30)
        assert (sent["code"], sent["ack_src"]) == (0, MGR), sent
        answer = mgr.wait_event(lambda e: e["event"] == "action_sent" and e.get("reply_to") == uid, 30)
        assert (answer["code"], answer["ack_src"], answer["error"]) == (0, peer.pos, None), answer
        action = json.loads(received(peer, answer["uuid"])["body"])
        assert (action["msg_type"], action["code"]) == ("ACTION", 710)
    assert sorted(uuids_received(mgr)) == sorted(registers.values())  # none lost, none twice
    events = mgr.events()
    installed = next(i for i, e in enumerate(events) if e["event"] == "stream" and e["pos"]["role"] == "Proxy")
    first_up = next(i for i, e in enumerate(events) if e["event"] == "received")
    assert installed < first_up, "a message reached the manager before its stream to the proxy was installed"


def test_after_a_manager_restart_held_messages_wait_for_its_stream(node):
    """The restarted manager takes a moment to install the proxy's down stream and answers each held
    REGISTER at once: flushed before the stream is there, the answer is lost (6002)."""
    n = node()
    n.start_job("job-a", ranks=(0, 1)).kill()
    n.agent.wait_for_log("TaskD manager unreachable; holding messages for it", job="job-a")
    registers = {}
    for rank in (0, 1):
        peer = n.workers["job-a", rank]
        registers[peer] = f"register-{rank}"
        peer.send(op="send", uuid=f"register-{rank}", dst=MGR, body=REGISTER, sync=True, mtype="default")
    wait_until(lambda: n.agent.metric("npu_agent_taskd_proxy_queue_depth", job_id="job-a") == 2, 10, "both held")
    with busy():
        restarted = n.start_manager("job-a", config=SLOW_STREAM)
        assert_registers_answered(restarted, registers)
    connects = wait_until(lambda: [r for r in list(n.agent.logs) if r.get("msg") == "connected to the TaskD manager"
                                   and r.get("job") == "job-a"][1:], 10, "the second connect logged")
    assert connects[-1]["stream_checks"] > 1  # it did wait for the stream (the first check came too early)


def test_at_a_jobs_first_connect_nothing_goes_up_before_the_managers_stream(node):
    """Workers send REGISTER as soon as they have joined, as TaskD's do, while the proxy's link to the
    job's manager is still opening: the manager's answers must reach them."""
    n = node()
    with busy():
        mgr = n.start_manager("job-a", config=SLOW_STREAM)
        peers = [n.start_worker("job-a", rank, wait_ready=False) for rank in (0, 1)]
        registers = {}
        for rank, peer in enumerate(peers):
            peer.wait_event("ready", 30)
            registers[peer] = f"register-{rank}"
            peer.send(op="send", uuid=f"register-{rank}", dst=MGR, body=REGISTER, sync=True, mtype="default")
        assert_registers_answered(mgr, registers)
