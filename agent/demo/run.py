"""`npu-node-agent demo`: the agent on a simulated 8-NPU node with scripted faults, on one machine.

The demo writes a normal configuration (plus its scenario and customization files) into its work
directory and runs the same agent `run` would, so what it shows is what a node would show; the
files stay behind for `npu-node-agent run --config <workdir>/config.yaml`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable

import yaml

from agent.config import config_from_dict, load_config
from agent.demo.changes import LEGEND, Lines, first_readings_line
from agent.demo.clusterd import DemoClusterd
from agent.demo.job import DemoJob, disk_summary
from agent.demo.kubelet import NAMESPACE, DemoKubelet
from agent.model import Change, DeviceState, Health, Snapshot
from agent.diskguard.guard import DiskGuard
from agent.steps.records import RankKey
from agent.steps.consumer import StepMetrics

# Times in seconds from the start; the scenario repeats every 60 s.
SCENARIO = {
    "repeat_every": 60,
    "steps": [
        {"at": 2, "device": 1, "action": "occur", "code": "80E18402", "severity": 3},  # SeparateNPU
        {"at": 4, "device": 3, "action": "occur", "code": "80C98009", "via": "poll"},  # no event: polling finds it
        {"at": 6, "device": 5, "action": "occur", "code": "80E18005"},  # RestartNPU, 1st time
        {"at": 7, "device": 5, "action": "recover", "code": "80E18005"},
        {"at": 8, "device": 6, "action": "occur", "code": "81078603", "severity": 1},  # link down; duration rule
        {"at": 10, "device": 5, "action": "occur", "code": "80E18005"},  # 2nd time
        {"at": 11, "device": 5, "action": "recover", "code": "80E18005"},
        {"at": 14, "device": 1, "action": "recover", "code": "80E18402"},
        {"at": 16, "device": 5, "action": "occur", "code": "80E18005"},  # 3rd time: ManuallySeparateNPU
        {"at": 17, "device": 5, "action": "recover", "code": "80E18005"},
        {"at": 20, "device": 6, "action": "recover", "code": "81078603"},  # held PreSeparate for 10 s more
        {"at": 22, "device": 3, "action": "recover", "code": "80C98009", "via": "poll"},
        {"at": 24, "device": 7, "action": "drop"},  # card drop: health answers -8012
        {"at": 26, "device": 0, "action": "once", "code": "80E21007", "severity": 0},
        {"at": 36, "device": 7, "action": "restore"},
    ],
}

CUSTOMIZATION = {
    "FaultFrequency": [{"EventId": ["80E18005"], "TimeWindow": 3600, "Times": 3,
                        "FaultHandling": "ManuallySeparateNPU", "ReleaseTimeWindow": 60}],
    "FaultDuration": [{"EventId": ["81078603"], "FaultTimeout": 5, "RecoverTimeout": 10,
                       "FaultHandling": "PreSeparateNPU"}],
}


DEMO_DISK_LIMIT_MB = 1


def _free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
            return True
        except OSError:
            return False


def write_demo_files(workdir: Path, clusterd_port: int = 0, kubelet_socket: Path | None = None) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "scenario.yaml").write_text(yaml.safe_dump(SCENARIO, sort_keys=False))
    (workdir / "customization.json").write_text(json.dumps(CUSTOMIZATION, indent=2))
    http_port = 9410 if _free("127.0.0.1", 9410) else 0
    grpc_port = 9411 if _free("127.0.0.1", 9411) else 0
    config = {
        "node_name": "demo-node",
        "state_dir": str(workdir / "state"),
        "log": {"level": "info", "format": "json"},
        "http": {"listen": f"127.0.0.1:{http_port}"},
        "grpc": {"listen": f"127.0.0.1:{grpc_port}"},
        "devices": {"backend": "simulated", "poll_interval_seconds": 2,
                    "simulated": {"devices": 8, "chip_name": "910B3", "scenario": str(workdir / "scenario.yaml")}},
        "faults": {"customization_file": str(workdir / "customization.json")},
        # A simulated job writes profiling records here; the small limit puts the disk guard to work.
        "profiling": {"root": str(workdir / "profiling"), "disk_limit_mb": DEMO_DISK_LIMIT_MB},
        # npu-exporter's telemetry families, with values the simulated chips make up (they follow the load).
        "telemetry": {"enabled": True},
    }
    if clusterd_port:
        config["clusterd"] = {"enabled": True, "address": f"127.0.0.1:{clusterd_port}"}
    # Which pod holds which NPU, from the demo kubelet (no API server is needed for this).
    config["kubernetes"] = {"pod_resources_socket": str(kubelet_socket or ""), "pod_resources_refresh_seconds": 5}
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _pods(refs) -> str:
    return " ".join(f"[pod {p.namespace}/{p.pod}]" for p in refs)


def _ranks(ranks: list[int]) -> str:
    """0-15 for a full run, else the list."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def run_demo(duration: float, workdir: str | None, slow_after: float = 60.0, log_level: str = "info") -> int:
    from agent.app import serve
    from agent.common.logs import setup_logging

    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="npu-node-agent-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    log_file = open(root / "agent.log", "a", encoding="utf-8")
    setup_logging(log_level, "json", stream=log_file)

    def say(line: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {line}", flush=True)

    started = time.monotonic()

    async def main() -> int:
        stop = asyncio.Event()
        tasks: list[asyncio.Task] = []
        clusterd = DemoClusterd(set(config_from_dict({}).clusterd.public_codes.values()), say)
        await clusterd.start()
        kubelet = DemoKubelet(root, devices=8)
        await kubelet.start()
        config_path = write_demo_files(root, clusterd.port, kubelet.socket_path)
        config = load_config(str(config_path), environ={})
        config.log.level = log_level  # --log-level; the file keeps the demo's "info"

        def on_started(agent) -> None:
            http, grpc_port = agent.http.port, agent.grpc.port
            print(f"npu-node-agent demo: simulated 8-NPU node 'demo-node', scripted faults repeating every 60 s\n"
                  f"  metrics:      http://127.0.0.1:{http}/metrics   (npu_agent_device_fault, npu_chip_info_health_status, ...)\n"
                  f"  telemetry:    npu-exporter's families (npu_chip_info_utilization, npu_chip_info_hbm_used_memory, "
                  f"npu_chip_info_power, ...)\n"
                  f"  readiness:    http://127.0.0.1:{http}/readyz\n"
                  f"  fault stream: npu-node-agent faults --target 127.0.0.1:{grpc_port} --follow\n"
                  f"  ClusterD:     a demo ClusterD on 127.0.0.1:{clusterd.port} prints the public faults it receives\n"
                  f"  pods:         a demo kubelet ({kubelet.socket_path}) says "
                  f"{', '.join(f'{NAMESPACE}/{pod} holds NPU{ids[0]}-{ids[-1]}' for pod, ids in kubelet.pods.items())}\n"
                  f"                (labels namespace, pod_name, container_name on the device series; pods on the stream)\n"
                  f"  training:     a simulated job (16 ranks, 4 pipeline stages, 4 steps/s) writes profiling records under\n"
                  f"                {root / 'profiling'}; rank 5 gets 15 % slower after {slow_after:g} s\n"
                  f"                (training_step_duration_seconds, training_rank_slow, training_rank_slowdown_ratio, ...);\n"
                  f"                the disk guard keeps the tree under {DEMO_DISK_LIMIT_MB} MiB (npu_agent_profiling_disk_usage_bytes)\n"
                  f"  files:        {root}  (config.yaml, scenario.yaml, customization.json, agent.log)\n"
                  f"  run it again: npu-node-agent run --config {config_path}\n\n{LEGEND}\n", flush=True)
            asyncio.create_task(watch(agent))
            job = DemoJob(Path(config.profiling.root), slow_after_s=slow_after)
            tasks.append(asyncio.create_task(job.run()))
            # The disk guard and the step pipeline are built once the job's first record is there (agent.ondemand).
            if config.profiling.disk_guard:
                tasks.append(asyncio.create_task(watch_disk(lambda: agent.guard)))
            if config.profiling.metrics:
                tasks.append(asyncio.create_task(watch_steps(lambda: agent.steps, job)))

        async def watch_steps(built: Callable[[], StepMetrics | None], job: DemoJob) -> None:
            held: set = set()  # (rank, reason) the detector holds slow, as last printed
            while True:
                await asyncio.sleep(0.2)
                steps = built()
                if steps is None:
                    continue
                now = {(key.rank, reason) for key, state in steps.detector.ranks.items()
                       for reason, slow in state.slow.items() if slow}
                for reason in ("compute", "temporal", "io"):
                    raised = sorted(rank for rank, r in now - held if r == reason)
                    cleared = sorted(rank for rank, r in held - now if r == reason)
                    when = f"{time.time() - job.slow_from:+.1f} s from rank {job.slow_rank}'s slowdown"
                    if raised and reason == "compute":
                        workers = steps.detector.workers.get(job.job_id, {})
                        for worker in sorted((w for w in workers.values() if set(w.ranks) & set(raised)),
                                             key=lambda w: int(w.name)):
                            proof = worker.evidence
                            say(f"slow worker {worker.name} (rank(s) {_ranks(list(worker.ranks))}, stage "
                                f"{worker.stage}) of job {job.job_id}: computes {proof.excess:+.0%} over its stage "
                                f"peers in its last {proof.window} steps, {proof.z:.0f} standard errors ({when})")
                    elif raised:
                        ratios = [steps.detector.ranks[RankKey(job.job_id, r)].ratio or 0 for r in raised]
                        say(f"slow rank(s) {_ranks(raised)} of job {job.job_id}: reason={reason}, step time up to "
                            f"{max(ratios):.2f}x baseline ({when})")
                    if cleared:
                        say(f"rank(s) {_ranks(cleared)} of job {job.job_id} no longer slow: reason={reason} ({when})")
                held = now

        async def watch_disk(built: Callable[[], DiskGuard | None]) -> None:
            seen, disk_said = 0, []
            while True:
                await asyncio.sleep(0.2)
                guard = built()
                if guard is not None and guard.files_aged != seen:
                    if not disk_said or time.monotonic() - disk_said[-1] >= 10:  # the job fills 1 MiB in seconds
                        say(f"disk guard: over {DEMO_DISK_LIMIT_MB} MiB -> aged {guard.files_aged - seen} oldest record "
                            f"file(s); profiling now {guard.usage_bytes / 2**20:.2f} MiB ({disk_summary(guard.root)})")
                        disk_said.append(time.monotonic())
                    seen = guard.files_aged

        async def watch(agent) -> None:
            subscription = agent.hub.subscribe()
            known: dict[int, DeviceState] = {}
            firsts: list[Change] = []  # first states without a fault (the agent has just listed the NPUs): one line
            lines = Lines()

            def flush(elapsed: float, everything: bool = False) -> None:
                """The first readings (once no more arrive), then the lines held long enough."""
                if firsts:
                    print(first_readings_line(elapsed, [c.revision for c in firsts], [c.state for c in firsts]),
                          flush=True)
                    firsts.clear()
                for pending in lines.due(elapsed, everything):
                    print(pending.line(_pods(agent.pods_of(pending.after.phy_id))), flush=True)

            while True:
                item = await subscription.next(0.1)
                elapsed = time.monotonic() - started
                for change in item.devices if isinstance(item, Snapshot) else [item] if isinstance(item, Change) else []:
                    before = known.get(change.state.phy_id)
                    known[change.state.phy_id] = change.state
                    if before is None and not change.state.faulty and change.state.health is Health.HEALTHY:
                        firsts.append(change)
                        continue
                    flush(elapsed)
                    for pending in lines.add(elapsed, change.revision, before, change.state):
                        print(pending.line(_pods(agent.pods_of(pending.after.phy_id))), flush=True)
                if item is None or not firsts:  # first readings arrive together: one line once they stop
                    flush(elapsed)
                if duration and elapsed >= duration:
                    flush(elapsed, everything=True)
                    stop.set()
                    return

        try:
            code = await serve(config, stop=stop, on_started=on_started)
        finally:
            for task in tasks:
                task.cancel()
            await clusterd.stop()
            await kubelet.stop()
        return code

    try:
        code = asyncio.run(main())
    finally:
        log_file.close()
    print(f"demo finished; the agent's log is {root / 'agent.log'}")
    return code
