"""In-process collection: the fake profiler's records -> bytes on disk, native vs pure Python vs memcpy.

Run from the repository root:  .venv/bin/python -m bench.native_worker      # ~1 min on 2 cores

The fake `libmspti.so` of the tests (testkit/fakes/mspti, built here with cc) emits marker records
from its own thread through the real buffer protocol (request a buffer, fill it, complete it) as
fast as it can. The collector under test hands out pooled buffers, walks each completed one with
`msptiActivityGetNextRecord` and serialises the records into TaskD's JSON lines; this process
appends them to a file as `agent.worker` does (the native collector writes them from its ring itself,
`drain_to`; the Python one hands over bytes that are written). Measured per implementation, in the
same run: wall time from the first emit to the last byte written, records/s, CPU seconds per million
records (this process: the fake's emitter thread, the callbacks and the drain/write loop together),
the time spent inside the completion callback (per 1 MiB buffer, mean and max, and per record;
measured by the collector itself), and records lost (buffers declined by the pool, records dropped
from a full ring) -- at full speed, and sustained at 1,000,000 records/s (10 ms bursts for 5 s)
while draining and writing. Baselines: the pure-Python ctypes collector (`agent.worker.fallback`)
on fewer records, and a `memcpy` of the same number of output bytes plus the same file write (one
copy and the write: what the native path does too, so a reference rather than a strict ceiling).
Targets: >= 2,000,000 records/s end to end on one core, >= 20x the Python collector, zero records
lost at >= 1,000,000 records/s sustained.

`--records` and `--python-records` change the amounts.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from testkit.fakes.mspti import build_fake_mspti, load_fake_mspti

NAME, DOMAIN = b"forward", b"default"


def write_waiting(collector, fd: int) -> int:
    """Append the collector's complete lines to fd as agent.worker does; the bytes written."""
    if hasattr(collector, "drain_to"):
        return collector.drain_to(fd)[0]  # straight from the native ring, without the GIL
    data = collector.drain()
    view, done = memoryview(data), 0
    while done < len(data):
        done += os.write(fd, view[done:])
    return done


def run(collector_class, lib_path: Path, fake, records: int, out: Path) -> dict:
    fake.fake_mspti_reset()
    collector = collector_class(str(lib_path), buffers=64, buffer_bytes=1 << 20, ring_bytes=256 << 20)
    collector.set_switch(True, False)
    written = 0
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        cpu, wall = time.process_time(), time.perf_counter()
        fake.fake_mspti_emit(records, NAME, DOMAIN, 16, 0)
        while True:
            idle = fake.fake_mspti_emitted() + fake.fake_mspti_dropped() >= records
            if idle:
                fake.fake_mspti_wait_idle()
                collector.flush()
            size = write_waiting(collector, fd)
            written += size
            if not size and idle:
                break
            if not size:
                time.sleep(0.001)  # nothing completed yet: the emitter is filling a buffer
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        os.close(fd)
    counters = collector.counters()
    collector.close()
    lost = fake.fake_mspti_dropped() + counters["records_dropped"]
    buffers = max(1, counters["buffers_completed"])
    return {"records": counters["records"], "bytes": written, "wall": wall, "cpu": cpu, "lost": lost,
            "declined": counters["buffers_declined"], "buffers": buffers,
            "callback_mean": counters["complete_ns"] / buffers / 1e6, "callback_max": counters["complete_max_ns"] / 1e6,
            "callback_per_record": counters["complete_ns"] / max(1, counters["records"])}


