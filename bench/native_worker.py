"""In-process collection: the fake profiler's records -> bytes on disk, native vs pure Python vs memcpy.

Run from the repository root:  .venv/bin/python -m bench.native_worker      # ~1 min on 2 cores

The fake `libmspti.so` of the tests (tests/fakes/mspti, built here with cc) emits marker records
from its own thread through the real buffer protocol (request a buffer, fill it, complete it) as
fast as it can. The collector under test hands out pooled buffers, walks each completed one with
`msptiActivityGetNextRecord` and serialises the records into TaskD's JSON lines; this process drains
them and appends them to a file, as `agent.worker` does. Measured per implementation, in the same
run: wall time from the first emit to the last byte written, records/s, CPU seconds per million
records (this process: the fake's emitter thread, the callbacks and the drain/write loop together),
CPU per completed 1 MiB buffer (an upper bound of the time spent in the completion callback), and
records lost (buffers declined by the pool, records dropped from a full ring) -- at full speed, and
sustained at 1,000,000 records/s (10 ms bursts for 5 s) while draining and writing. Baselines: the
pure-Python ctypes collector (`agent.worker.fallback`) on fewer records, and a `memcpy` of the same
number of output bytes plus the same file write (the physical ceiling). Targets: >= 2,000,000
records/s end to end on one core, >= 20x the Python collector, zero records lost at >= 1,000,000
records/s sustained.

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

from tests.fakes.mspti import build_fake_mspti, load_fake_mspti

NAME, DOMAIN = b"forward", b"default"


def run(collector_class, lib_path: Path, fake, records: int, out: Path) -> dict:
    fake.fake_mspti_reset()
    collector = collector_class(str(lib_path), buffers=64, buffer_bytes=1 << 20, ring_bytes=256 << 20)
    collector.set_switch(True, False)
    written = 0
    with open(out, "wb") as handle:
        cpu, wall = time.process_time(), time.perf_counter()
        fake.fake_mspti_emit(records, NAME, DOMAIN, 16, 0)
        while True:
            idle = fake.fake_mspti_emitted() + fake.fake_mspti_dropped() >= records
            if idle:
                fake.fake_mspti_wait_idle()
                collector.flush()
            data = collector.drain()
            if data:
                handle.write(data)
                written += len(data)
            elif idle:
                break
            else:
                time.sleep(0.001)  # nothing completed yet: the emitter is filling a buffer
        handle.flush()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    counters = collector.counters()
    collector.close()
    lost = fake.fake_mspti_dropped() + counters["records_dropped"]
    return {"records": counters["records"], "bytes": written, "wall": wall, "cpu": cpu, "lost": lost,
            "declined": counters["buffers_declined"], "buffers": max(1, counters["buffers_completed"])}


def paced(collector_class, lib_path: Path, fake, rate: int, seconds: float, out: Path) -> dict:
    """Emit `rate` records/s for `seconds` in 10 ms bursts (each from a fake thread) while draining
    and writing, as a training process would; what was lost."""
    fake.fake_mspti_reset()
    collector = collector_class(str(lib_path), buffers=64, buffer_bytes=1 << 20, ring_bytes=256 << 20)
    collector.set_switch(True, False)
    burst, tick = rate // 100, 0.01
    emitted = 0
    with open(out, "wb") as handle:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            due = start + (emitted // burst) * tick
            if time.perf_counter() >= due:
                fake.fake_mspti_emit(burst, NAME, DOMAIN, 16, 0)
                emitted += burst
            handle.write(collector.drain())
        fake.fake_mspti_wait_idle()
        collector.flush()
        handle.write(collector.drain())
        achieved = emitted / (time.perf_counter() - start)
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
                  f"{r['cpu'] / r['buffers'] * 1e3:.2f} ms CPU per completed buffer, lost {r['lost']} "
                  f"(declined buffers {r['declined']})")
        print(f"  memcpy  {native['bytes'] / 2**20:8.1f} MiB copied and written in {ceiling_s:.3f} s")
        native_rate = native["records"] / native["wall"]
        python_rate = python["records"] / python["wall"]
        ceiling_rate = native["records"] / ceiling_s
        print()
        print(f"native: {native_rate:,.0f} records/s end to end; python {python_rate:,.0f}/s (ratio {native_rate / python_rate:.1f}x); "
              f"memcpy ceiling {ceiling_rate:,.0f}/s (native at {native_rate / ceiling_rate:.2f} of it); "
              f"targets >= 2,000,000/s: {'PASS' if native_rate >= 2e6 else 'FAIL'}, >= 20x python: "
              f"{'PASS' if native_rate >= 20 * python_rate else 'FAIL'}")
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
