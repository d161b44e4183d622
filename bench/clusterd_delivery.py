"""Fault delivery to ClusterD (and to the agent's own stream subscribers) under load.

The real agent (`python -m agent run`) runs as a subprocess against the fake libdcmi.so built from
C (tests/fakes/dcmi) with FAKE_DCMI_CARDS NPUs, poll interval 1 s, and delivers public faults to
the ClusterD stand-in (tests/fakes/clusterd), which applies ClusterD's rules (one token bucket per
resource, 1 request/s, burst 100, 410 when empty; a recovered fault is deleted 5 s late).

1. Change -> ClusterD latency while the buckets allow: occur events paced `--pace` s apart, each a
   new public fault (every device climbs SubHealthFault -> RestartNPU -> PreSeparateNPU ->
   SeparateNPU, so each step occurs a fresh faultId and recovers the previous one in the same
   request; no faultId is reused, so the agent's 5.5 s hold never applies). Latency = the
   stand-in's receipt of the request carrying the faultId's occur - the fake's `cb <ns>` trace line
   (written right before it calls the agent's callback). Baseline, same faults, same run: the
   agent's own gRPC stream (callback -> change listing the code).
2. Drain after an outage: the stand-in is stopped, `--outage-changes` fault-log changes are made
   by driver events (`--flappers` devices toggle a SeparateNPU code, i.e. every change is a public
   occur or recover; the others hold a SeparateNPU code and toggle a SubHealth one, i.e. changes
   without a public transition), then the stand-in is started again (fresh buckets). Measured: time
   until `npu_agent_outbox_pending` is 0 and the stand-in's active set equals the agent's faults,
   requests used, and loss. Baseline: the theoretical minimum (100 faults per request; ClusterD's
   burst 100 then 1 request/s, and the agent's own 1 request/s, burst 2).
3. Fault-stream fan-out: `--subscribers` concurrent Watch streams (grpc.aio, spread over a few
   worker processes) while `--fanout-changes` `once` events arrive at `--fanout-rate`/s; changes/s
   delivered in total and callback -> receipt latency, against 1 subscriber in the same run.

Phases run in the order 1, 3, 2 (2 exhausts the agent's driver-event budget, which 3 needs); the
report prints 1, 2, 3.

Run from the repository root:  .venv/bin/python -m bench.clusterd_delivery
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import psutil

from agent._proto import npu_agent_faults_pb2 as pb
from agent._proto import npu_agent_faults_pb2_grpc as pb_grpc
from agent.config import ClusterdConfig
from agent.faults.pubfault import fault_id
from bench.fault_latency import fmt, metric_or_none, percentile, read_trace, summary
from tests.fakes.clusterd import ClusterdStandIn
from tests.fakes.dcmi import FakeDcmiControl, build_fake_dcmi
from tests.integration.harness import AgentProcess, wait_until

NODE = "test-node"  # the harness's node name
PUBLIC = ClusterdConfig().public_codes  # the agent's default level -> public code mapping
# Phase 1: each device climbs these levels, one occur event per step (built-in fault code table).
LADDER = ((0x81A3880C, "SubHealthFault"), (0x80E18005, "RestartNPU"),
          (0x8118043C, "PreSeparateNPU"), (0x80E18402, "SeparateNPU"))
SEPARATE_CODE = 0x80E18402  # SeparateNPU -> public 020011001
SUBHEALTH_CODE = 0x81A3880C  # SubHealthFault: below SeparateNPU, so no public change on a separated device
FANOUT_CODE_BASES = (0x8A000000, 0x8A100000)  # unknown codes, severity 1 -> NotHandleFault (not public)
RATE_LIMIT_PER_MINUTE = 1000  # the agent's driver-event token bucket (burst = the same number)
AGENT_REQUEST_BURST = 2  # the agent's own ClusterD request budget: 1/s, burst 2
CLUSTERD_BURST = 100  # ClusterD's per-resource bucket: 1/s, burst 100
MAX_FAULTS = 100  # faults per request
RECOVER_SETTLE_S = 5.5  # ClusterD deletes a recovered fault 5 s late; the agent holds a re-occur 5.5 s


def public_ids(phy: int, level: str) -> frozenset[str]:
    code = PUBLIC.get(level)
    return frozenset([fault_id(NODE, phy, code)]) if code else frozenset()


def collapsed(assertions: list[str]) -> list[str]:
    return [a for i, a in enumerate(assertions) if i == 0 or assertions[i - 1] != a]


def alternates(sequence: list[str]) -> bool:
    return all(a == ("occur" if i % 2 == 0 else "recover") for i, a in enumerate(sequence))


def ratio(a: float, b: float, digits: int = 2) -> str:
    return f"{a / b:.{digits}f}x" if b > 1e-9 else "n/a"


# ---- the stream, in this process ----------------------------------------------------------------


class Watcher:
    """Watches the fault stream on its own thread: every change (receipt ns, logic, phy, level, codes)."""

    def __init__(self, port: int):
        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self._call = pb_grpc.NodeFaultsStub(self._channel).Watch(pb.WatchRequest())
        self._lock = threading.Lock()
        self.snapshot_seen = threading.Event()
        self.snapshots = 0
        self.records: list[tuple[int, int, int, str, frozenset[int]]] = []
        self.current: dict[int, tuple[int, str, frozenset[int]]] = {}  # logic -> (phy, level, codes)
        self.first_seen: dict[tuple[int, int], int] = {}  # (logic, code) -> ns of the first change listing it
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fault-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for response in self._call:
                received = time.time_ns()  # first thing on receipt
                kind = response.WhichOneof("kind")
                if kind == "snapshot":
                    with self._lock:
                        self.snapshots += 1
                        for d in response.snapshot.devices:
                            codes = frozenset(int(c.code, 16) for c in d.codes)
                            self.current[d.logic_id] = (d.device, d.level, codes)
                            if self.snapshots > 1:  # a resync: record it like changes, so diffs stay right
                                self.records.append((received, d.logic_id, d.device, d.level, codes))
                    self.snapshot_seen.set()
                elif kind == "change":
                    d = response.change.device
                    codes = frozenset(int(c.code, 16) for c in d.codes)
                    with self._lock:
                        self.records.append((received, d.logic_id, d.device, d.level, codes))
                        self.current[d.logic_id] = (d.device, d.level, codes)
                        for code in codes:
                            self.first_seen.setdefault((d.logic_id, code), received)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = exc
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc

    def seen(self, keys) -> bool:
        with self._lock:
            return all(k in self.first_seen for k in keys)

    def state(self) -> dict[int, tuple[int, str, frozenset[int]]]:
        with self._lock:
            return dict(self.current)

    def position(self) -> int:
        with self._lock:
            return len(self.records)

    def records_since(self, index: int) -> list[tuple[int, int, int, str, frozenset[int]]]:
        with self._lock:
            return self.records[index:]

    def public_now(self) -> set[str]:
        """faultIds of the public faults the agent's current state means."""
        return {fid for phy, level, _ in self.state().values() for fid in public_ids(phy, level)}

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(5)
        self._channel.close()


