"""Idle footprint of npu-node-agent: RSS, CPU and threads with the chart's default configuration.

The real agent (`npu-node-agent run`, the console script the image's ENTRYPOINT is; `python -m agent
run` when the venv has none) runs as a subprocess with the `agent:` block of
helm/npu-node-agent/values.yaml (what the chart renders into config.yaml; its host paths moved
under a temporary directory). So the features on by default are on: the dcmi backend (the fake
libdcmi.so built from C, testkit/fakes/dcmi, with 16 NPUs: no driver here), pod attribution (a
kubelet PodResources stand-in, testkit/fakes/kubelet, answers on the socket), the disk guard and the
step metrics on an empty profiling tree (as on a node that has run no profiled job: both wait for
its first entry, agent.ondemand; with records, see bench/step_metrics.py). As in the image, the
agent's bytecode is compiled first. Beside it, in the same window, runs the baseline: a bare
interpreter of the same venv that imports the agent's dependencies (grpc, google.protobuf,
prometheus_client, yaml, psutil) and sleeps. After a warm-up both are sampled every second (RSS
with psutil; CPU time from the kernel at the start and end of the window), then VmHWM (the lifetime peak RSS) is read from /proc/<pid>/status and the
threads are counted from /proc/<pid>/task (gRPC's C-core threads apart: it sizes its pool from the
machine's CPUs).

Run from the repository root:  .venv/bin/python -m bench.footprint
"""

from __future__ import annotations

import argparse
import compileall
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

from testkit import REPO
from testkit.agent import AgentProcess
from testkit.fakes.dcmi import build_fake_dcmi
from testkit.fakes.kubelet.podresources import PodResourcesStandIn
from testkit.wait import wait_until

MIB = 1024 * 1024
TARGET_RSS_MIB = 60.0
TARGET_RSS_RATIO = 1.25  # of the baseline's, measured in the same window
TARGET_THREADS = 12
TARGET_CPU_PERCENT = 1.0
GRPC_C_THREADS = ("grpc_global_tim", "lifeguard", "event_engine")  # kernel names of gRPC's C-core threads
NPD_RSS_MIB = 30.0  # node-problem-detector, typical RSS
NODED_REQUEST_MIB = 300.0  # MindCluster NodeD's memory request

BASELINE_CODE = """\
import signal, sys, time
import grpc, google.protobuf, prometheus_client, yaml, psutil
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("ready", flush=True)
while True:
    time.sleep(3600)
"""


def vm_hwm_mib(pid: int) -> float | None:
    """Peak RSS (VmHWM) of `pid` in MiB, from /proc/<pid>/status."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / MIB
    except OSError:
        pass
    return None


class Sampled:
    """RSS samples and CPU time over the window for one process."""

    def __init__(self, name: str, pid: int):
        self.name = name
        self.process = psutil.Process(pid)
        self.rss: list[int] = []
        self.cpu_start = self.cpu_end = 0.0
        self.hwm: float | None = None
        self.threads = self.grpc_threads = 0

    def cpu_time(self) -> float:
        t = self.process.cpu_times()
        return t.user + t.system

    def start(self) -> None:
        self.cpu_start = self.cpu_time()

    def sample(self) -> None:
        self.rss.append(self.process.memory_info().rss)

    def finish(self) -> None:
        self.cpu_end = self.cpu_time()
        self.hwm = vm_hwm_mib(self.process.pid)
        self.threads = self.process.num_threads()
        self.grpc_threads = sum(thread_name(self.process.pid, t.id).startswith(GRPC_C_THREADS)
                                for t in self.process.threads())

    def rss_mean(self) -> float:
        return sum(self.rss) / len(self.rss) / MIB

    def rss_max(self) -> float:
        return max(self.rss) / MIB

    def cpu_percent(self, wall: float) -> float:
        return (self.cpu_end - self.cpu_start) / wall * 100


def thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def chart_default_config(workdir: Path, library: Path, socket: Path, poll_interval: float | None) -> dict:
    """The chart's default `agent:` block, its host paths moved under `workdir`."""
    values = yaml.safe_load((REPO / "helm" / "npu-node-agent" / "values.yaml").read_text())
    config = values["agent"]
    config["state_dir"] = str(workdir / "state")
    config["devices"]["dcmi_library"] = str(library)
    config["kubernetes"]["pod_resources_socket"] = str(socket)
    config["profiling"]["root"] = str(workdir / "profiling")
    config["datatrace"]["root"] = str(workdir / "datatrace")
    if poll_interval is not None:
        config["devices"]["poll_interval_seconds"] = poll_interval
    return config


