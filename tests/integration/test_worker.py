"""The ctypes collector and the worker end to end against the fake libmspti (testkit/fakes/mspti).

The fake is one shared library per process, loaded once: every test switches it off again (the
collector's close does) and resets its counters. The module-level API and the atexit hook run in
child processes, which get their own instance.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent.steps import records
from agent.worker import jsonlines
from agent.worker.fallback import Collector
from agent.worker.runtime import Worker
from testkit import REPO
from testkit.fakes.mspti import load_fake_mspti
from testkit.fakes.mspti.trainer import Trainer, trainer_env
from testkit.fakes.tasknet.driver import free_port, manager
from testkit.wait import wait_until

MARKER, KERNEL, API, MEMORY = 1, 2, 3, 5
STATE_COMM, STATE_SUBSCRIBED, STATE_FOREIGN = 1 << 32, 1 << 33, 1 << 34


@pytest.fixture(scope="module")
def lib_path(fake_mspti_path) -> Path:
    return fake_mspti_path


@pytest.fixture
def fake(lib_path):
    """The fake, fresh for each test (the library is shared by the whole run)."""
    lib = load_fake_mspti(lib_path)
    lib.fake_mspti_reset()
    yield lib
    lib.fake_mspti_wait_idle()


@pytest.fixture
def collectors(fake, lib_path):
    made = []

    def make(**kwargs) -> Collector:
        c = Collector(str(lib_path), **kwargs)
        made.append(c)
        return c

    fake.fake_mspti_reset()
    yield make
    fake.fake_mspti_wait_idle()
    for c in made:
        c.close()
    fake.fake_mspti_reset()


def read_rank(root: Path, job: str, rank: int) -> tuple[list[str], bytes]:
    rank_dir = root / job / str(rank)
    if not rank_dir.is_dir():
        return [], b""
    names = sorted(os.listdir(rank_dir))
    return names, b"".join((rank_dir / n).read_bytes() for n in names)


# -- the collector --------------------------------------------------------------------------------

def test_missing_library_and_missing_symbols(tmp_path):
    with pytest.raises(OSError, match="cannot load"):
        Collector(str(tmp_path / "libmspti.so"))
    libc = ctypes.util.find_library("c")
    with pytest.raises(OSError, match="has no symbol msptiActivityRegisterCallbacks"):
        Collector(libc)


def test_switch_calls_reach_mspti(fake, collectors):
    c = collectors()
    assert fake.fake_mspti_state() == 0
    assert c.set_switch(True, False) == (1, 0)  # (default, comm): 0 off, 1 on, 2 exception
    assert fake.fake_mspti_state() == (1 << MARKER) | STATE_SUBSCRIBED
    assert c.set_switch(True, True) == (1, 1)
    assert fake.fake_mspti_state() == (1 << MARKER) | STATE_SUBSCRIBED | STATE_COMM
    fake.msptiActivityEnable(API)
    fake.msptiActivityEnable(KERNEL)
    assert c.set_switch(False, True) == (0, 1)  # off: MARKER, KERNEL, API disabled, unsubscribed; comm as asked
    assert fake.fake_mspti_state() == STATE_COMM
    assert c.set_switch(False, False) == (0, 0)
    assert fake.fake_mspti_state() == 0
    c.set_switch(True, True)
    c.close()
    assert fake.fake_mspti_state() == 0
    c.close()  # idempotent
    with pytest.raises(ValueError):
        c.set_switch(True, False)


def test_another_profiler_holding_the_subscriber_slot_is_an_exception(fake, collectors):
    c = collectors()
    fake.fake_mspti_set_foreign_subscriber(1)  # e.g. MindStudio runs in this process
    assert c.set_switch(True, True) == (2, 1)
    # The sequence is TaskD's whatever the results: MARKER is enabled all the same.
    assert fake.fake_mspti_state() == (1 << MARKER) | STATE_COMM | STATE_FOREIGN
    assert c.set_switch(False, False) == (0, 0)  # nothing of ours to unsubscribe
    fake.fake_mspti_set_foreign_subscriber(0)
    assert c.set_switch(True, False) == (1, 0)  # the slot is free again: subscribed now
    assert fake.fake_mspti_state() == (1 << MARKER) | STATE_SUBSCRIBED
    fake.fake_mspti_set_result(b"msptiActivityDisableMarkerDomain", 999)
    assert c.set_switch(True, False) == (1, 2)


def test_records_drained_exactly_once_byte_exact(fake, collectors):
    c = collectors(buffers=8, buffer_bytes=4096)
    c.set_switch(True, False)
    fake.fake_mspti_set_object_id(1, 48213, 48230)
    names = [b"step 1", None, b'quote " back \\ <&>', "\u2028é".encode(), b"\xff\xe2\x82 bad", b"tab\there"]
    for name in names:
        fake.fake_mspti_emit(1, name, b"default", 16, 0)
        fake.fake_mspti_wait_idle()
    first_id = fake.fake_mspti_next_id() - len(names)
    c.flush()
    data = c.drain()
    assert c.drain() == b""
    expected = b"".join(
        jsonlines.marker_line(16, 0, 1755771234000000000 + (first_id + i) * 1000, first_id + i, 48213, 48230, name,
                              b"default")
        for i, name in enumerate(names))
    assert data == expected
    parsed = records.parse(data)
    assert parsed.errors == [] and len(parsed.markers) == len(names)
    counters = c.counters()
    assert counters["records"] == len(names) and counters["bytes"] == len(data)
    assert counters["records_dropped"] == counters["records_skipped"] == 0


def test_many_records_from_several_threads_arrive_once(fake, collectors):
    c = collectors(buffers=32, buffer_bytes=64 * 1024)
    c.set_switch(True, False)
    for t in range(4):
        fake.fake_mspti_emit(20000, f"step {t}".encode(), b"default", 2, 0)
    fake.fake_mspti_wait_idle()
    c.flush()
    data = c.drain()
    emitted, dropped = fake.fake_mspti_emitted(), fake.fake_mspti_dropped()
    assert emitted + dropped == 80000
    parsed = records.parse(data)
    assert parsed.errors == []
    ids = [int(m[records.ID]) for m in parsed.markers]
    assert len(ids) == len(set(ids)) == emitted
    counters = c.counters()
    assert counters["records"] == emitted
    assert counters["buffers_declined"] == fake.fake_mspti_declined()
    assert counters["buffers_requested"] == fake.fake_mspti_requests()


def test_pool_exhaustion_declines_and_counts(fake, collectors):
    c = collectors(buffers=2, buffer_bytes=1024)  # 18 records a buffer
    c.set_switch(True, False)
    fake.fake_mspti_hold_completions(1)  # mspti keeps the full buffers: the pool runs dry
    fake.fake_mspti_emit(200, b"step", b"default", 2, 0)
    fake.fake_mspti_wait_idle()
    fake.fake_mspti_hold_completions(0)
    c.flush()
    data = c.drain()
    counters = c.counters()
    assert counters["buffers_declined"] > 0
    assert counters["buffers_declined"] == fake.fake_mspti_declined()
    assert counters["records"] == fake.fake_mspti_emitted() == data.count(b"\n")
    assert fake.fake_mspti_emitted() + fake.fake_mspti_dropped() == 200
    # the buffers came back: collecting works again
    fake.fake_mspti_emit(10, b"again", b"default", 2, 0)
    fake.fake_mspti_wait_idle()
    c.flush()
    assert c.drain().count(b"\n") == 10


def test_ring_limit_drops_and_counts(fake, collectors):
    line = len(jsonlines.marker_line(2, 0, 1755771234000001000, 1, 1, 2, b"s", b"default"))
    c = collectors(buffers=4, buffer_bytes=4096, ring_bytes=line * 10)
    c.set_switch(True, False)
    fake.fake_mspti_set_object_id(1, 1, 2)
    fake.fake_mspti_emit(30, b"s", b"default", 2, 0)
    fake.fake_mspti_wait_idle()
    c.flush()
    data = c.drain()
    counters = c.counters()
    assert 0 < data.count(b"\n") <= 10
    assert counters["records"] == data.count(b"\n")
    assert counters["records_dropped"] == 30 - counters["records"]


def test_api_kernel_and_other_kinds(fake, collectors):
    c = collectors()
    fake.fake_mspti_set_object_id(1, 7, 8)
    for kind in (API, KERNEL, MEMORY):
        fake.msptiActivityEnable(kind)
    start = fake.fake_mspti_next_id()
    fake.fake_mspti_emit_kind(API, 1, b"aclnnAdd", None, 0, 0)
    fake.fake_mspti_wait_idle()
    fake.fake_mspti_emit_kind(KERNEL, 1, b"Add<f>", b"AI_CORE", 0, 0)
    fake.fake_mspti_wait_idle()
    fake.fake_mspti_emit_kind(MEMORY, 3, b"m", None, 0, 0)
    fake.fake_mspti_wait_idle()
    c.flush()
    data = c.drain()
    ts = 1755771234000000000
    assert data == (jsonlines.api_line(ts + start * 1000, ts + start * 1000 + 500, 7, 8, start, b"aclnnAdd")
                    + jsonlines.kernel_line(ts + (start + 1) * 1000, ts + (start + 1) * 1000 + 500, 7, 8, start + 1,
                                            b"AI_CORE", b"Add<f>"))
    fake.msptiActivityDisable(MEMORY)  # the collector only ever switches MARKER, KERNEL and API
    assert c.counters()["records_skipped"] == 3
    assert records.parse(data).other_kinds == 2


def test_comm_domain_filtered_until_enabled(fake, collectors):
    c = collectors()
    c.set_switch(True, False)
    fake.fake_mspti_emit(5, b'{\\"opName\\": \\"HcclAllReduce\\"}', b"communication", 2, 0)
    fake.fake_mspti_wait_idle()
    c.flush()
    assert c.drain() == b""
    c.set_switch(True, True)
    fake.fake_mspti_emit(5, b'{\\"opName\\": \\"HcclAllReduce\\"}', b"communication", 2, 0)
    fake.fake_mspti_wait_idle()
    c.flush()
    parsed = records.parse(c.drain())
    assert parsed.errors == [] and len(parsed.markers) == 5
    # As TaskD's snprintf -> Unmarshal -> Marshal round trip writes it: torch_npu's pre-escaping is
    # decoded, so the name is the JSON text that FD-OL unmarshals (taskd.md §1.4).
    name = records.text(parsed.markers[0][records.NAME])
    assert name == b'{"opName": "HcclAllReduce"}' and json.loads(name) == {"opName": "HcclAllReduce"}


def test_close_flushes_and_next_drain_returns_the_rest(fake, collectors):
    c = collectors()
    c.set_switch(True, False)
    fake.fake_mspti_emit(7, b"last", b"default", 2, 0)
    fake.fake_mspti_wait_idle()
    c.close()  # no flush before: close does it
    assert c.drain().count(b"\n") == 7
    assert c.drain() == b""
    c.flush()  # a no-op now
    fake.fake_mspti_emit(3, b"late", b"default", 2, 0)  # switched off: filtered by mspti
    fake.fake_mspti_wait_idle()
    assert fake.fake_mspti_filtered() >= 3


# -- the worker (in process) ----------------------------------------------------------------------

def write_switch(path: Path, **values) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(values))
    os.replace(tmp, path)


ALL_OFF = dict(CommunicationOperator="off", Step="off", SaveCheckpoint="off", FP="off", DataLoader="off")


def test_worker_follows_the_switch_file(fake, collectors, tmp_path):
    c = collectors()
    switch = tmp_path / "profilingSwitch"
    root = tmp_path / "profiling"
    w = Worker(5, 5000, c, root=str(root), job="job-a", switch_path=str(switch), interval=0.05)
    assert w.start()
    try:
        # no file yet: all off, nothing collected
        fake.fake_mspti_emit(10, b"step 0", b"default", 2, 0)
        fake.fake_mspti_wait_idle()
        assert fake.fake_mspti_filtered() == 10

        write_switch(switch, **{**ALL_OFF, "Step": "on"})
        wait_until(lambda: fake.fake_mspti_state() & (1 << MARKER), 10, "marker enabled")
        assert not fake.fake_mspti_state() & STATE_COMM
        fake.fake_mspti_emit(100, b"step 1", b"default", 16, 0)
        fake.fake_mspti_emit(100, b"hccl", b"communication", 16, 0)  # comm off: filtered
        fake.fake_mspti_wait_idle()
        wait_until(lambda: read_rank(root, "job-a", 5)[1].count(b"\n") >= 100, 10, "100 lines on disk")

        write_switch(switch, **{**ALL_OFF, "CommunicationOperator": "on"})
        wait_until(lambda: fake.fake_mspti_state() & STATE_COMM, 10, "comm enabled")
        fake.fake_mspti_emit(50, b"hccl", b"communication", 16, 0)
        fake.fake_mspti_wait_idle()
        wait_until(lambda: read_rank(root, "job-a", 5)[1].count(b"\n") >= 150, 10, "150 lines on disk")

        write_switch(switch, **ALL_OFF)
        wait_until(lambda: fake.fake_mspti_state() == 0, 10, "all off")
        fake.fake_mspti_emit(40, b"step 2", b"default", 16, 0)
        fake.fake_mspti_wait_idle()

        switch.write_text("{not json")  # invalid: previous state (off) kept
        wait_until(lambda: w.switch_errors > 0, 10, "the invalid switch to be read")
        assert fake.fake_mspti_state() == 0
    finally:
        w.stop()
    names, data = read_rank(root, "job-a", 5)
    assert len(names) == 1 and len(names[0]) == 10 and names[0].isdigit()
    parsed = records.parse(data)
    assert parsed.errors == []
    ids = [int(m[records.ID]) for m in parsed.markers]
    assert len(ids) == len(set(ids)) == 150  # exactly once, nothing collected while off
    domains = [m[records.DOMAIN] for m in parsed.markers]
    assert domains.count(b"default") == 100 and domains.count(b"communication") == 50
    stats = w.stats()
    assert stats["records_written"] == 150 and stats["records"] == 150
    assert stats["switch_default_on"] is False and stats["running"] is False
    assert fake.fake_mspti_state() == 0


def test_worker_stop_writes_what_is_left(fake, collectors, tmp_path):
    c = collectors()
    switch = tmp_path / "switch"
    write_switch(switch, **{**ALL_OFF, "FP": "on"})
    w = Worker(0, 5000, c, root=str(tmp_path / "p"), job=lambda: "default_task_id_1", switch_path=str(switch),
               interval=3600)
    w.tick()  # applies the switch
    fake.fake_mspti_emit(25, b"step 9", b"default", 2, 0)
    fake.fake_mspti_wait_idle()
    w.stop()
    w.stop()
    _, data = read_rank(tmp_path / "p", "default_task_id_1", 0)
    assert data.count(b"\n") == 25


def test_worker_limit_and_unwritable_root(fake, collectors, tmp_path):
    c = collectors(buffer_bytes=64 * 1024)
    switch = tmp_path / "switch"
    write_switch(switch, Step="on")
    (tmp_path / "file").write_text("")
    w = Worker(1, 5000, c, root=str(tmp_path / "file"), job="j", switch_path=str(switch), interval=3600)
    w.tick()
    fake.fake_mspti_emit(10, b"s", b"default", 2, 0)
    fake.fake_mspti_wait_idle()
    w.tick()
    s = w.stats()
    assert s["write_errors"] == 1 and s["records_dropped_error"] == 10
    w.stop()



PAGE = os.sysconf("SC_PAGE_SIZE")


def leave_room(fs, pages: int) -> None:
    """Fill the file system, then free `pages` pages: a longer write is cut short, the next fails (ENOSPC)."""
    fs.fill()
    filler = fs.path / ".filler"
    os.truncate(filler, filler.stat().st_size - pages * PAGE)


def test_a_full_disk_never_leaves_a_partial_record(fake, collectors, small_fs, tmp_path, caplog):
    c = collectors()
    write_switch(tmp_path / "switch", Step="on")
    w = Worker(0, 5000, c, root=str(small_fs.path / "p"), job="j", switch_path=str(tmp_path / "switch"),
               interval=3600)
    w.tick()  # applies the switch

    def emit(n: int, name: bytes = b"step") -> None:
        fake.fake_mspti_emit(n, name, b"default", 2, 0)
        fake.fake_mspti_wait_idle()

    emit(20)
    w.tick()
    leave_room(small_fs, 2)
    emit(10)
    emit(1, b"n" * 5 * PAGE)  # longer than the room left: the write is cut short inside it
    emit(10)
    with caplog.at_level("WARNING", logger="agent.worker"):
        w.tick()
    _, data = read_rank(small_fs.path / "p", "j", 0)
    assert data.endswith(b"\n") and records.parse(data).errors == []
    s = w.stats()
    assert s["records_written"] == data.count(b"\n") == 30 and s["bytes_written"] == len(data)
    assert (s["write_errors"], s["records_dropped_error"]) == (1, 11)
    (message,) = [r.getMessage() for r in caplog.records if r.name == "agent.worker"]
    assert "10 of 21 records written, the partial record after them truncated away" in message
    small_fs.free()
    emit(5)
    w.tick()  # space again: the next batch is whole
    w.stop()
    _, after = read_rank(small_fs.path / "p", "j", 0)
    parsed = records.parse(after)
    assert after.startswith(data) and parsed.errors == [] and len(parsed.markers) == 35
    assert w.stats()["records_written"] == 35

# -- the module API in a child process ------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, logging, os, sys, time
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    import agent.worker as worker
    from testkit.fakes.mspti import load_fake_mspti
    args = json.loads(sys.argv[1])
    ok = worker.init_taskd_worker(*args["init"])
    result = {"init": ok, "impl": worker.implementation()}
    if ok:
        result["start"] = worker.start_taskd_worker()
        fake = load_fake_mspti(worker.find_library())
        deadline = time.monotonic() + 10
        while not fake.fake_mspti_state() & 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        if args.get("object_id"):
            fake.fake_mspti_set_object_id(1, *args["object_id"])
        for name, domain, count in args["emit"]:
            fake.fake_mspti_emit(count, bytes.fromhex(name), domain.encode(), 16, 0)
            fake.fake_mspti_wait_idle()  # one emitter at a time: ids in a fixed order
        result["emitted"] = fake.fake_mspti_emitted()
        result["stats"] = worker.stats()
    print(json.dumps(result))
    # no stop: the atexit hook must flush, drain and write the rest
""")