def start_watcher(agent: AgentProcess) -> Watcher:
    watcher = Watcher(agent.grpc_port)
    wait_until(lambda: watcher.snapshot_seen.is_set() or watcher.error, 10, "the stream's first snapshot", 0.01)
    if watcher.error:
        raise RuntimeError(f"fault stream failed: {watcher.error!r}")
    return watcher


# ---- fan-out subscribers, in worker processes ---------------------------------------------------


def _subscriber_main(port: int, streams: int, conn) -> None:
    """Worker process: `streams` Watch calls on grpc.aio, one channel (connection) each."""
    try:
        asyncio.run(_subscribers(port, streams, conn))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("error", repr(exc)))
        except OSError:
            pass


async def _subscribers(port: int, streams: int, conn) -> None:
    loop = asyncio.get_running_loop()
    records = [{"first": {}, "changes": [], "snapshots": 0, "error": ""} for _ in range(streams)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(streams)]
    calls = [pb_grpc.NodeFaultsStub(channel).Watch(pb.WatchRequest()) for channel in channels]
    ready = asyncio.Event()
    joined = [0]

    async def read(i: int) -> None:
        record = records[i]
        try:
            async for response in calls[i]:
                received = time.time_ns()  # first thing on receipt
                kind = response.WhichOneof("kind")
                if kind == "change":
                    device = response.change.device
                    record["changes"].append(received)
                    for code in device.codes:
                        record["first"].setdefault((device.logic_id, int(code.code, 16)), received)
                elif kind == "snapshot":
                    record["snapshots"] += 1
                    if record["snapshots"] == 1:
                        joined[0] += 1
                        if joined[0] == streams:
                            ready.set()
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                record["error"] = f"{exc.code().name}: {exc.details()}"

    tasks = [asyncio.create_task(read(i)) for i in range(streams)]
    try:
        await asyncio.wait_for(ready.wait(), 30)
    except TimeoutError:
        conn.send(("error", f"only {joined[0]} of {streams} streams got their snapshot within 30 s"))
        return
    conn.send(("ready", streams))
    _, keys, timeout = await loop.run_in_executor(None, conn.recv)  # ("collect", keys, timeout)
    deadline = loop.time() + timeout
    while loop.time() < deadline and not all(k in r["first"] for r in records for k in keys):
        await asyncio.sleep(0.05)
    for call in calls:
        call.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close()
    wanted = set(keys)
    conn.send(("result", (time.process_time(), [
        {"first": {k: v for k, v in r["first"].items() if k in wanted}, "changes": r["changes"],
         "snapshots": r["snapshots"], "error": r["error"]} for r in records])))


class SubscriberPool:
    """`total` subscribers spread over up to `procs` spawned worker processes."""

    def __init__(self, port: int, total: int, procs: int):
        context = multiprocessing.get_context("spawn")  # no fork of a process with live gRPC threads
        self.workers = []
        count = min(procs, total)
        for i in range(count):
            streams = total // count + (1 if i < total % count else 0)
            parent, child = context.Pipe()
            process = context.Process(target=_subscriber_main, args=(port, streams, child),
                                      name=f"subscribers-{i}", daemon=True)
            process.start()
            child.close()
            self.workers.append((process, parent))

    def _receive(self, conn, timeout: float, kind: str):
        if not conn.poll(timeout):
            raise RuntimeError(f"a subscriber worker sent no {kind!r} within {timeout:g} s")
        message = conn.recv()
        if message[0] == "error":
            raise RuntimeError(f"subscriber worker failed: {message[1]}")
        return message[1]

    def wait_ready(self, timeout: float = 60.0) -> None:
        for _, conn in self.workers:
            self._receive(conn, timeout, "ready")

    def collect(self, keys: list[tuple[int, int]], timeout: float) -> tuple[float, list[dict]]:
        """(CPU seconds the workers used in all, one record per subscriber)."""
        for _, conn in self.workers:
            conn.send(("collect", keys, timeout))
        cpu, results = 0.0, []
        for _, conn in self.workers:
            used, records = self._receive(conn, timeout + 30, "result")
            cpu += used
            results += records
        return cpu, results

    def close(self) -> None:
        for process, conn in self.workers:
            process.join(5)
            if process.is_alive():
                process.terminate()
                process.join(5)
            conn.close()


