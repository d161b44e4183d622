"""TaskD proxy: messages per second and added latency, node proxy versus a direct worker -> manager
connection, measured in the same run.

    .venv/bin/python -m bench.taskd_proxy          # ~1 min

Four kinds of process, each on its own: a minimal TaskNet manager that acks at once, the agent's
TaskdProxy (the real component, alone on its own asyncio loop), the floor (a grpc.aio relay with no
logic at all: raw bytes in, the same bytes to the manager, its ack back), and load clients that
carry a training job's environment (MINDX_TASK_ID, MASTER_ADDR) so the proxy attributes them as it
would a worker. Latency: one client, one message at a time (a worker's sync send), per-call wall
time; added latency = relay percentile - direct percentile. Throughput: clients with many calls in
flight. The floor is what any Python gRPC relay costs here; the proxy's distance to it is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import psutil

from bench.stats import percentile
from testkit import REPO


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
from agent.common.executor import Executor
from agent.taskd.proxy import TaskdProxy
async def main():
    p = TaskdProxy("127.0.0.1:0", int(sys.argv[1]), peers=Executor().lane("taskd-peers", 2))
    await p.start(); print(p.port, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
'''

FLOOR = r'''
import asyncio, sys
import grpc
async def main():
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sys.argv[1]}")
    upstream = {m: channel.unary_unary(f"/TaskNet/{m}") for m in ("Register", "PathDiscovery", "TransferMessage")}
    def relay(call):
        async def handle(raw, context):
            return await call(raw)
        return grpc.unary_unary_rpc_method_handler(handle)
    s = grpc.aio.server()
    s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "TaskNet", {m: relay(c) for m, c in upstream.items()}),))
    port = s.add_insecure_port("127.0.0.1:0"); await s.start(); print(port, flush=True)
    await s.wait_for_termination()
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-count", type=int, default=5000)
    parser.add_argument("--throughput-count", type=int, default=10000, help="messages per load client")
    parser.add_argument("--inflight", type=int, default=32, help="calls in flight per load client")
    parser.add_argument("--clients", type=int, default=2, help="load client processes")
    parser.add_argument("--target-added-p50-ms", type=float, default=0.5)
    parser.add_argument("--target-ratio", type=float, default=0.5, help="proxy throughput / direct throughput")
    options = parser.parse_args()

    manager, manager_port = start(MANAGER, "127.0.0.1:0")
    proxy, proxy_port = start(PROXY, str(manager_port))
    floor, floor_port = start(FLOOR, str(manager_port))
    targets = {"direct": f"127.0.0.1:{manager_port}", "floor": f"127.0.0.1:{floor_port}",
               "proxy": f"127.0.0.1:{proxy_port}"}
    # CPU seconds per message of the process that does the work on each path: the bare manager (a
    # grpc.aio server that only acks) for direct, the relay itself for floor and proxy.
    watched = {"direct": psutil.Process(manager.pid), "floor": psutil.Process(floor.pid),
               "proxy": psutil.Process(proxy.pid)}
    try:
        rows = {}
        for name, target in targets.items():
            samples = clients(target, "latency", options.latency_count, 1, 1)[0]["samples"]
            rows[name] = {q: percentile(samples, 100 * q) / 1e6 for q in (0.5, 0.9, 0.99)}  # ns -> ms
        rates, cpu = {}, {}
        for name, target in targets.items():
            before = sum(watched[name].cpu_times()[:2])
            results = clients(target, "throughput", options.throughput_count, options.inflight, options.clients)
            sent = sum(r["sent"] for r in results)
            rates[name] = sent / max(r["seconds"] for r in results)
            cpu[name] = (sum(watched[name].cpu_times()[:2]) - before) / sent
        rss = watched["proxy"].memory_info().rss / 2**20
    finally:
        for process in (proxy, floor, manager):
            process.kill()
            process.wait()

    print(f"{'path':<8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'msg/s':>8} {'ratio':>6} {'CPU us/msg':>11}"
          f"   (latency: one worker, one sync message at a time, {options.latency_count} messages; throughput: "
          f"{options.clients} clients x {options.inflight} in flight)")
    for name, row in rows.items():
        print(f"{name:<8} {row[0.5]:>8.3f} {row[0.9]:>8.3f} {row[0.99]:>8.3f} {rates[name]:>8,.0f} "
              f"{rates[name] / rates['direct']:>6.2f} {cpu[name] * 1e6:>11.0f}")
    added = {name: {q: rows[name][q] - rows["direct"][q] for q in (0.5, 0.99)} for name in ("floor", "proxy")}
    for name in ("floor", "proxy"):
        print(f"added by the {name}: p50 {added[name][0.5]:.3f} ms, p99 {added[name][0.99]:.3f} ms")
    print(f"proxy RSS {rss:.0f} MiB; the proxy costs {cpu['proxy'] / cpu['floor']:.2f}x the CPU of a relay with no logic")
    ratio = rates["proxy"] / rates["direct"]
    print(f"added p50 {added['proxy'][0.5]:.3f} ms, target <= {options.target_added_p50_ms} ms: "
          f"{'PASS' if added['proxy'][0.5] <= options.target_added_p50_ms else 'FAIL'}; throughput ratio {ratio:.2f}, "
          f"target >= {options.target_ratio}: {'PASS' if ratio >= options.target_ratio else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