def run_child(tmp_path, env_extra, init, emit=(), object_id=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MINDX_TASK_ID", "LD_LIBRARY_PATH", "MASTER_ADDR", "MS_SCHED_HOST", "LOCAL_PROXY_ENABLE")}
    env.update(NPU_AGENT_PROFILING_ROOT=str(tmp_path / "profiling"), NPU_AGENT_PROFILING_SWITCH=str(tmp_path / "sw"),
               NPU_AGENT_WORKER_IMPL="python", PYTHONPATH=str(REPO))
    emit = [(name.hex() if isinstance(name, bytes) else name.encode().hex(), domain, count) for name, domain, count in emit]
    env.update(env_extra)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"init": init, "emit": emit, "object_id": object_id})],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_module_api_end_to_end_with_atexit(lib_path, tmp_path):
    write_switch(tmp_path / "sw", **{**ALL_OFF, "Step": "on", "CommunicationOperator": "on"})
    result, stderr = run_child(tmp_path, {"LD_LIBRARY_PATH": f"/nonexistent:{lib_path.parent}",
                                          "MINDX_TASK_ID": "job-42"},
                               [3], [("step 1", "default", 500), ("hccl", "communication", 300)])
    assert result["init"] is True and result["start"] is True and result["impl"] == "python"
    assert result["emitted"] == 800
    names, data = read_rank(tmp_path / "profiling", "job-42", 3)
    assert len(names) == 1 and len(names[0]) == 10
    parsed = records.parse(data)
    assert parsed.errors == []
    assert len({int(m[records.ID]) for m in parsed.markers}) == len(parsed.markers) == 800
    rank_dir = tmp_path / "profiling" / "job-42" / "3"
    assert oct(rank_dir.stat().st_mode & 0o777) == "0o755"
    assert oct((rank_dir / names[0]).stat().st_mode & 0o777) == "0o644"