# ---- phase 1: change -> ClusterD latency --------------------------------------------------------


def first_accepted(standin: ClusterdStandIn, assertion: str, since: int = 0) -> dict[str, float]:
    """faultId -> receipt time of the first accepted request carrying it with `assertion`."""
    seen: dict[str, float] = {}
    for r in standin.requests[since:]:
        if r.code == 0:
            for f in r.request.faults:
                if f.assertion == assertion:
                    seen.setdefault(f.faultId, r.at)
    return seen


def latency_phase(args, fake: FakeDcmiControl, watcher: Watcher, standin: ClusterdStandIn, trace: Path) -> dict:
    first_request = len(standin.requests)
    injected = []  # (step, logic, code, faultId)
    start = time.monotonic()
    for k in range(args.count):
        pause = start + k * args.pace - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # pacing under the agent's request budget, not synchronisation
        logic = k % args.cards
        code, level = LADDER[k // args.cards]
        fid = fault_id(NODE, args.cards - 1 - logic, PUBLIC[level])
        fake.occur(logic, code, severity=2)  # via event; replies once the agent's callback has returned
        injected.append((k, logic, code, fid))
    took = time.monotonic() - start
    keys = [(logic, code) for _, logic, code, _ in injected]
    fids = [fid for *_, fid in injected]
    try:
        wait_until(lambda: (watcher.seen(keys) and set(fids) <= set(first_accepted(standin, "occur", first_request)))
                   or watcher.error, 10, "every occur on the stream and at the stand-in", 0.02)
    except AssertionError:
        pass  # reported as missing below
    callbacks = read_trace(trace)
    delivered = first_accepted(standin, "occur", first_request)
    clusterd, stream, rows, missing = [], [], [], []
    for k, logic, code, fid in injected:
        cb = callbacks.get((logic, code))
        at = delivered.get(fid)
        seen = watcher.first_seen.get((logic, code))
        if cb is None or at is None or seen is None:
            missing.append(k)
            continue
        clusterd.append(at - cb / 1e9)
        stream.append((seen - cb) / 1e9)
        rows.append((at - cb / 1e9, k, logic, f"{code:08X}"))
    requests = standin.requests[first_request:]
    times = [r.at for r in requests]
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(f"  {len(injected)} occur events over {took:.1f} s ({args.pace:g} s apart); matched {len(clusterd)}, "
          f"missing {len(missing)}; {len(requests)} requests "
          f"({sum(1 for r in requests if r.code)} refused), min gap {min(gaps) if gaps else float('nan'):.3f} s")
    rows.sort(reverse=True)
    return {"clusterd": clusterd, "stream": stream, "missing": missing, "slowest": rows[:5], "requests": requests,
            "injected": len(injected)}


def clear_all(args, fake: FakeDcmiControl, watcher: Watcher, standin: ClusterdStandIn, agent: AgentProcess,
              codes) -> None:
    """Recover every code silently and wait until the agent, the stand-in and the outbox agree: all clear."""
    for logic in range(args.cards):
        for code in codes:
            fake.recover(logic, code, via="silent")
    wait_until(lambda: not any(c for _, _, c in watcher.state().values()), args.poll_interval + 10,
               "every device clear on the stream", 0.05)
    wait_until(lambda: not standin.active() and metric_or_none(agent, "npu_agent_outbox_pending") == 0,
               RECOVER_SETTLE_S + 15, "the stand-in's active set empty and the outbox drained", 0.1)


# ---- phase 3: fan-out ---------------------------------------------------------------------------


def fanout_run(args, agent: AgentProcess, fake: FakeDcmiControl, trace: Path, subscribers: int,
               code_base: int) -> dict:
    pool = SubscriberPool(agent.grpc_port, subscribers, args.subscriber_procs)
    try:
        pool.wait_ready()
        wait_until(lambda: metric_or_none(agent, "npu_agent_fault_stream_subscribers") == subscribers, 10,
                   f"{subscribers} stream subscribers at the agent")
        resynced0 = metric_or_none(agent, "npu_agent_fault_reports_total", sink="stream", result="resynced") or 0
        limited0 = metric_or_none(agent, "npu_agent_driver_events_total", result="rate_limited") or 0
        cpu = psutil.Process(agent.process.pid)
        cpu0 = sum(cpu.cpu_times()[:2])
        keys = []
        start = time.monotonic()
        for i in range(args.fanout_changes):
            pause = start + i / args.fanout_rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)  # pacing under the event rate limit, not synchronisation
            logic, code = i % args.cards, code_base + i
            fake.once(logic, code, severity=1)
            keys.append((logic, code))
        injected_in = time.monotonic() - start
        client_cpu, results = pool.collect(keys, 15.0)
        cpu1 = sum(cpu.cpu_times()[:2])
        resynced = (metric_or_none(agent, "npu_agent_fault_reports_total", sink="stream", result="resynced") or 0) - resynced0
        limited = (metric_or_none(agent, "npu_agent_driver_events_total", result="rate_limited") or 0) - limited0
    finally:
        pool.close()
    callbacks = read_trace(trace)
    stamps = [callbacks[k] for k in keys if k in callbacks]
    latencies, missing, per_sub_p99, errors, snapshots = [], 0, [], [], 0
    last = 0
    for r in results:
        mine = []
        for k in keys:
            seen, cb = r["first"].get(k), callbacks.get(k)
            if seen is None or cb is None:
                missing += 1
                continue
            mine.append((seen - cb) / 1e9)
            last = max(last, seen)
        latencies += mine
        if mine:
            per_sub_p99.append(percentile(mine, 99))
        if r["error"]:
            errors.append(r["error"])
        snapshots += r["snapshots"] - 1
    begin = min(stamps) if stamps else 0
    delivered = sum(1 for r in results for t in r["changes"] if begin <= t <= last)
    window = (last - begin) / 1e9 if last > begin else float("nan")
    print(f"  {subscribers:>3} subscriber(s) in {len(pool.workers)} process(es): {len(keys)} once events over "
          f"{injected_in:.1f} s; {delivered} changes delivered in {window:.2f} s; missing {missing}; "
          f"agent CPU {cpu1 - cpu0:.2f} s, subscriber processes {client_cpu:.2f} s")
    return {"subscribers": subscribers, "latencies": latencies, "missing": missing, "delivered": delivered,
            "window": window, "rate": delivered / window if window == window and window > 0 else 0.0,
            "per_sub_p99": per_sub_p99, "errors": errors, "resyncs": snapshots, "resynced": resynced,
            "rate_limited": limited, "cpu": cpu1 - cpu0, "client_cpu": client_cpu, "injected": len(keys)}


