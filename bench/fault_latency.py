"""Fault latency of npu-node-agent: fake driver callback -> change on the agent's gRPC fault stream.

The real agent (`python -m agent run`) runs as a subprocess against the fake libdcmi.so built from
C (testkit/fakes/dcmi), with FAKE_DCMI_CARDS NPUs and the given poll interval. A gRPC client in this
process, on its own thread, watches the fault stream and stamps every change with time.time_ns()
on receipt.

Event path: `once` events, one distinct code per injection, spread over the devices and paced
under the agent's event rate limit. The fake writes `cb <CLOCK_REALTIME ns> <logic> <CODE> <assertion>`
to FAKE_DCMI_TRACE right before it calls the agent's callback; the latency of an injection is the
receipt time of the first change whose device (logic id) lists that code, minus that trace time.

Baseline, same agent, same run: faults that raise no event (`occur ... silent`), which only the
agent's poll can find -- the way the Ascend Device Plugin evaluates faults on its 5 s loop. Their
latency runs from just before the control command that changed the driver's state to the first
change listing the code. They are injected at random moments over two poll periods so the poll
phase is sampled, then recovered silently (the recovery latency is shown too).

Run from the repository root:  .venv/bin/python -m bench.fault_latency
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from agent._proto import npu_agent_faults_pb2 as pb
from agent._proto import npu_agent_faults_pb2_grpc as pb_grpc
from bench.stats import percentile
from testkit.agent import AgentProcess
from testkit.fakes.dcmi import FakeDcmiControl, build_fake_dcmi
from testkit.wait import wait_until

EVENT_CODE_BASE = 0x8A000000
SILENT_CODE_BASE = 0x8B000000
RATE_LIMIT_PER_MINUTE = 1000  # the agent's token bucket (burst = the same number)


# ---- the stream client ---------------------------------------------------------------------------


class StreamRecorder:
    """Watches the fault stream on its own thread and records when each (logic id, code) came and went."""

    def __init__(self, port: int):
        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self._call = pb_grpc.NodeFaultsStub(self._channel).Watch(pb.WatchRequest())
        self._lock = threading.Lock()
        self.snapshot_seen = threading.Event()
        self.first_seen: dict[tuple[int, int], int] = {}  # (logic, code) -> ns of the first change listing it
        self.gone: dict[tuple[int, int], int] = {}  # (logic, code) -> ns of the first change no longer listing it
        self.current: dict[int, frozenset[int]] = {}  # logic -> codes in its latest state
        self.changes = 0
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
                        for device in response.snapshot.devices:
                            self.current[device.logic_id] = frozenset(int(c.code, 16) for c in device.codes)
                    self.snapshot_seen.set()
                elif kind == "change":
                    device = response.change.device
                    codes = frozenset(int(c.code, 16) for c in device.codes)
                    logic = device.logic_id
                    with self._lock:
                        self.changes += 1
                        for code in codes:
                            self.first_seen.setdefault((logic, code), received)
                        for code in self.current.get(logic, frozenset()) - codes:
                            self.gone.setdefault((logic, code), received)
                        self.current[logic] = codes
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = exc
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc

    def seen(self, keys) -> bool:
        with self._lock:
            return all(k in self.first_seen for k in keys)

    def cleared(self, keys) -> bool:
        with self._lock:
            return all(k in self.gone for k in keys)

    def all_devices_clear(self) -> bool:
        with self._lock:
            return bool(self.current) and not any(self.current.values())

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(5)
        self._channel.close()


# ---- statistics ---------------------------------------------------------------------------------


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values)}


def fmt(seconds: float) -> str:
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"


def read_trace(path: Path) -> dict[tuple[int, int], int]:
    """(logic, code) -> ns of the fake's callback, from its trace lines `cb <ns> <logic> <CODE> <assertion>`."""
    stamps: dict[tuple[int, int], int] = {}
    if not path.exists():
        return stamps
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[0] == "cb":
            stamps.setdefault((int(parts[2]), int(parts[3], 16)), int(parts[1]))
    return stamps


def metric_or_none(agent: AgentProcess, name: str, **labels) -> float | None:
    try:
        return agent.metric(name, **labels)
    except Exception:  # noqa: BLE001 - a report line, never a reason to fail the run
        return None