def test_default_job_dir_when_no_task_id(lib_path, tmp_path):
    write_switch(tmp_path / "sw", Step="on")
    before = int(time.time())
    result, _ = run_child(tmp_path, {"LD_LIBRARY_PATH": str(lib_path.parent)}, [0, 100], [("step 1", "default", 10)])
    assert result["init"] is True
    (job,) = os.listdir(tmp_path / "profiling")
    assert job.startswith("default_task_id_") and before <= int(job.rsplit("_", 1)[1]) <= int(time.time())
    _, data = read_rank(tmp_path / "profiling", job, 0)
    assert data.count(b"\n") == 10


def test_init_without_library_returns_false(tmp_path):
    result, stderr = run_child(tmp_path, {"LD_LIBRARY_PATH": str(tmp_path)}, [0])
    if result["init"]:
        pytest.skip("a libmspti.so is installed on this machine (ld cache or toolkit path)")
    assert "libmspti.so not found" in stderr
    assert len([l for l in stderr.splitlines() if "agent.worker" in l]) == 1
    assert not (tmp_path / "profiling").exists()


@pytest.mark.parametrize("init", [[-1], ["3"], [1.5], [True], [None], [0, -5]])
def test_init_rejects_bad_arguments(lib_path, tmp_path, init):
    result, stderr = run_child(tmp_path, {"LD_LIBRARY_PATH": str(lib_path.parent)}, init)
    assert result["init"] is False
    assert "init_taskd_worker" in stderr