# ---- phase 2: drain after an outage -------------------------------------------------------------


def owed_transitions(before: dict[int, frozenset[str]], records) -> tuple[int, dict[int, frozenset[str]]]:
    """Public occur/recover transitions that the stream's changes mean, from the per-phy state `before`."""
    state = dict(before)
    count = 0
    for _, _, phy, level, _ in records:
        now = public_ids(phy, level)
        count += len(state.get(phy, frozenset()) ^ now)
        state[phy] = now
    return count, state


def intra_request_reoccurs(requests) -> list[tuple[int, str]]:
    """(request index, faultId) where one request recovers a fault and then occurs it again: ClusterD
    applies the recover as a deletion 5 s after the occur it already holds, and ignores the re-occur."""
    found = []
    for i, r in enumerate(requests):
        recovered = set()
        for f in r.request.faults:
            if f.assertion == "recover":
                recovered.add(f.faultId)
            elif f.assertion == "occur" and f.faultId in recovered:
                found.append((i, f.faultId))
                recovered.discard(f.faultId)
    return found


def outage_phase(args, agent: AgentProcess, fake: FakeDcmiControl, watcher: Watcher, standin: ClusterdStandIn,
                 deadline: float) -> dict:
    flappers = list(range(args.flappers))
    churners = list(range(args.flappers, args.cards))
    before = {phy: public_ids(phy, level) for phy, level, _ in watcher.state().values()}
    mark = watcher.position()
    limited0 = metric_or_none(agent, "npu_agent_driver_events_total", result="rate_limited") or 0
    accepted0 = metric_or_none(agent, "npu_agent_driver_events_total", result="accepted") or 0
    sink_results = ("sent", "unavailable", "rate_limited", "rejected", "invalid")
    sink0 = {r: metric_or_none(agent, "npu_agent_fault_reports_total", sink="clusterd", result=r) or 0
             for r in sink_results}
    coalesced0 = metric_or_none(agent, "npu_agent_clusterd_coalesced_transitions_total") or 0
    standin.stop()
    outage_start = time.monotonic()
    for logic in churners:
        fake.occur(logic, SEPARATE_CODE)  # held through the outage: churn below it is not public
    on = [False] * args.cards  # the toggled code of each device, as the driver has it
    events, pending = len(churners), 0.0
    start = time.monotonic()
    last_check = start
    while True:
        now = time.monotonic()
        if now - last_check >= 0.5:
            last_check = now
            pending = metric_or_none(agent, "npu_agent_outbox_pending") or 0
            if pending >= args.outage_changes or now - start >= args.outage_seconds:
                break
        pause = start + (events - len(churners)) / args.outage_rate - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # pacing, not synchronisation
        logic = (events - len(churners)) % args.cards
        code = SEPARATE_CODE if logic in flappers else SUBHEALTH_CODE
        (fake.recover if on[logic] else fake.occur)(logic, code)
        on[logic] = not on[logic]
        events += 1
    injected_in = time.monotonic() - start
    # A defined end: flappers faulty (their last word an occur), SubHealth gone everywhere, and every
    # other churner recovered from its held SeparateNPU code (occurred and recovered inside the outage).
    for logic in range(args.cards):
        if logic in flappers and not on[logic]:
            fake.occur(logic, SEPARATE_CODE)
            events += 1
        elif logic in churners and on[logic]:
            fake.recover(logic, SUBHEALTH_CODE)
            events += 1
    recovered_churners = churners[::2]
    for logic in recovered_churners:
        fake.recover(logic, SEPARATE_CODE)
        events += 1

    def settled() -> bool:
        state = watcher.state()
        return all((SEPARATE_CODE in state[l][2]) == (l in flappers or l not in recovered_churners)
                   and SUBHEALTH_CODE not in state[l][2] for l in range(args.cards))

    wait_until(settled, args.poll_interval + 10, "the agent to reach the final state", 0.05)
    time.sleep(args.poll_interval + 0.5)  # one more poll round: nothing left to mend
    pending = metric_or_none(agent, "npu_agent_outbox_pending") or 0
    revision = metric_or_none(agent, "npu_agent_fault_log_revision") or 0
    limited = (metric_or_none(agent, "npu_agent_driver_events_total", result="rate_limited") or 0) - limited0
    accepted = (metric_or_none(agent, "npu_agent_driver_events_total", result="accepted") or 0) - accepted0
    records = watcher.records_since(mark)
    owed, final_state = owed_transitions(before, records)
    wanted = {fid for ids in final_state.values() for fid in ids}
    net = len(wanted ^ {fid for ids in before.values() for fid in ids})
    touched = {fid for phy in range(args.cards) for level in PUBLIC for fid in public_ids(phy, level)}
    print(f"  stand-in stopped; {events} driver events over {injected_in:.1f} s ({events / injected_in:.0f}/s; "
          f"{int(accepted)} accepted, {int(limited)} rate-limited -> mended by polls); outage "
          f"{time.monotonic() - outage_start:.1f} s")
    print(f"  pending {int(pending)} fault-log changes (log revision {int(revision)}); the stream saw "
          f"{len(records)} changes = {owed} public transitions owed; final state: {len(wanted)} public faults")

    first_request = len(standin.requests)
    restarted = time.time()
    standin.start()
    t_pending0 = t_consistent = None
    while time.time() < deadline:
        p = metric_or_none(agent, "npu_agent_outbox_pending")
        if p == 0 and t_pending0 is None:
            t_pending0 = time.time()
        if p == 0 and {k[2] for k in standin.active()} == watcher.public_now():
            t_consistent = time.time()
            break
        time.sleep(0.1)  # polling the outcome
    drained_at = time.time()
    requests = standin.requests[first_request:]
    # ClusterD applies recovers 5 s late: look again once every deferred deletion is due.
    settle_until = max([drained_at] + [r.at + RECOVER_SETTLE_S for r in requests])
    if settle_until < deadline + RECOVER_SETTLE_S:
        time.sleep(max(0.0, settle_until - time.time()))
    requests = standin.requests[first_request:]
    active = {k[2] for k in standin.active()}
    agent_now = watcher.public_now()
    accepted_requests = [r for r in requests if r.code == 0]
    carried = sum(len(r.request.faults) for r in accepted_requests)
    sequences = {fid: collapsed(standin.assertions(fid)) for fid in touched if standin.assertions(fid)}
    broken = sorted(fid for fid, seq in sequences.items() if not alternates(seq))
    gaps = [b.at - a.at for a, b in zip(requests, requests[1:])]
    sink = {r: (metric_or_none(agent, "npu_agent_fault_reports_total", sink="clusterd", result=r) or 0) - sink0[r]
            for r in sink_results}
    sink["coalesced transitions"] = (metric_or_none(agent, "npu_agent_clusterd_coalesced_transitions_total") or 0) - coalesced0
    return {
        "events": events, "injected_in": injected_in, "accepted": accepted, "limited": limited,
        "pending": pending, "changes_seen": len(records), "owed": owed, "net": net, "final": len(wanted),
        "restarted": restarted, "t_pending0": t_pending0, "t_consistent": t_consistent,
        "first_at": accepted_requests[0].at if accepted_requests else None,
        "requests": requests, "accepted_requests": accepted_requests, "carried": carried,
        "codes": {c: sum(1 for r in requests if r.code == c) for c in sorted({r.code for r in requests})},
        "dropped": standin.dropped_faults(), "active": active, "agent_now": agent_now,
        "broken": broken, "reoccurs": intra_request_reoccurs(accepted_requests),
        "holds": [g for g in gaps if g >= 2.0], "sink": sink, "timed_out": t_consistent is None,
    }


