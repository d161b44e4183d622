"""Every long-lived task of the agent runs supervised (agent.lifecycle): none can die silently.

The agent runs in this process with every component enabled, against the stand-ins, so the test
can list the asyncio tasks it created. A task the agent starts outside agent.lifecycle is either
scoped to one request or connection (it ends with it; the list below says which) or a bug."""

from __future__ import annotations

import asyncio
from pathlib import Path

import agent
from agent.app import serve
from agent.config import config_from_dict
from testkit.fakes.clusterd import ClusterdStandIn
from testkit.wait import until

AGENT_DIR = str(Path(agent.__file__).parent)

# Coroutines the agent runs per request or connection; each ends with what it serves.
PER_REQUEST = {
    "HttpEndpoint._serve",  # one HTTP connection
    "HttpEndpoint._render",  # one /metrics rendering, shared by the requests that arrive meanwhile
    "TaskdProxy._read_acks",  # one worker stream's acknowledgements
    "ManagerLink._deliver",  # one message on its way to a manager
    "ManagerLink._listen",  # one manager connection's down-stream (its link's supervised task awaits it)
    "DeviceMonitor._poll", "DeviceMonitor._read",  # one read of one device (awaited, or spawned with its errors logged)
    "FaultLog._append_in_order", "FaultLog._commit_in_order",  # one write of the fault log, awaited (shielded)
}


def agent_tasks(*mine: asyncio.Task) -> list[tuple[str, str]]:
    """(qualified name of the coroutine, task name) of the tasks running the agent's code."""
    found = []
    for task in asyncio.all_tasks():
        coro = task.get_coro()
        code = getattr(coro, "cr_code", None)
        if code is not None and code.co_filename.startswith(AGENT_DIR) and task not in mine:
            found.append((coro.__qualname__, task.get_name()))
    return found


def test_every_long_lived_task_runs_supervised(tmp_path, kube, monkeypatch):
    standin, kubeconfig = kube
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    root = tmp_path / "profiling"
    (root / "job-a" / "0").mkdir(parents=True)

    async def main(clusterd_port: int) -> list[tuple[str, str]]:
        config = config_from_dict({
            "node_name": "test-node", "state_dir": str(tmp_path / "state"),
            "log": {"level": "warning"},
            "http": {"listen": "127.0.0.1:0"}, "grpc": {"listen": "127.0.0.1:0"},
            "devices": {"backend": "simulated", "poll_interval_seconds": 1},
            "clusterd": {"enabled": True, "address": f"127.0.0.1:{clusterd_port}"},
            "kubernetes": {"enabled": True, "device_info_configmap": True,
                           "pod_resources_socket": str(tmp_path / "kubelet.sock")},
            "profiling": {"root": str(root)},
            "datatrace": {"enabled": True, "root": str(tmp_path / "datatrace")},
            "taskd_proxy": {"enabled": True, "listen": "127.0.0.1:0"},
        }, environ={})
        stop = asyncio.Event()
        started: list = []
        run = asyncio.create_task(serve(config, stop, on_started=started.append))

        def ready() -> bool:
            assert not run.done(), run.result()  # it ended before it was ready: stop waiting
            return bool(started) and started[0].readiness.check()[0]

        await until(ready, 30, lambda: f"readiness, now {started and started[0].readiness.check()}", 0.05)
        running = agent_tasks(run, asyncio.current_task())
        stop.set()
        assert await run == 0
        return running

    with ClusterdStandIn() as clusterd:
        running = asyncio.run(main(clusterd.port))
    supervised = {name for qualname, name in running if qualname == "Tasks._supervise"}
    unsupervised = [(qualname, name) for qualname, name in running
                    if qualname != "Tasks._supervise" and qualname not in PER_REQUEST]
    assert not unsupervised, f"tasks outside agent.lifecycle: {unsupervised}"
    assert {"clusterd-sink/delivery", "configmap-sink/writer", "pod-attribution/refresh"} <= supervised, supervised
