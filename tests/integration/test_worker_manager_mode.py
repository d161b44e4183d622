"""TaskD's manager-driven profiling switch through the real node agent's TaskD proxy.

A training process (`testkit.fakes.mspti.trainer`: `agent.worker` on the fake libmspti, a separate
process, since the proxy tells jobs apart by each caller's own environment) registers with its
job's manager (the TaskNet manager stand-in) through the agent's proxy; the manager's ACTION
commands come down through the proxy and switch MSPTI, the worker's STATUS replies go up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from agent.steps import records
from testkit.agent import AgentProcess
from testkit.fakes.mspti.trainer import Trainer, trainer_env
from testkit.fakes.tasknet.driver import free_port, manager
from testkit.wait import wait_until

MANAGER_HOST = "127.0.0.2"  # the job's MASTER_ADDR: its manager listens there
MARKER = 1
ALL_OFF = dict(CommunicationOperator="off", Step="off", SaveCheckpoint="off", FP="off", DataLoader="off")


def start_agent(tmp_path: Path, manager_port: int) -> tuple[AgentProcess, str]:
    """The agent with only its TaskD proxy doing anything; returns it and the proxy's address."""
    agent = AgentProcess(tmp_path, {
        "devices": {"backend": "simulated"}, "profiling": {"metrics": False, "disk_guard": False},
        "kubernetes": {"enabled": False, "pod_resources_socket": ""},
        "taskd_proxy": {"enabled": True, "listen": "127.0.0.1:0", "manager_port": manager_port,
                        "dial_timeout_seconds": 1}}).start()
    listening = agent.wait_for_log("TaskD proxy listening")
    return agent, f"127.0.0.1:{listening['address'].rsplit(':', 1)[1]}"


def lines(root: Path, job: str, rank: int) -> int:
    rank_dir = root / job / str(rank)
    if not rank_dir.is_dir():
        return 0
    return sum((rank_dir / name).read_bytes().count(b"\n") for name in os.listdir(rank_dir))


def act(mgr, code: int, status: int, name: str = "Worker3") -> None:
    since = mgr.mark()
    done = mgr.action(code)
    assert done["workers"] == [name]
    sent = mgr.wait_event(lambda e: e.get("event") == "action_sent" and e["name"] == name, 5, since)
    # acknowledged by the worker itself, relayed by the proxy
    assert (sent["code"], sent["error"], sent["ack_src"]) == (0, None, {"role": "Worker", "server_rank": "1",
                                                                        "process_rank": "3"}), sent
    mgr.wait_event(lambda e: e.get("event") == "status" and e["name"] == name and e["code"] == status, 10, since)


def test_the_manager_switches_profiling_through_the_agents_proxy(fake_mspti_path, tmp_path):
    manager_port = free_port([MANAGER_HOST])
    agent, proxy = start_agent(tmp_path, manager_port)
    mgr = manager(f"{MANAGER_HOST}:{manager_port}")
    root, switch = tmp_path / "profiling", tmp_path / "profilingSwitch"
    switch.write_text(json.dumps(ALL_OFF))
    job = "job-via-proxy"
    me = {"role": "Worker", "server_rank": "1", "process_rank": "3"}
    trainer = None
    try:
        # rank 3 of a job with two processes per node: node rank 1
        trainer = Trainer(3, trainer_env(fake_mspti_path, root, switch, MINDX_TASK_ID=job, MASTER_ADDR=MANAGER_HOST,
                                         RANK="3", LOCAL_WORLD_SIZE="2", NPU_AGENT_TASKD_PROXY=proxy))
        assert trainer.started["init"] is True and trainer.started["start"] is True
        registered = mgr.wait_event("worker_registered", 20)
        assert registered == {"event": "worker_registered", "name": "Worker3", "pos": me}
        wait_until(lambda: trainer.stats()["manager_mode"], 10, "manager mode")
        # It came through the proxy: the manager knows only the proxy, and reaches the worker through it.
        proxies = [e["pos"] for e in mgr.events("registered")]
        assert proxies and {p["role"] for p in proxies} == {"Proxy"}, proxies
        paths = [e["path"] for e in mgr.events("path")]
        assert any(path == [me, p] for path in paths for p in proxies), paths

        act(mgr, 710, 1410)
        trainer.emit("step 1", "default", 100)
        wait_until(lambda: lines(root, job, 3) == 100, 15, "100 records on disk")

        act(mgr, 711, 1411)
        trainer.emit("hccl", "communication", 50)
        wait_until(lambda: lines(root, job, 3) == 150, 15, "150 records on disk")

        act(mgr, 700, 1400)
        filtered = trainer.emit("step 2", "default", 30)["filtered"]
        assert filtered >= 30 and not trainer.state() & (1 << MARKER)

        mgr.action(700)  # the same command again: acked, applied nowhere, no STATUS
        wait_until(lambda: trainer.stats()["actions"] == 4, 10, "the repeated ACTION handled")
        act(mgr, 711, 1411)
        assert [e["code"] for e in mgr.events("status")] == [1410, 1411, 1400, 1411]
        # (the manager sees a STATUS before the worker's call returns and counts it)
        wait_until(lambda: trainer.stats()["statuses_sent"] == 4, 10, "four statuses counted")
        stats = trainer.stats()
        assert (stats["actions"], stats["manager_register_tries"], stats["manager_joins"]) == (5, 1, 1)
    finally:
        code = trainer.stop() if trainer is not None else 0
        mgr.stop()
        agent.stop()
    assert code == 0, trainer.stderr()[-3000:]
    rank_dir = root / job / "3"
    data = b"".join((rank_dir / n).read_bytes() for n in sorted(os.listdir(rank_dir)))
    parsed = records.parse(data)
    assert parsed.errors == [] and len(parsed.markers) == 150
    domains = [m[records.DOMAIN] for m in parsed.markers]
    assert domains.count(b"default") == 100 and domains.count(b"communication") == 50