def paced(collector_class, lib_path: Path, fake, rate: int, seconds: float, out: Path) -> dict:
    """Emit `rate` records/s for `seconds` in 10 ms bursts (each from a fake thread) while draining
    and writing, as a training process would; what was lost."""
    fake.fake_mspti_reset()
    collector = collector_class(str(lib_path), buffers=64, buffer_bytes=1 << 20, ring_bytes=256 << 20)
    collector.set_switch(True, False)
    burst, tick = rate // 100, 0.01
    emitted = 0
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            due = start + (emitted // burst) * tick
            if time.perf_counter() >= due:
                fake.fake_mspti_emit(burst, NAME, DOMAIN, 16, 0)
                emitted += burst
            write_waiting(collector, fd)
        fake.fake_mspti_wait_idle()
        collector.flush()
        write_waiting(collector, fd)
        achieved = emitted / (time.perf_counter() - start)
    finally:
        os.close(fd)
    counters = collector.counters()
    collector.close()
    return {"emitted": emitted, "records": counters["records"], "rate": achieved,
            "lost": fake.fake_mspti_dropped() + counters["records_dropped"], "declined": counters["buffers_declined"]}


def memcpy_ceiling(size: int, out: Path) -> float:
    """memcpy of `size` bytes into a file buffer and the same write: what no collector can beat."""
    source = ctypes.create_string_buffer(size)
    target = ctypes.create_string_buffer(size)
    with open(out, "wb") as handle:
        start = time.perf_counter()
        ctypes.memmove(target, source, size)
        handle.write(memoryview(target)[:size])
        handle.flush()
        return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=4_000_000)
    parser.add_argument("--python-records", type=int, default=200_000)
    parser.add_argument("--rate", type=int, default=1_000_000, help="records/s of the sustained-loss run")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of the sustained-loss run")
    args = parser.parse_args(argv)
    try:
        from agent import _native
    except ImportError as exc:
        print(f"native_worker: the extension is not built ({exc}); run .venv/bin/pip install -e .", file=sys.stderr)
        return 2
    from agent.worker.fallback import Collector as PythonCollector

    work = Path(tempfile.mkdtemp(prefix="npa-bench-native-"))
    try:
        lib_path = build_fake_mspti(work / "lib")
        fake = load_fake_mspti(lib_path)
        print(f"in-process collection: {os.cpu_count()} CPUs, fake libmspti at {lib_path}")
        native = run(_native.Collector, lib_path, fake, args.records, work / "native.out")
        sustained = paced(_native.Collector, lib_path, fake, args.rate, args.seconds, work / "paced.out")
        python = run(PythonCollector, lib_path, fake, args.python_records, work / "python.out")
        ceiling_s = memcpy_ceiling(native["bytes"], work / "memcpy.out")
        for name, r in (("native", native), ("python", python)):
            print(f"  {name:<7} {r['records']:>10,} records, {r['bytes'] / 2**20:8.1f} MiB in {r['wall']:.3f} s: "
                  f"{r['records'] / r['wall']:>12,.0f} records/s, {r['cpu'] / r['records'] * 1e6:.2f} CPU s per million, "
                  f"completion callback {r['callback_mean']:.2f} ms per 1 MiB buffer (max {r['callback_max']:.2f} ms, "
                  f"{r['callback_per_record']:.0f} ns per record), lost {r['lost']} (declined buffers {r['declined']})")
        print(f"  memcpy  {native['bytes'] / 2**20:8.1f} MiB copied and written in {ceiling_s:.3f} s")
        native_rate = native["records"] / native["wall"]
        python_rate = python["records"] / python["wall"]
        ceiling_rate = native["records"] / ceiling_s
        print()
        print(f"native: {native_rate:,.0f} records/s end to end; python {python_rate:,.0f}/s (ratio {native_rate / python_rate:.1f}x); "
              f"memcpy ceiling {ceiling_rate:,.0f}/s (native at {native_rate / ceiling_rate:.2f} of it); "
              f"targets >= 2,000,000/s: {'PASS' if native_rate >= 2e6 else 'FAIL'}, >= 20x python: "
              f"{'PASS' if native_rate >= 20 * python_rate else 'FAIL'}")
        print(f"completion callback per record: native {native['callback_per_record']:,.0f} ns, python "
              f"{python['callback_per_record']:,.0f} ns ({python['callback_per_record'] / native['callback_per_record']:.0f}x); "
              f"per 1 MiB buffer native {native['callback_mean']:.2f} ms mean, {native['callback_max']:.2f} ms max")
        loss_ok = sustained["lost"] == 0 and sustained["rate"] >= 0.95 * args.rate
        print(f"loss: {sustained['lost']} of {sustained['emitted']:,} records lost at a sustained "
              f"{sustained['rate']:,.0f}/s for {args.seconds:g} s (declined buffers {sustained['declined']}); "
              f"at full speed {native['lost']:,} of {native['records'] + native['lost']:,}"
              f"{' (the ring filled while the file write lagged)' if native['lost'] else ''}; target zero at 1,000,000/s: {'PASS' if loss_ok else 'FAIL'}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