# ---- report -------------------------------------------------------------------------------------


def latency_table(rows: list[tuple[str, list[float]]]) -> None:
    print(f"{'latency':44} {'n':>5} {'p50':>11} {'p90':>11} {'p99':>11} {'max':>11}")
    for name, values in rows:
        if not values:
            print(f"{name:44} {0:>5} {'-':>11} {'-':>11} {'-':>11} {'-':>11}")
            continue
        s = summary(values)
        print(f"{name:44} {len(values):>5} {fmt(s['p50']):>11} {fmt(s['p90']):>11} {fmt(s['p99']):>11} "
              f"{fmt(s['max']):>11}")


def report_latency(args, p1: dict) -> None:
    print()
    print(f"== 1. change -> ClusterD latency ({p1['injected']} new public faults, {args.pace:g} s apart) ==")
    latency_table([("ClusterD (callback -> stand-in receipt)", p1["clusterd"]),
                   ("baseline: stream (callback -> change)", p1["stream"])])
    print("slowest ClusterD deliveries (latency, step #, logic id, code):")
    for latency, k, logic, code in p1["slowest"]:
        print(f"  {fmt(latency):>11}  #{k:<4} logic {logic:<3} {code}")
    sizes = [len(r.request.faults) for r in p1["requests"]]
    print(f"requests: {len(sizes)} ({sum(1 for r in p1['requests'] if r.code)} refused), faults per request "
          f"{min(sizes) if sizes else 0}..{max(sizes) if sizes else 0}")
    if p1["clusterd"] and p1["stream"]:
        c99, s99 = percentile(p1["clusterd"], 99), percentile(p1["stream"], 99)
        c50, s50 = percentile(p1["clusterd"], 50), percentile(p1["stream"], 50)
        ok = c99 < args.target_ms / 1e3 and not p1["missing"]
        print(f"ClusterD hop adds {fmt(c50 - s50)} at p50; ratio ClusterD/stream p50 {ratio(c50, s50, 1)}, "
              f"p99 {ratio(c99, s99, 1)}")
        print(f"change -> ClusterD p99 = {fmt(c99)} (stream p99 {fmt(s99)}); target p99 < {args.target_ms:g} ms: "
              f"{'PASS' if ok else 'FAIL'}")
    else:
        print(f"change -> ClusterD: nothing matched; target p99 < {args.target_ms:g} ms: FAIL")
    if p1["missing"]:
        print(f"FAIL: {len(p1['missing'])} of {p1['injected']} faults never reached the stand-in or the stream "
              f"(steps {p1['missing'][:10]})")