# ---- the phases ---------------------------------------------------------------------------------


def event_phase(args, fake: FakeDcmiControl, stream: StreamRecorder, trace: Path) -> tuple[list[float], list[tuple]]:
    """`once` events paced at args.rate per second; returns latencies (s) and the slowest injections."""
    injected: list[tuple[int, int, int]] = []  # (index, logic, code)
    start = time.monotonic()
    for i in range(args.count):
        due = start + i / args.rate
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # pacing under the rate limit, not synchronisation
        logic, code = i % args.cards, EVENT_CODE_BASE + i
        fake.once(logic, code, severity=1)  # replies once the agent's callback has returned
        injected.append((i, logic, code))
    injected_in = time.monotonic() - start
    keys = [(logic, code) for _, logic, code in injected]
    try:
        wait_until(lambda: stream.seen(keys) or stream.error, 10.0, "every once event on the stream", 0.01)
    except AssertionError:
        pass  # reported as missing below
    if stream.error:
        raise RuntimeError(f"fault stream failed: {stream.error!r}")
    callbacks = read_trace(trace)
    latencies, rows, missing = [], [], 0
    for i, logic, code in injected:
        cb = callbacks.get((logic, code))
        seen = stream.first_seen.get((logic, code))
        if cb is None or seen is None:
            missing += 1
            continue
        latency = (seen - cb) / 1e9
        latencies.append(latency)
        rows.append((latency, i, logic, code, (cb - callbacks[keys[0]]) / 1e9 if keys[0] in callbacks else float("nan")))
    print(f"  injected {len(injected)} once events over {injected_in:.1f} s ({len(injected) / injected_in:.0f}/s); "
          f"matched {len(latencies)}, missing {missing}")
    rows.sort(reverse=True)
    return latencies, rows[:5]


def once_hold(stream: StreamRecorder, args) -> list[float]:
    keys = [(i % args.cards, EVENT_CODE_BASE + i) for i in range(args.count)]
    return [(stream.gone[k] - stream.first_seen[k]) / 1e9 for k in keys if k in stream.gone and k in stream.first_seen]


def paced(n: int, window: float, rng: random.Random):
    """Yield 0..n-1, each at a random moment of its own slot of `window` / n seconds (stratified sampling)."""
    slot = window / n
    start = time.monotonic()
    for k in range(n):
        pause = start + k * slot + rng.uniform(0, slot) - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # spreading injections over the poll phase, not synchronisation
        yield k