def test_init_with_a_library_lacking_symbols(tmp_path):
    libc = ctypes.util.find_library("c")
    d = tmp_path / "lib"
    d.mkdir()
    # a libmspti.so that is really libc: loads, but has none of the symbols
    real = subprocess.run(["sh", "-c", f"ldconfig -p | grep -m1 '{libc} ' | sed 's/.*=> //'"],
                          capture_output=True, text=True).stdout.strip()
    if not real:
        pytest.skip("libc not found through the ld cache")
    (d / "libmspti.so").symlink_to(real)
    result, stderr = run_child(tmp_path, {"LD_LIBRARY_PATH": str(d)}, [0])
    assert result["init"] is False
    assert "has no symbol" in stderr


def test_native_and_python_collectors_write_the_same_bytes(lib_path, tmp_path):
    try:
        import agent._native  # noqa: F401
    except ImportError:
        pytest.skip("the native extension is not built")
    names = [b"step 1", b'quote " back \\ <&>', "\u2028\u00e9\u65e5".encode(), b"\xff\xe2\x82 \xed\xa0\x80 bad",
             b"ctl \x01\x1f\t\n\r\b\f\x7f", b"\xf0\x9f\x98\x80 \xf4\x90\x80\x80", b"",
             # backslashes: valid JSON literals are decoded (TaskD's round trip), the others kept as they are
             b'{\\"opName\\":\\"hcom_allReduce_1\\",\\"groupName\\":\\"10.0.0.1%eth0_60000\\"}',
             b"C:\\temp", b"C:\\Users\\data", b"a\\nb", b"caf\\u00e9 \\u00E9 \\u003c\\u2028\\/",
             b"\\ud83d\\ude00 \\ud800 \\udc00\\ud800\\ud83d\\ude00", b"a\\n\xff", b'q"\\n', b"end\\", b"\\u12x"]
    emit = [(name, "default", 3) for name in names] + [(b"hccl", "communication", 2)]
    outputs = {}
    for impl in ("python", "native"):
        base = tmp_path / impl
        base.mkdir()
        write_switch(base / "sw", Step="on", CommunicationOperator="on")
        result, stderr = run_child(base, {"LD_LIBRARY_PATH": str(lib_path.parent), "MINDX_TASK_ID": "j",
                                          "NPU_AGENT_WORKER_IMPL": impl}, [0], emit, object_id=[11, 22])
        assert result["init"] is True and result["impl"] == impl, stderr
        outputs[impl] = read_rank(base / "profiling", "j", 0)[1]
    assert outputs["python"].count(b"\n") == 3 * len(names) + 2
    assert outputs["python"] == outputs["native"]
    by_name = {json.loads(line)["Name"] for line in outputs["native"].splitlines()}
    assert '{"opName":"hcom_allReduce_1","groupName":"10.0.0.1%eth0_60000"}' in by_name
    assert {"C:\temp", "C:\\Users\\data", "a\nb", "caf\u00e9 \u00e9 <\u2028/", "\U0001f600 \ufffd \ufffd\ufffd\U0001f600",
            "a\\n\ufffd", 'q"\\n', "end\\", "\\u12x"} <= by_name