def report_outage(args, p2: dict) -> None:
    print()
    print(f"== 2. drain after a ClusterD outage ({args.flappers} flapping device(s), "
          f"{args.cards - args.flappers} churning below a held SeparateNPU fault) ==")
    reached = "reached" if p2["pending"] >= args.outage_changes else "NOT reached"
    print(f"backlog: {int(p2['pending'])} fault-log changes pending at the restart (target {args.outage_changes}: "
          f"{reached}), from {p2['events']} driver events in {p2['injected_in']:.1f} s; "
          f"{p2['owed']} public transitions owed (net change of ClusterD's view: {p2['net']} faults)")
    t0 = p2["restarted"]

    def since(t):
        return f"{t - t0:.2f} s" if t is not None else "never"

    requests = p2["requests"]
    accepted = p2["accepted_requests"]
    full = sum(1 for r in accepted if len(r.request.faults) == MAX_FAULTS)
    drain = (p2["t_consistent"] or p2["t_pending0"] or time.time()) - t0
    print(f"restart -> first accepted request {since(p2['first_at'])}; -> outbox pending 0 {since(p2['t_pending0'])}; "
          f"-> stand-in consistent with the agent {since(p2['t_consistent'])} (before ClusterD's deferred deletions)")
    if p2["first_at"] is not None and p2["t_pending0"] is not None:
        print(f"  of which sending (first accepted request -> pending 0): {p2['t_pending0'] - p2['first_at']:.2f} s")
    print(f"requests: {len(requests)} (by answer {p2['codes']}), {len(accepted)} accepted carrying {p2['carried']} "
          f"faults ({full} full, mean {p2['carried'] / max(1, len(accepted)):.1f}/request); "
          f"{len(p2['holds'])} gaps >= 2 s between requests (median {percentile(p2['holds'], 50) if p2['holds'] else 0:.2f} s, "
          f"total {sum(p2['holds']):.1f} s; the agent holds a re-occur {RECOVER_SETTLE_S:g} s after its recover)")
    print("agent's ClusterD sink during the phase (outage included): "
          + ", ".join(f"{k} {int(v)}" for k, v in p2["sink"].items()))
    min_requests = math.ceil(p2["owed"] / MAX_FAULTS)
    min_clusterd = max(0, min_requests - CLUSTERD_BURST)
    min_agent = max(0, min_requests - AGENT_REQUEST_BURST)
    print(f"baseline (theoretical minimum for {p2['owed']} transitions at {MAX_FAULTS} faults/request): "
          f"{min_requests} requests, {min_clusterd} s under ClusterD's rules (burst {CLUSTERD_BURST}, then 1/s), "
          f"{min_agent} s under the agent's own budget (burst {AGENT_REQUEST_BURST}, then 1/s)")
    sending = (p2["t_pending0"] - p2["first_at"]) if p2["t_pending0"] and p2["first_at"] else None
    print(f"measured / minimum: requests {ratio(len(requests), min_requests)}; drain time {drain:.1f} s vs "
          f"{min_agent} s ({ratio(drain, min_agent, 1)}); sending time "
          f"{'-' if sending is None else f'{sending:.1f} s'} vs {min_agent} s "
          f"({ratio(sending, min_agent, 1) if sending is not None else 'n/a'})")
    missing = sorted(p2["agent_now"] - p2["active"])
    extra = sorted(p2["active"] - p2["agent_now"])
    rejected = {c: n for c, n in p2["codes"].items() if c not in (0, 410)}
    print(f"after ClusterD's deferred deletions: stand-in holds {len(p2['active'])} faults, the agent means "
          f"{len(p2['agent_now'])}; missing at ClusterD {len(missing)}, extra at ClusterD {len(extra)}")
    for fid in missing[:5]:
        print(f"  missing {fid[:16]}..  sequence {collapsed_tail(p2, fid)}")
    for fid in extra[:5]:
        print(f"  extra   {fid[:16]}..")
    if p2["reoccurs"]:
        in_requests = len({i for i, _ in p2["reoccurs"]})
        print(f"  {len(p2['reoccurs'])} recover -> occur pairs of the same faultId inside one request, in {in_requests} "
              f"of {len(accepted)} accepted requests (ClusterD defers the recover's deletion to 5 s after the stored "
              f"occur and ignores the re-occur, so a fault whose last word is such an occur disappears)")
    print(f"assertion sequences (consecutive repeats collapsed): {len(p2['broken'])} faultIds do not alternate "
          f"occur/recover; requests rejected {sum(rejected.values())}, faults dropped {len(p2['dropped'])}, "
          f"410 (retried) {p2['codes'].get(410, 0)}")
    lossless = not missing and not extra and not rejected and not p2["dropped"] and not p2["broken"]
    print(f"drain: {'drained' if not p2['timed_out'] else 'NOT drained before the deadline'} in {drain:.1f} s with "
          f"{len(requests)} requests (minimum {min_requests}); zero loss: {'PASS' if lossless else 'FAIL'}")