def silent_phase(args, fake: FakeDcmiControl, stream: StreamRecorder) -> tuple[list[float], list[float]]:
    """Silent occurs at random moments over two poll periods, then silent recoveries the same way;
    the latencies (s) of both."""
    rng = random.Random(args.seed)
    window = 2 * args.poll_interval
    started = time.monotonic()
    injected: list[tuple[int, int, int]] = []  # (logic, code, ns just before the driver state changed)
    for k in paced(args.silent, window, rng):
        logic = (k * 5) % args.cards  # visits every device when cards and 5 are coprime
        code = SILENT_CODE_BASE + k
        changed = time.time_ns()
        fake.occur(logic, code, severity=2, via="silent")
        injected.append((logic, code, changed))
    keys = [(logic, code) for logic, code, _ in injected]
    try:
        wait_until(lambda: stream.seen(keys) or stream.error, args.poll_interval + 5, "silent faults found by a poll", 0.01)
    except AssertionError:
        pass
    found = [(stream.first_seen[(l, c)] - t) / 1e9 for l, c, t in injected if (l, c) in stream.first_seen]
    print(f"  injected {len(injected)} silent faults over {time.monotonic() - started:.1f} s; found {len(found)}")

    started = time.monotonic()
    recovered: list[tuple[int, int, int]] = []
    for k in paced(len(injected), window, rng):
        logic, code, _ = injected[k]
        changed = time.time_ns()
        fake.recover(logic, code, via="silent")
        recovered.append((logic, code, changed))
    try:
        wait_until(lambda: stream.cleared(keys) or stream.error, args.poll_interval + 5, "silent recoveries found by a poll", 0.01)
    except AssertionError:
        pass
    cleared = [(stream.gone[(l, c)] - t) / 1e9 for l, c, t in recovered if (l, c) in stream.gone]
    print(f"  recovered them silently the same way over {time.monotonic() - started:.1f} s; cleared {len(cleared)}")
    return found, cleared


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m bench.fault_latency",
        description="Fault latency of npu-node-agent from the fake libdcmi.so's event callback to the change on "
                    "the agent's gRPC fault stream, against the same agent's polling path (faults that raise no "
                    "event, found by the poll loop). Prints p50/p90/p99/max and PASS/FAIL against the target; "
                    "exits 0 either way (non-zero only when the benchmark itself could not run).")
    parser.add_argument("--count", type=int, default=1000, help="once events to inject (default 1000)")
    parser.add_argument("--cards", type=int, default=16, help="NPUs on the fake node, FAKE_DCMI_CARDS (default 16)")
    parser.add_argument("--rate", type=float, default=50.0,
                        help="once events per second (default 50; the agent accepts 1000/min with a burst of 1000)")
    parser.add_argument("--poll-interval", type=float, default=5.0,
                        help="the agent's devices.poll_interval_seconds, also the baseline loop (default 5)")
    parser.add_argument("--silent", type=int, default=20, help="silent faults for the polling baseline (default 20)")
    parser.add_argument("--target-ms", type=float, default=50.0, help="event-path p99 target in ms (default 50)")
    parser.add_argument("--seed", type=int, default=1, help="seed for the silent injections' timing (default 1)")
    args = parser.parse_args(argv)
    if not 1 <= args.cards <= 64:
        parser.error("--cards must be 1..64 (the fake's limit)")
    if args.count < 1 or args.silent < 1 or args.rate <= 0 or args.poll_interval < 0.2:
        parser.error("--count, --silent and --rate must be positive, --poll-interval at least 0.2")
    # Tokens left at the end of the burst: capacity - count + refill over the injection time.
    low = RATE_LIMIT_PER_MINUTE - args.count + (args.count / args.rate) * RATE_LIMIT_PER_MINUTE / 60
    if low < 1:
        parser.error(f"--count {args.count} at --rate {args.rate:g}/s would exceed the agent's event rate limit "
                     f"({RATE_LIMIT_PER_MINUTE}/min, burst {RATE_LIMIT_PER_MINUTE}); lower the rate")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="npa-bench-", dir="/tmp"))  # short: the control socket lives here
    agent = fake = stream = None
    try:
        library = build_fake_dcmi(workdir / "lib")
        trace = workdir / "trace.log"
        (workdir / "agent").mkdir()
        config = {"log": {"level": "info"},
                  "devices": {"backend": "dcmi", "dcmi_library": str(library),
                              "poll_interval_seconds": args.poll_interval, "call_timeout_seconds": 2.0}}
        env = {"FAKE_DCMI_CARDS": str(args.cards), "FAKE_DCMI_CONTROL": str(workdir / "ctl.sock"),
               "FAKE_DCMI_TRACE": str(trace)}
        print(f"npu-node-agent fault latency: {args.cards} fake NPUs, poll interval {args.poll_interval:g} s")
        agent = AgentProcess(workdir / "agent", config, env).start()
        wait_until(lambda: agent.http("/readyz")[0] == 200, 20, "agent /readyz 200")
        wait_until(lambda: metric_or_none(agent, "npu_agent_driver_events_subscribed") == 1, 10,
                   "the agent subscribed to driver events")
        fake = FakeDcmiControl(workdir / "ctl.sock").connect()
        stream = StreamRecorder(agent.grpc_port)
        wait_until(lambda: stream.snapshot_seen.is_set() or stream.error, 10, "the stream's first snapshot", 0.01)
        if stream.error:
            raise RuntimeError(f"fault stream failed: {stream.error!r}")
        print(f"  agent pid {agent.process.pid}, gRPC 127.0.0.1:{agent.grpc_port}, stream subscribed")

        print(f"event path: {args.count} once events, distinct codes {EVENT_CODE_BASE:08X}.., "
              f"round-robin over {args.cards} devices, {args.rate:g}/s")
        event, slowest = event_phase(args, fake, stream, trace)
        if not event:
            raise RuntimeError("no once event reached the stream")
        # Let the once codes expire (they stay on show one poll interval) before the polling baseline.
        wait_until(lambda: stream.all_devices_clear() or stream.error, args.poll_interval + 10,
                   "every once code to expire", 0.05)
        holds = once_hold(stream, args)

        print(f"polling path: {args.silent} silent faults (no event) at random moments over "
              f"{2 * args.poll_interval:g} s, found only by the agent's poll")
        polled, polled_recovery = silent_phase(args, fake, stream)

        dropped = metric_or_none(agent, "npu_agent_driver_events_total", result="rate_limited")
        accepted = metric_or_none(agent, "npu_agent_driver_events_total", result="accepted")

        # ---- report -------------------------------------------------------------------------------
        rows = [("event path (once, callback -> stream)", event)]
        if polled:
            rows.append(("polling path (silent occur -> stream)", polled))
        if polled_recovery:
            rows.append(("polling path (silent recover -> stream)", polled_recovery))
        p = args.poll_interval
        nominal = {"p50": 0.5 * p, "p90": 0.9 * p, "p99": 0.99 * p, "max": p}
        print()
        print(f"{'latency':42} {'n':>5} {'p50':>11} {'p90':>11} {'p99':>11} {'max':>11}")
        for name, values in rows:
            s = summary(values)
            print(f"{name:42} {len(values):>5} {fmt(s['p50']):>11} {fmt(s['p90']):>11} {fmt(s['p99']):>11} {fmt(s['max']):>11}")
        print(f"{f'nominal {p:g} s loop (uniform 0..{p:g} s)':42} {'-':>5} {fmt(nominal['p50']):>11} "
              f"{fmt(nominal['p90']):>11} {fmt(nominal['p99']):>11} {fmt(nominal['max']):>11}")
        print()
        print("slowest event-path injections (latency, injection #, logic id, code, callback at +s from the first):")
        for latency, i, logic, code, at in slowest:
            print(f"  {fmt(latency):>11}  #{i:<5} logic {logic:<3} {code:08X}  +{at:.3f} s")
        if holds:
            print(f"once codes stayed on the stream for {fmt(min(holds))} .. {fmt(max(holds))} "
                  f"(median {fmt(percentile(holds, 50))}; expected one poll interval, {p:g} s)")
        print(f"driver events accepted {accepted if accepted is None else int(accepted)}, "
              f"rate-limited {dropped if dropped is None else int(dropped)}; stream changes received {stream.changes}")
        print()
        event_p99 = percentile(event, 99)
        target = args.target_ms / 1e3
        verdict = "PASS" if event_p99 < target and len(event) == args.count else "FAIL"
        if polled:
            poll_p99 = percentile(polled, 99)
            print(f"event path p99 = {fmt(event_p99)}; polling path ({p:g} s loop, the device plugin's period) "
                  f"p99 = {fmt(poll_p99)}; ratio {event_p99 / poll_p99:.4f}; target p99 < {args.target_ms:g} ms: {verdict}")
        else:
            print(f"event path p99 = {fmt(event_p99)}; polling path: no silent fault was found; "
                  f"target p99 < {args.target_ms:g} ms: {verdict}")
        print(f"nominal baseline: a {p:g} s polling loop finds a fault after {fmt(nominal['p50'])} on average, "
              f"{fmt(p)} at worst; event path p99 / nominal worst = {event_p99 / p:.4f}")
        if len(event) != args.count:
            print(f"FAIL: {args.count - len(event)} of {args.count} once events never reached the stream")
        return 0
    except Exception as exc:  # noqa: BLE001 - the benchmark could not run: say why, exit non-zero
        print(f"benchmark error: {exc}", file=sys.stderr)
        if agent is not None and agent.raw_stderr:
            print("last agent log lines:\n" + "".join(agent.raw_stderr[-15:]), file=sys.stderr)
        return 1
    finally:
        if stream is not None:
            stream.close()
        if fake is not None:
            fake.close()
        if agent is not None:
            try:
                took = agent.stop()
                print(f"agent stopped (SIGTERM) in {took:.2f} s")
            except AssertionError as exc:
                print(f"warning: agent stop: {exc}", file=sys.stderr)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
