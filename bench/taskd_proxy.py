"""TaskD proxy: messages per second and added latency, node proxy versus a direct worker -> manager
connection, measured in the same run.

    .venv/bin/python -m bench.taskd_proxy          # ~1 min

Three kinds of process, each on its own: a minimal TaskNet manager that acks at once, the agent's
TaskdProxy (the real component, alone on its own asyncio loop), and load clients that carry a
training job's environment (MINDX_TASK_ID, MASTER_ADDR) so the proxy attributes them as it would a
worker. Latency: one client, one message at a time (a worker's sync send), per-call wall time;
added latency = proxy percentile - direct percentile. Throughput: clients with many calls in flight.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent

MANAGER = r'''
import asyncio, sys
import grpc
from agent._proto import tasknet_pb2 as pb, tasknet_pb2_grpc as g
ME = pb.Position(role="Mgr", serverRank="0", processRank="-1")
class Manager(g.TaskNetServicer):
    async def Register(self, r, c): return pb.Ack(uuid=r.uuid, code=0, src=ME)
    async def PathDiscovery(self, r, c): return pb.Ack(uuid=r.uuid, code=0, src=ME)
    async def TransferMessage(self, m, c): return pb.Ack(uuid=m.header.uuid, code=0, src=ME)
    async def InitServerDownStream(self, it, c):
        async for _ in it: pass
        if False: yield
async def main():
    s = grpc.aio.server(); g.add_TaskNetServicer_to_server(Manager(), s)
    port = s.add_insecure_port(sys.argv[1]); await s.start(); print(port, flush=True)
    await s.wait_for_termination()
asyncio.run(main())
'''

PROXY = r'''
import asyncio, sys
from agent.taskd.proxy import TaskdProxy
async def main():
    p = TaskdProxy("127.0.0.1:0", int(sys.argv[1])); await p.start(); print(p.port, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
'''

CLIENT = r'''
import asyncio, json, sys, time, uuid
import grpc
from agent._proto import tasknet_pb2 as pb, tasknet_pb2_grpc as g
target, mode, count, inflight = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
me = pb.Position(role="Worker", serverRank="0", processRank=sys.argv[5])
mgr = pb.Position(role="Mgr", serverRank="0", processRank="-1")
body = json.dumps({"msg_type": "KEEP_ALIVE", "code": 0, "message": "", "extension": {"step": "1"}})
def message(i):
    return pb.Message(header=pb.MessageHeader(uuid=f"{me.processRank}-{i}", mtype="DEFAULT", sync=True,
                                              src=me, dst=mgr), body=body)
async def main():
    async with grpc.aio.insecure_channel(target) as ch:
        stub = g.TaskNetStub(ch)
        await stub.Register(pb.RegisterReq(uuid="r", pos=me))
        await stub.PathDiscovery(pb.PathDiscoveryReq(uuid="p", proxyPos=me, path=[me]))
        for i in range(200):  # warm-up
            await stub.TransferMessage(message(i))
        if mode == "latency":
            samples = []
            for i in range(count):
                t = time.perf_counter_ns(); ack = await stub.TransferMessage(message(i))
                samples.append(time.perf_counter_ns() - t); assert ack.code == 0
            print(json.dumps({"samples": samples}))
        else:
            sent = 0
            async def lane(n):
                nonlocal sent
                for i in range(n):
                    ack = await stub.TransferMessage(message(i)); assert ack.code == 0; sent += 1
            t = time.perf_counter()
            await asyncio.gather(*(lane(count // inflight) for _ in range(inflight)))
            print(json.dumps({"sent": sent, "seconds": time.perf_counter() - t}))
asyncio.run(main())
'''


def start(code: str, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env={**os.environ, **(env or {})},
                               stdout=subprocess.PIPE, text=True)
    return process, int(process.stdout.readline())


def clients(target: str, mode: str, count: int, inflight: int, processes: int) -> list[dict]:
    env = {**os.environ, "MINDX_TASK_ID": "bench-job", "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": str(REPO)}
    running = [subprocess.Popen([sys.executable, "-c", CLIENT, target, mode, str(count), str(inflight), str(rank)],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, text=True) for rank in range(processes)]
    results = []
    for process in running:
        out, _ = process.communicate(timeout=600)
        if process.returncode != 0:
            raise SystemExit(f"load client failed ({process.returncode})")
        results.append(json.loads(out))
    return results


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))] / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-count", type=int, default=5000)
    parser.add_argument("--throughput-count", type=int, default=10000, help="messages per load client")
    parser.add_argument("--inflight", type=int, default=32, help="calls in flight per load client")
    parser.add_argument("--clients", type=int, default=2, help="load client processes")
    parser.add_argument("--target-added-p99-ms", type=float, default=1.0)
    parser.add_argument("--target-rate", type=float, default=10_000)
    options = parser.parse_args()

    manager, manager_port = start(MANAGER, "127.0.0.1:0")
    proxy, proxy_port = start(PROXY, str(manager_port))
    direct, via_proxy = f"127.0.0.1:{manager_port}", f"127.0.0.1:{proxy_port}"
    proxy_cpu = psutil.Process(proxy.pid)
    manager_cpu = psutil.Process(manager.pid)
    try:
        rows = {}
        for name, target in (("direct", direct), ("proxy", via_proxy)):
            samples = clients(target, "latency", options.latency_count, 1, 1)[0]["samples"]
            rows[name] = {q: percentile(samples, q) for q in (0.5, 0.9, 0.99)}
        rates = {}
        cpu = {}  # CPU seconds per message: the proxy's, and the bare manager's (a grpc.aio server that only acks)
        for name, target in (("direct", direct), ("proxy", via_proxy)):
            watched = manager_cpu if name == "direct" else proxy_cpu
            before = sum(watched.cpu_times()[:2])
            results = clients(target, "throughput", options.throughput_count, options.inflight, options.clients)
            sent = sum(r["sent"] for r in results)
            rates[name] = sent / max(r["seconds"] for r in results)
            cpu[name] = (sum(watched.cpu_times()[:2]) - before) / sent
        rss = proxy_cpu.memory_info().rss / 2**20
    finally:
        for process in (proxy, manager):
            process.kill()
            process.wait()

    print(f"{'path':<8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}   (one worker, one sync message at a time, "
          f"{options.latency_count} messages)")
    for name, row in rows.items():
        print(f"{name:<8} {row[0.5]:>8.3f} {row[0.9]:>8.3f} {row[0.99]:>8.3f}")
    added = {q: rows["proxy"][q] - rows["direct"][q] for q in (0.5, 0.99)}
    print(f"added by the proxy: p50 {added[0.5]:.3f} ms, p99 {added[0.99]:.3f} ms")
    print(f"throughput ({options.clients} clients x {options.inflight} in flight): direct {rates['direct']:,.0f} msg/s, "
          f"proxy {rates['proxy']:,.0f} msg/s (ratio {rates['proxy'] / rates['direct']:.2f}); "
          f"proxy CPU {cpu['proxy'] * 1e6:.0f} us/message (a bare grpc.aio manager that only acks: "
          f"{cpu['direct'] * 1e6:.0f} us/message), proxy RSS {rss:.0f} MiB")
    ok_latency = added[0.99] < options.target_added_p99_ms
    ok_rate = rates["proxy"] >= options.target_rate
    print(f"added p99 {added[0.99]:.3f} ms, target < {options.target_added_p99_ms} ms: {'PASS' if ok_latency else 'FAIL'}; "
          f"{rates['proxy']:,.0f} msg/s through the proxy, target >= {options.target_rate:,.0f}: "
          f"{'PASS' if ok_rate else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