def start_baseline(timeout: float = 30.0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", BASELINE_CODE], stdout=subprocess.PIPE, text=True)
    # Wait, with a deadline, for its one line: the imports are done (or EOF: it died).
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "ready":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the baseline interpreter did not get ready within {timeout:g} s")
    return proc


def stop_baseline(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ratio(a: float, b: float, digits: int = 2) -> str:
    return f"{a / b:.{digits}f}x" if b > 1e-9 else "n/a"


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m bench.footprint",
        description="Idle footprint of npu-node-agent (fake libdcmi.so, no stream subscribers, no injections): RSS, "
                    "CPU %% of one core and peak RSS, beside a bare interpreter that imports the agent's "
                    "dependencies and sleeps, sampled over the same window. Prints PASS/FAIL against the targets "
                    "(< %g MiB, < %g %% of a core); exits 0 either way (non-zero only when the benchmark itself "
                    "could not run)." % (TARGET_RSS_MIB, TARGET_CPU_PERCENT))
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the sampled window (default 60)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds to wait before sampling (default 10)")
    parser.add_argument("--interval", type=float, default=1.0, help="RSS sampling interval in seconds (default 1)")
    parser.add_argument("--cards", type=int, default=16, help="NPUs on the fake node, FAKE_DCMI_CARDS (default 16)")
    parser.add_argument("--poll-interval", type=float, default=None,
                        help="the agent's devices.poll_interval_seconds (default: the chart's)")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.warmup < 0 or args.interval <= 0 or args.interval > args.seconds:
        parser.error("--seconds and --interval must be positive (interval <= seconds), --warmup not negative")
    if not 1 <= args.cards <= 64:
        parser.error("--cards must be 1..64 (the fake's limit)")
    if args.poll_interval is not None and args.poll_interval < 0.2:
        parser.error("--poll-interval must be at least 0.2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="npa-foot-", dir="/tmp"))
    agent = baseline = kubelet = None
    try:
        library = build_fake_dcmi(workdir / "lib")
        (workdir / "agent").mkdir()
        (workdir / "profiling").mkdir()
        kubelet = PodResourcesStandIn(workdir / "kubelet.sock").start()
        config = chart_default_config(workdir, library, workdir / "kubelet.sock", args.poll_interval)
        env = {"FAKE_DCMI_CARDS": str(args.cards), "FAKE_DCMI_CONTROL": "", "FAKE_DCMI_TRACE": ""}
        # The image compiles the bytecode at build time; without it every start compiles the agent
        # from source, and the compiler's garbage stays in the process's memory.
        compileall.compile_dir(REPO / "agent", quiet=1)
        print(f"npu-node-agent idle footprint: the chart's default configuration (helm values `agent:`), "
              f"backend dcmi with the fake libdcmi.so ({args.cards} NPUs; no driver here), poll interval "
              f"{config['devices']['poll_interval_seconds']:g} s, a kubelet PodResources stand-in, "
              "no stream subscribers, no injections")
        agent = AgentProcess(workdir / "agent", config, env)
        script = Path(sys.executable).parent / "npu-node-agent"
        if script.is_file():  # as the image starts it (ENTRYPOINT): without runpy, which `-m` loads
            agent.program = [str(script)]
        agent.start()
        baseline = start_baseline()
        wait_until(lambda: agent.http("/readyz")[0] == 200, 20, "agent /readyz 200")
        print(f"  agent pid {agent.process.pid}; baseline pid {baseline.pid} "
              "(same interpreter, imports grpc, google.protobuf, prometheus_client, yaml, psutil, then sleeps)")
        print(f"  warm-up {args.warmup:g} s, then both sampled every {args.interval:g} s for {args.seconds:g} s ...",
              flush=True)
        time.sleep(args.warmup)  # warm-up before the window, not synchronisation

        procs = [Sampled("agent", agent.process.pid), Sampled("baseline", baseline.pid)]
        for p in procs:
            p.start()
        window_start = time.monotonic()
        n = 0
        while True:
            for p in procs:
                p.sample()
            n += 1
            due = window_start + n * args.interval
            if due > window_start + args.seconds + 1e-9:
                break
            time.sleep(max(0.0, due - time.monotonic()))  # sampling interval
        for p in procs:
            p.finish()
        wall = time.monotonic() - window_start
        if agent.process.poll() is not None:
            raise RuntimeError(f"the agent exited during the window (code {agent.process.returncode})")
        a, b = procs

        polls = agent.metric("npu_agent_device_polls_total")
        a_cpu, b_cpu = a.cpu_percent(wall), b.cpu_percent(wall)
        rss_ok = a.rss_max() < TARGET_RSS_MIB
        ratio_ok = a.rss_mean() <= TARGET_RSS_RATIO * b.rss_mean()
        threads_ok = a.threads <= TARGET_THREADS
        cpu_ok = a_cpu < TARGET_CPU_PERCENT
        print()
        print(f"window {wall:.1f} s, {len(a.rss)} samples each")
        print(f"{'':28} {'agent':>10} {'baseline':>10} {'agent/base':>11}   target")
        print(f"{'RSS mean (MiB)':28} {a.rss_mean():>10.1f} {b.rss_mean():>10.1f} {ratio(a.rss_mean(), b.rss_mean()):>11}"
              f"   <= {TARGET_RSS_RATIO:g}x: {'PASS' if ratio_ok else 'FAIL'}")
        print(f"{'RSS max in window (MiB)':28} {a.rss_max():>10.1f} {b.rss_max():>10.1f} {ratio(a.rss_max(), b.rss_max()):>11}"
              f"   < {TARGET_RSS_MIB:g} MiB: {'PASS' if rss_ok else 'FAIL'}")
        if a.hwm is not None and b.hwm is not None:
            print(f"{'peak RSS, VmHWM (MiB)':28} {a.hwm:>10.1f} {b.hwm:>10.1f} {ratio(a.hwm, b.hwm):>11}"
                  f"   (lifetime peak, startup included: {'under' if a.hwm < TARGET_RSS_MIB else 'OVER'} {TARGET_RSS_MIB:g} MiB)")
        print(f"{'CPU (% of one core)':28} {a_cpu:>10.3f} {b_cpu:>10.3f} {ratio(a_cpu, b_cpu, 1):>11}"
              f"   < {TARGET_CPU_PERCENT:g} %: {'PASS' if cpu_ok else 'FAIL'}")
        print(f"{'CPU time in window (s)':28} {a.cpu_end - a.cpu_start:>10.3f} {b.cpu_end - b.cpu_start:>10.3f}")
        print(f"{'threads':28} {a.threads:>10} {b.threads:>10} {'':>11}   <= {TARGET_THREADS}: "
              f"{'PASS' if threads_ok else 'FAIL'}")
        print(f"{'  of which gRPC C-core':28} {a.grpc_threads:>10} {b.grpc_threads:>10} {'':>11}   "
              f"(timer, lifeguard, min(16, max(4, {os.sysconf('SC_NPROCESSORS_CONF')} CPUs)) workers)")
        print(f"agent over baseline: +{a.rss_mean() - b.rss_mean():.1f} MiB RSS, +{a_cpu - b_cpu:.3f} % CPU; "
              f"device polls so far: {polls if polls is None else int(polls)}")
        print(f"reference points: node-problem-detector ~{NPD_RSS_MIB:g} MiB RSS (agent {ratio(a.rss_mean(), NPD_RSS_MIB)}); "
              f"NodeD requests {NODED_REQUEST_MIB:g} MiB (agent {ratio(a.rss_mean(), NODED_REQUEST_MIB)})")
        print(f"idle footprint: RSS {a.rss_mean():.1f} MiB (max {a.rss_max():.1f}, target < {TARGET_RSS_MIB:g}): "
              f"{'PASS' if rss_ok else 'FAIL'}; {ratio(a.rss_mean(), b.rss_mean())} the baseline (target <= "
              f"{TARGET_RSS_RATIO:g}x): {'PASS' if ratio_ok else 'FAIL'}; {a.threads} threads (target <= "
              f"{TARGET_THREADS}): {'PASS' if threads_ok else 'FAIL'}; CPU {a_cpu:.3f} % of a core (target < "
              f"{TARGET_CPU_PERCENT:g}): {'PASS' if cpu_ok else 'FAIL'}")
        return 0
    except Exception as exc:  # noqa: BLE001 - the benchmark could not run: say why, exit non-zero
        print(f"benchmark error: {exc}", file=sys.stderr)
        if agent is not None and agent.raw_stderr:
            print("last agent log lines:\n" + "".join(agent.raw_stderr[-15:]), file=sys.stderr)
        return 1
    finally:
        if baseline is not None:
            stop_baseline(baseline)
        if kubelet is not None:
            kubelet.stop()
        if agent is not None:
            try:
                took = agent.stop()
                print(f"agent stopped (SIGTERM) in {took:.2f} s")
            except AssertionError as exc:
                print(f"warning: agent stop: {exc}", file=sys.stderr)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