# -- a training process that forks ----------------------------------------------------------------

FORK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import agent.worker as worker
    from testkit.fakes.mspti import load_fake_mspti
    children, per_child = int(sys.argv[1]), int(sys.argv[2])
    assert worker.init_taskd_worker(0) and worker.start_taskd_worker()
    fake = load_fake_mspti(worker.find_library())
    w = worker._worker
    w.tick()  # the switch file turns collection on now, not at the thread's first round
    for _ in range(children):
        with w._tick_lock:  # no round of the worker's thread writes between these records and the fork
            fake.fake_mspti_emit(per_child, b"step", b"default", 16, 0)
            fake.fake_mspti_wait_idle()
            sys.stdout.flush()
            pid = os.fork()
        if pid == 0:  # the child asks for a worker of its own, then exits normally: atexit runs
            print(json.dumps({"init": worker.init_taskd_worker(0), "start": worker.start_taskd_worker(),
                              "running": worker.stats()["running"]}), flush=True)
            sys.exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    print(json.dumps({"emitted": fake.fake_mspti_emitted()}), flush=True)
    # the parent exits normally too: its atexit hook writes what is left, once
""")


@pytest.mark.parametrize("impl", ["python", "native"])
@pytest.mark.parametrize("children, per_child", [(1, 100), (20, 15)])
def test_a_forked_child_never_writes_the_parents_records(lib_path, tmp_path, impl, children, per_child):
    if impl == "native":
        pytest.importorskip("agent._native", reason="the native extension is not built")
    write_switch(tmp_path / "sw", Step="on")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MINDX_TASK_ID", "MASTER_ADDR", "MS_SCHED_HOST", "LOCAL_PROXY_ENABLE")}
    env.update(NPU_AGENT_PROFILING_ROOT=str(tmp_path / "profiling"), NPU_AGENT_PROFILING_SWITCH=str(tmp_path / "sw"),
               NPU_AGENT_WORKER_IMPL=impl, PYTHONPATH=str(REPO), LD_LIBRARY_PATH=str(lib_path.parent),
               MINDX_TASK_ID="job-fork")
    proc = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(children), str(per_child)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    *from_children, parent = [json.loads(line) for line in proc.stdout.splitlines()]
    assert parent == {"emitted": children * per_child}
    _, data = read_rank(tmp_path / "profiling", "job-fork", 0)
    parsed = records.parse(data)
    assert parsed.errors == []
    ids = [int(m[records.ID]) for m in parsed.markers]
    assert len(ids) == children * per_child, f"{len(ids)} lines on disk for {children * per_child} records"
    assert len(set(ids)) == len(ids)
    # a forked child gets no worker of its own: the parent's records stay the parent's to write
    assert from_children == [{"init": False, "start": False, "running": False}] * children
    assert proc.stderr.count("was forked from process") == 2 * children, proc.stderr


# -- TaskD's manager-driven switch: training processes and a manager stand-in -----------------------

def worker_pos(server_rank, process_rank) -> dict:
    return {"role": "Worker", "server_rank": str(server_rank), "process_rank": str(process_rank)}


def statuses(mgr, name) -> list[int]:
    return [e["code"] for e in mgr.events("status") if e["name"] == name]


def act(mgr, code: int, expected: dict[str, int | None]) -> None:
    """The manager sends ACTION `code` to every registered worker; each acks it itself, and each
    named worker answers with the STATUS given (None: with none)."""
    since = mgr.mark()
    done = mgr.action(code)
    assert sorted(done["workers"]) == sorted(expected)
    for sent in [e for e in mgr.events("action_sent")][-len(expected):]:
        assert sent["code"] == 0 and sent["error"] is None, sent
        assert sent["ack_src"]["process_rank"] == sent["name"][len("Worker"):], sent
    for name, status in expected.items():
        if status is not None:
            mgr.wait_event(lambda e: e.get("event") == "status" and e["name"] == name and e["code"] == status,
                           10, since)


def wait_ticks(trainer: Trainer, n: int = 2) -> None:
    """Until the worker's thread has done `n` more rounds (each polls the switch file unless the
    manager drives, then writes)."""
    start = trainer.stats()["ticks"]
    wait_until(lambda: trainer.stats()["ticks"] >= start + n, 10, f"{n} more rounds of the worker")


def test_the_manager_drives_the_switch_and_gets_a_status_per_change(fake_mspti_path, tmp_path):
    root, switch = tmp_path / "profiling", tmp_path / "profilingSwitch"
    write_switch(switch, **ALL_OFF)  # the file says off throughout: once registered, it is not read
    job = "job-mgr"
    with manager("127.0.0.1:0") as mgr:
        common = dict(MINDX_TASK_ID=job, MASTER_ADDR="127.0.0.1", NPU_AGENT_TASKD_PROXY=mgr.address,
                      LOCAL_WORLD_SIZE="2")
        trainers = [
            Trainer(0, trainer_env(fake_mspti_path, root, switch, RANK="0", **common)),  # native collector
            # the Python collector, and another profiler holds MSPTI's subscriber slot from the start
            Trainer(1, trainer_env(fake_mspti_path, root, switch, RANK="1", NPU_AGENT_WORKER_IMPL="python",
                                   FAKE_MSPTI_FOREIGN_SUBSCRIBER="1", **common)),
        ]
        t0, t1 = trainers
        try:
            assert [t.started for t in trainers] == [{"event": "started", "init": True, "start": True, "impl": impl}
                                                     for impl in ("native", "python")]
            for rank, t in enumerate(trainers):
                registered = mgr.wait_event(lambda e: e.get("event") == "worker_registered"
                                            and e["name"] == f"Worker{rank}", 20)
                assert registered["pos"] == worker_pos(0, rank)  # node rank: RANK // LOCAL_WORLD_SIZE
                wait_until(lambda: t.stats()["manager_mode"], 10, f"rank {rank} in manager mode")
            received = [e for e in mgr.events("received") if e["body"].startswith('{"msg_type":"REGISTER"')]
            assert sorted(e["src"]["process_rank"] for e in received) == ["0", "1"]  # once each
            for e in received:
                assert e["body"] == '{"msg_type":"REGISTER","code":101,"message":"","extension":null}'
                assert e["sync"] is True and e["mtype"] == "default"
                assert e["dst"] == {"role": "Mgr", "server_rank": "0", "process_rank": "-1"}

            act(mgr, 710, {"Worker0": 1410, "Worker1": 1420})  # rank 1: subscribing failed, an exception
            t0.emit("step 1", "default", 100)
            wait_until(lambda: read_rank(root, job, 0)[1].count(b"\n") == 100, 15, "100 records of rank 0")
            wait_ticks(t0)  # rounds in which an all-off file would have switched it off again
            assert t0.state() & (1 << MARKER) and t0.stats()["switch_default_on"] is True

            act(mgr, 711, {"Worker0": 1411, "Worker1": 1421})
            t0.emit("hccl", "communication", 50)
            wait_until(lambda: read_rank(root, job, 0)[1].count(b"\n") == 150, 15, "150 records of rank 0")

            act(mgr, 700, {"Worker0": 1400, "Worker1": 1400})
            before = t0.emit("step 2", "default", 40)["filtered"]
            assert t0.emit("hccl", "communication", 20)["filtered"] == before + 20  # MSPTI makes none now
            assert before >= 40

            act(mgr, 700, {"Worker0": None, "Worker1": None})  # the same command again: no STATUS
            for t in trainers:
                wait_until(lambda: t.stats()["actions"] == 4, 10, "the repeated ACTION handled")
            act(mgr, 710, {"Worker0": 1410, "Worker1": 1420})
            assert statuses(mgr, "Worker0") == [1410, 1411, 1400, 1410]
            assert statuses(mgr, "Worker1") == [1420, 1421, 1400, 1420]
            # (the manager sees a STATUS before the worker's call returns and counts it)
            wait_until(lambda: t0.stats()["statuses_sent"] == 4, 10, "four statuses counted")
            stats = t0.stats()
            assert (stats["manager_registered"], stats["actions"], stats["manager_register_tries"],
                    stats["manager_joins"]) == (True, 5, 1, 1)
            assert stats["switch_errors"] == 0  # the file was never read: registered before the first round
            assert not mgr.events("status_dropped")
        finally:
            codes = [t.stop() for t in trainers]
        assert codes == [0, 0], [t.stderr()[-3000:] for t in trainers]
    names, data = read_rank(root, job, 0)
    parsed = records.parse(data)
    assert parsed.errors == [] and len(parsed.markers) == 150
    assert len({int(m[records.ID]) for m in parsed.markers}) == 150
    domains = [m[records.DOMAIN] for m in parsed.markers]
    assert domains.count(b"default") == 100 and domains.count(b"communication") == 50
    log = t0.stderr()
    assert log.count("switch file stays in charge") == 0 and log.count("is no longer read") == 1


def test_no_manager_within_the_give_up_window_leaves_the_file_in_charge(fake_mspti_path, tmp_path):
    root, switch = tmp_path / "profiling", tmp_path / "profilingSwitch"
    write_switch(switch, **ALL_OFF)
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    t = Trainer(2, trainer_env(fake_mspti_path, root, switch, MINDX_TASK_ID="job-alone", MASTER_ADDR="127.0.0.1",
                               NPU_AGENT_TASKD_PROXY=nobody), give_up=1.5)
    try:
        wait_until(lambda: t.stats()["manager_given_up"], 15, "the manager client to give up")
        wait_until(lambda: not t.stats()["manager_running"], 10, "the client's threads to end")  # for good
        stats = t.stats()
        assert stats["manager_registered"] is False and stats["manager_mode"] is False
        assert stats["manager_join_errors"] >= 1 and stats["manager_register_tries"] == 0
        write_switch(switch, **{**ALL_OFF, "Step": "on"})
        wait_until(lambda: t.state() & (1 << MARKER), 10, "the file to turn profiling on")
        t.emit("step 1", "default", 30)
        wait_until(lambda: read_rank(root, "job-alone", 2)[1].count(b"\n") == 30, 15, "30 records on disk")
    finally:
        assert t.stop() == 0
    assert t.stderr().count("giving up, the switch file stays in charge") == 1


def test_without_a_manager_host_the_worker_never_dials(fake_mspti_path, tmp_path):
    import socket

    root, switch = tmp_path / "profiling", tmp_path / "profilingSwitch"
    write_switch(switch, Step="on")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        t = Trainer(0, trainer_env(fake_mspti_path, root, switch, MINDX_TASK_ID="job-file",
                                   NPU_AGENT_TASKD_PROXY=address))  # no MASTER_ADDR, MS_SCHED_HOST, ...
        try:
            wait_until(lambda: t.state() & (1 << MARKER), 10, "the file to turn profiling on")
            t.emit("step 1", "default", 10)
            wait_until(lambda: read_rank(root, "job-file", 0)[1].count(b"\n") == 10, 15, "10 records on disk")
            stats = t.stats()
            assert stats["manager_enabled"] is False and stats["manager_mode"] is False
            with pytest.raises(BlockingIOError):
                listener.accept()  # nobody connected
        finally:
            assert t.stop() == 0


def test_a_lost_stream_is_rebuilt_without_registering_again(fake_mspti_path, tmp_path):
    root, switch = tmp_path / "profiling", tmp_path / "profilingSwitch"
    write_switch(switch, **ALL_OFF)
    port = free_port()
    me = worker_pos(0, 0)
    first = manager(f"127.0.0.1:{port}")
    t = Trainer(0, trainer_env(fake_mspti_path, root, switch, MINDX_TASK_ID="job-re", MS_SCHED_HOST="127.0.0.1",
                               MS_NODE_RANK="0", NPU_AGENT_TASKD_PROXY=first.address))
    second = None
    try:
        first.wait_event(lambda e: e.get("event") == "worker_registered" and e["pos"] == me, 20)
        first.kill()  # the stream breaks: the worker joins again, as TaskD's does
        second = manager(f"127.0.0.1:{port}")
        second.wait_event(lambda e: e.get("event") == "stream" and e["pos"] == me, 20)
        assert [e["pos"] for e in second.events("registered")] == [me]
        assert [e["path"] for e in second.events("path")] == [[me]]
        # The new manager reaches it; the worker is still in manager mode and answers, but it sent
        # its REGISTER once per process, so this manager does not know it (TaskD's behaviour).
        sent = second.transfer(me, body='{"msg_type":"ACTION","code":711,"message":"","extension":null}',
                               sync=True, mtype="default")
        assert (sent["code"], sent["ack_src"]) == (0, me)
        second.wait_event(lambda e: e.get("event") == "status_dropped" and e["code"] == 1411, 10)
        wait_until(lambda: t.state() & (1 << MARKER), 10, "the ACTION applied")
        stats = t.stats()
        assert (stats["manager_register_tries"], stats["manager_joins"], stats["manager_stream_errors"]) == (1, 2, 1)
        assert stats["manager_mode"] is True and not second.events("worker_registered")
    finally:
        assert t.stop() == 0
        first.stop()
        if second is not None:
            second.stop()