def collapsed_tail(p2: dict, fid: str) -> str:
    sent = [f.assertion for r in p2["accepted_requests"] for f in r.request.faults if f.faultId == fid]
    carrying = [r for r in p2["accepted_requests"] if any(f.faultId == fid for f in r.request.faults)]
    last = [f.assertion for f in carrying[-1].request.faults if f.faultId == fid] if carrying else []
    return (f"{len(sent)} transitions sent during the drain in {len(carrying)} requests; the last request carrying "
            f"it ({len(last)} of them) ends {','.join(last[-4:])}")


def report_fanout(args, one: dict, many: dict) -> None:
    print()
    print(f"== 3. fault-stream fan-out ({args.fanout_changes} once events at {args.fanout_rate:g}/s) ==")
    rows = [(f"{one['subscribers']} subscriber (callback -> receipt)", one["latencies"]),
            (f"{many['subscribers']} subscribers (callback -> receipt)", many["latencies"])]
    latency_table(rows)
    print(f"{'':44} {'changes delivered':>18} {'window':>9} {'changes/s':>10} {'per sub/s':>10} {'agent CPU':>10} "
          f"{'client CPU':>11}")
    for run in (one, many):
        name = f"{run['subscribers']} subscriber(s)"
        print(f"{name:44} {run['delivered']:>18} {run['window']:>8.2f}s {run['rate']:>10.0f} "
              f"{run['rate'] / run['subscribers']:>10.1f} {run['cpu']:>9.2f}s {run['client_cpu']:>10.2f}s")
    if many["per_sub_p99"]:
        print(f"per-subscriber p99 with {many['subscribers']}: {fmt(min(many['per_sub_p99']))} .. "
              f"{fmt(max(many['per_sub_p99']))}")
    for run in (one, many):
        if run["errors"] or run["resyncs"] or run["resynced"] or run["rate_limited"]:
            print(f"  {run['subscribers']} subscriber(s): stream errors {len(run['errors'])} {run['errors'][:2]}, "
                  f"resync snapshots {run['resyncs']} (agent counter {int(run['resynced'])}), "
                  f"rate-limited events {int(run['rate_limited'])}")
    complete = all(r["missing"] == 0 and not r["errors"] and not r["resyncs"] for r in (one, many))
    if one["latencies"] and many["latencies"]:
        p1, pn = percentile(one["latencies"], 99), percentile(many["latencies"], 99)
        print(f"fan-out: {many['subscribers']} subscribers {many['rate']:.0f} changes/s in total "
              f"({ratio(many['rate'], one['rate'], 1)} of 1 subscriber's {one['rate']:.0f}/s), p99 {fmt(pn)} vs "
              f"{fmt(p1)} ({ratio(pn, p1, 1)}); every subscriber got every change: {'PASS' if complete else 'FAIL'}")
    else:
        print("fan-out: no latency matched; every subscriber got every change: FAIL")


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m bench.clusterd_delivery",
        description="Fault delivery of npu-node-agent to a ClusterD stand-in (latency while the buckets allow, "
                    "drain after an outage) and to many fault-stream subscribers, each against a baseline measured "
                    "in the same run. Prints PASS/FAIL lines; exits 0 either way (non-zero only when the benchmark "
                    "itself could not run).")
    parser.add_argument("--cards", type=int, default=16, help="NPUs on the fake node (default 16, at most 32)")
    parser.add_argument("--poll-interval", type=float, default=1.0, help="devices.poll_interval_seconds (default 1)")
    parser.add_argument("--count", type=int, default=60, help="phase 1: new public faults (default 60)")
    parser.add_argument("--pace", type=float, default=1.2, help="phase 1: seconds between them (default 1.2)")
    parser.add_argument("--target-ms", type=float, default=200.0, help="phase 1: p99 target in ms (default 200)")
    parser.add_argument("--outage-changes", type=int, default=10000,
                        help="phase 2: fault-log changes to pile up during the outage (default 10000)")
    parser.add_argument("--outage-rate", type=float, default=300.0, help="phase 2: driver events/s (default 300)")
    parser.add_argument("--outage-seconds", type=float, default=75.0,
                        help="phase 2: stop injecting after this long even if the target is not reached (default 75)")
    parser.add_argument("--flappers", type=int, default=1,
                        help="phase 2: devices whose public fault flaps (every change a transition; default 1)")
    parser.add_argument("--subscribers", type=int, default=100, help="phase 3: concurrent subscribers (default 100)")
    parser.add_argument("--subscriber-procs", type=int, default=4, help="phase 3: worker processes (default 4)")
    parser.add_argument("--fanout-changes", type=int, default=500, help="phase 3: once events per run (default 500)")
    parser.add_argument("--fanout-rate", type=float, default=50.0, help="phase 3: once events/s (default 50)")
    parser.add_argument("--budget", type=float, default=330.0,
                        help="seconds from the start after which the phase-2 drain wait gives up (default 330)")
    args = parser.parse_args(argv)
    if not 1 <= args.cards <= 32:
        parser.error("--cards must be 1..32 (ClusterD accepts device ids 0..31)")
    if not 1 <= args.count <= len(LADDER) * args.cards:
        parser.error(f"--count must be 1..{len(LADDER) * args.cards} (each device climbs {len(LADDER)} levels)")
    if args.pace < 1.0:
        parser.error("--pace below 1 s would let the agent's own 1 request/s budget delay deliveries")
    if not 0 <= args.flappers <= args.cards:
        parser.error("--flappers must be 0..--cards")
    if args.poll_interval < 0.2 or args.outage_rate <= 0 or args.fanout_rate <= 0 or args.subscribers < 1:
        parser.error("--poll-interval at least 0.2; rates and --subscribers positive")
    # Phase 3 runs twice (1 and N subscribers) on the event budget; once events over it are lost.
    runs = 2 * args.fanout_changes
    low = RATE_LIMIT_PER_MINUTE - runs - args.count + (runs / args.fanout_rate) * RATE_LIMIT_PER_MINUTE / 60
    if low < 1:
        parser.error("--fanout-changes at --fanout-rate would exceed the agent's event rate limit "
                     f"({RATE_LIMIT_PER_MINUTE}/min, burst {RATE_LIMIT_PER_MINUTE}); lower them")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="npa-cd-", dir="/tmp"))  # short: the control socket lives here
    agent = fake = watcher = standin = None
    try:
        library = build_fake_dcmi(workdir / "lib")
        trace = workdir / "trace.log"
        (workdir / "agent").mkdir()
        standin = ClusterdStandIn().start()
        config = {"log": {"level": "info"},
                  "devices": {"backend": "dcmi", "dcmi_library": str(library),
                              "poll_interval_seconds": args.poll_interval, "call_timeout_seconds": 2.0},
                  "clusterd": {"enabled": True, "address": f"127.0.0.1:{standin.port}"}}
        env = {"FAKE_DCMI_CARDS": str(args.cards), "FAKE_DCMI_CONTROL": str(workdir / "ctl.sock"),
               "FAKE_DCMI_TRACE": str(trace)}
        print(f"npu-node-agent delivery: {args.cards} fake NPUs, poll interval {args.poll_interval:g} s, "
              f"ClusterD stand-in on 127.0.0.1:{standin.port} (1 request/s, burst {CLUSTERD_BURST}); "
              f"{psutil.cpu_count()} CPUs")
        agent = AgentProcess(workdir / "agent", config, env).start()
        wait_until(lambda: agent.http("/readyz")[0] == 200, 20, "agent /readyz 200")
        wait_until(lambda: metric_or_none(agent, "npu_agent_driver_events_subscribed") == 1, 10,
                   "the agent subscribed to driver events")
        fake = FakeDcmiControl(workdir / "ctl.sock").connect()
        print(f"  agent pid {agent.process.pid}, gRPC 127.0.0.1:{agent.grpc_port}")

        print(f"phase 1: {args.count} occur events {args.pace:g} s apart, each a new public fault")
        watcher = start_watcher(agent)
        p1 = latency_phase(args, fake, watcher, standin, trace)
        clear_all(args, fake, watcher, standin, agent, [code for code, _ in LADDER])
        watcher.close()
        watcher = None

        print(f"phase 3: fan-out, {args.fanout_changes} once events at {args.fanout_rate:g}/s to 1, then "
              f"{args.subscribers} subscribers")
        one = fanout_run(args, agent, fake, trace, 1, FANOUT_CODE_BASES[0])
        time.sleep(args.poll_interval + 0.5)  # the once codes expire (on show one poll interval)
        many = fanout_run(args, agent, fake, trace, args.subscribers, FANOUT_CODE_BASES[1])
        time.sleep(args.poll_interval + 0.5)

        print(f"phase 2: outage; up to {args.outage_rate:g} driver events/s until {args.outage_changes} changes "
              f"are pending (at most {args.outage_seconds:g} s), then the stand-in restarts")
        watcher = start_watcher(agent)
        wait_until(lambda: metric_or_none(agent, "npu_agent_outbox_pending") == 0 and not standin.active(), 15,
                   "a drained outbox before the outage")
        p2 = outage_phase(args, agent, fake, watcher, standin, started + args.budget)

        report_latency(args, p1)
        report_outage(args, p2)
        report_fanout(args, one, many)
        print()
        print(f"total run time {time.time() - started:.0f} s")
        return 0
    except Exception as exc:  # noqa: BLE001 - the benchmark could not run: say why, exit non-zero
        print(f"benchmark error: {exc}", file=sys.stderr)
        if agent is not None and agent.raw_stderr:
            print("last agent log lines:\n" + "".join(agent.raw_stderr[-15:]), file=sys.stderr)
        return 1
    finally:
        if watcher is not None:
            watcher.close()
        if fake is not None:
            fake.close()
        if agent is not None:
            try:
                took = agent.stop()
                print(f"agent stopped (SIGTERM) in {took:.2f} s")
            except AssertionError as exc:
                print(f"warning: agent stop: {exc}", file=sys.stderr)
        if standin is not None:
            standin.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
