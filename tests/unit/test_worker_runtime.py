"""agent.worker.runtime.Worker and the module helpers, with a recording stand-in for the collector."""

from __future__ import annotations

import json
import os

import pytest

import agent.worker as worker_mod
from agent.worker import runtime
from agent.worker.runtime import Worker


class FakeCollector:
    def __init__(self, fail=None):
        self.calls = []
        self.pending = b""
        self.fail = fail or set()

    def _maybe_fail(self, name):
        self.calls.append(name)
        if name in self.fail:
            raise RuntimeError(f"{name} failed")

    def set_switch(self, default_on, comm_on):
        self._maybe_fail("set_switch")
        self.calls[-1] = ("set_switch", default_on, comm_on)
        return int(default_on), int(comm_on)

    def flush(self):
        self._maybe_fail("flush")

    def drain(self):
        self._maybe_fail("drain")
        data, self.pending = self.pending, b""
        return data

    def close(self):
        self._maybe_fail("close")
        self.pending += b"after-close\n"

    def counters(self):
        return {"records": 7}


def make(tmp_path, collector=None, **kw):
    collector = collector or FakeCollector()
    clock = kw.pop("clock", lambda: 1_755_771_234)
    w = Worker(2, 5000, collector, root=str(tmp_path / "root"), job="job", switch_path=str(tmp_path / "switch"),
               interval=3600, clock=clock, **kw)
    return w, collector


def switches(c):
    return [call for call in c.calls if isinstance(call, tuple)]


def test_initial_state_all_off_and_missing_file_changes_nothing(tmp_path, caplog):
    w, c = make(tmp_path)
    with caplog.at_level("INFO", logger="agent.worker"):
        w.tick()
        w.tick()
    assert w.state == (False, False)
    assert switches(c) == []
    assert len([r for r in caplog.records if "not found" in r.message]) == 1  # said once


def test_first_valid_read_is_applied_even_if_all_off_then_only_changes(tmp_path):
    w, c = make(tmp_path)
    sw = tmp_path / "switch"
    sw.write_text(json.dumps(dict.fromkeys(("CommunicationOperator", "Step", "SaveCheckpoint", "FP", "DataLoader"),
                                           "off")))
    w.tick()
    assert switches(c) == [("set_switch", False, False)]
    w.tick()
    assert switches(c) == [("set_switch", False, False)]
    sw.write_text('{"Step":"on"}')
    w.tick()
    w.tick()
    sw.write_text('{"CommunicationOperator":"on"}')
    w.tick()
    assert switches(c) == [("set_switch", False, False), ("set_switch", True, False), ("set_switch", True, True)]
    assert w.stats()["switch_default_on"] is True and w.stats()["switch_comm_on"] is True


def test_invalid_file_keeps_state_and_logs_every_30_s(tmp_path, caplog):
    mono = [100.0]
    w, c = make(tmp_path, monotonic=lambda: mono[0])
    sw = tmp_path / "switch"
    sw.write_text('{"Step":"on"}')
    w.tick()
    sw.write_text("garbage")
    with caplog.at_level("WARNING", logger="agent.worker"):
        for _ in range(10):
            w.tick()
            mono[0] += 1
        mono[0] += 25
        w.tick()
    assert w.state == (True, False)
    assert switches(c) == [("set_switch", True, False)]
    assert len(caplog.records) == 2
    assert w.switch_errors == 11


def test_a_failing_set_switch_is_retried(tmp_path):
    c = FakeCollector(fail={"set_switch"})
    w, _ = make(tmp_path, collector=c)
    (tmp_path / "switch").write_text('{"Step":"on"}')
    w.tick()
    assert w.state == (False, False) and w.tick_errors == 1
    c.fail.clear()
    w.tick()
    assert w.state == (True, False)


def test_tick_writes_drained_lines(tmp_path):
    w, c = make(tmp_path)
    c.pending = b"a\nb\n"
    w.tick()
    assert c.calls[:2] == ["flush", "drain"]
    assert (tmp_path / "root" / "job" / "2" / "1755771234").read_bytes() == b"a\nb\n"
    s = w.stats()
    assert s["records_written"] == 2 and s["records"] == 7 and s["rank_dir"].endswith("/job/2")


class DirectCollector(FakeCollector):
    """Like the native collector: it writes its waiting lines to a file itself (drain_to)."""

    def __init__(self):  # no `pending` attribute: here it is the method
        self.calls, self.fail, self.waiting = [], set(), b""

    def drain(self):
        raise AssertionError("the lines must not be copied through Python")

    def close(self):
        self._maybe_fail("close")
        self.waiting += b"after-close\n"

    def _take(self, max_bytes, remove):
        n = len(self.waiting) if max_bytes < 0 else self.waiting.rfind(b"\n", 0, max_bytes + 1) + 1
        taken = self.waiting[:n]
        if remove:
            self.waiting = self.waiting[n:]
        return taken

    def pending(self, max_bytes=-1):
        return len(self._take(max_bytes, False))

    def discard(self, max_bytes=-1):
        taken = self._take(max_bytes, True)
        return len(taken), taken.count(b"\n")

    def drain_to(self, fd, max_bytes=-1):
        self.calls.append("drain_to")
        taken = self._take(max_bytes, True)
        os.write(fd, taken)
        return len(taken), taken.count(b"\n")


def test_a_collector_that_writes_itself_is_used_without_a_copy(tmp_path):
    names = iter(["job"])
    c = DirectCollector()
    w = Worker(2, 5000, c, root=str(tmp_path / "root"), job=lambda: next(names), switch_path=str(tmp_path / "s"),
               interval=3600, clock=lambda: 1_755_771_234)
    w.tick()  # nothing waiting: no writer, no job name asked for
    assert c.calls == ["flush"] and w.writer is None
    c.waiting = b"a\nb\n"
    w.tick()
    assert c.calls == ["flush", "flush", "drain_to"]
    w.start()
    c.waiting = b"last\n"
    w.stop()  # the last round, then what close() hands over
    assert (tmp_path / "root" / "job" / "2" / "1755771234").read_bytes() == b"a\nb\nlast\nafter-close\n"
    assert w.stats()["records_written"] == 4 and w.tick_errors == 0


def test_the_job_callable_is_resolved_once_at_the_first_write(tmp_path):
    names = iter(["first", "second"])
    c = FakeCollector()
    w = Worker(0, 5000, c, root=str(tmp_path), job=lambda: next(names), switch_path=str(tmp_path / "s"),
               interval=3600, clock=lambda: 1_755_771_234)
    w.tick()
    assert not (tmp_path / "first").exists()
    c.pending = b"x\n"
    w.tick()
    c.pending = b"y\n"
    w.tick()
    assert (tmp_path / "first" / "0" / "1755771234").read_bytes() == b"x\ny\n"


def test_tick_survives_collector_errors(tmp_path):
    w, c = make(tmp_path, collector=FakeCollector(fail={"flush"}))
    w.tick()
    w.tick()
    assert w.tick_errors == 2


def test_stop_writes_the_rest_and_the_close_leftover_and_never_raises(tmp_path):
    w, c = make(tmp_path)
    assert w.start()
    c.pending = b"last\n"
    w.stop()
    assert (tmp_path / "root" / "job" / "2" / "1755771234").read_bytes() == b"last\nafter-close\n"
    assert not w.running
    w.stop()
    assert not w.start()  # a stopped worker does not start again
    bad, _ = make(tmp_path / "b", collector=FakeCollector(fail={"flush", "drain", "close"}))
    bad.stop()  # no exception


def test_start_twice_is_fine(tmp_path):
    w, _ = make(tmp_path)
    assert w.start() and w.start()
    w.stop()


def test_paths_from_the_environment(monkeypatch):
    monkeypatch.delenv("NPU_AGENT_PROFILING_ROOT", raising=False)
    monkeypatch.delenv("NPU_AGENT_PROFILING_SWITCH", raising=False)
    assert runtime.profiling_root() == "/user/cluster-info/profiling"
    assert runtime.switch_path() == "/user/cluster-info/datatrace-config/profilingSwitch"
    monkeypatch.setenv("NPU_AGENT_PROFILING_ROOT", "/x")
    monkeypatch.setenv("NPU_AGENT_PROFILING_SWITCH", "/y/s")
    assert runtime.profiling_root() == "/x" and runtime.switch_path() == "/y/s"


def test_job_id(monkeypatch):
    monkeypatch.setenv("MINDX_TASK_ID", "abc")
    assert runtime.job_id() == "abc"
    monkeypatch.delenv("MINDX_TASK_ID")
    monkeypatch.setattr(runtime, "_default_job", None)
    first = runtime.job_id()
    assert first.startswith("default_task_id_") and len(first.rsplit("_", 1)[1]) == 10
    assert runtime.job_id() == first  # fixed at the first use


def test_find_library_order(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (b / "libmspti.so").write_bytes(b"")
    cache = tmp_path / "cache" / "libmspti.so"
    cache.parent.mkdir()
    cache.write_bytes(b"")
    monkeypatch.setattr(worker_mod, "_ld_cache", lambda: [str(cache)])
    monkeypatch.setenv("LD_LIBRARY_PATH", f":{a}:{b}")
    assert worker_mod.find_library() == str(b / "libmspti.so")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(a))
    assert worker_mod.find_library() == str(cache)
    monkeypatch.setattr(worker_mod, "_ld_cache", lambda: [str(tmp_path / "gone.so")])
    toolkit = tmp_path / "toolkit.so"
    monkeypatch.setattr(worker_mod, "TOOLKIT_LIBRARY", str(toolkit))
    assert worker_mod.find_library() is None
    toolkit.write_bytes(b"")
    assert worker_mod.find_library() == str(toolkit)


def test_ld_cache_parsing(monkeypatch):
    class Done:
        stdout = (b"1234 libs found in cache `/etc/ld.so.cache'\n"
                  b"\tlibmspti.so.1 (libc6,x86-64) => /opt/x/libmspti.so.1\n"
                  b"\tlibmspti.so (libc6,x86-64) => /opt/y/libmspti.so\n"
                  b"\tlibmsptix.so (libc6,x86-64) => /opt/z/libmsptix.so\n")

    monkeypatch.setattr(worker_mod.shutil, "which", lambda name: "/sbin/ldconfig")
    monkeypatch.setattr(worker_mod.subprocess, "run", lambda *a, **k: Done())
    assert worker_mod._ld_cache() == ["/opt/y/libmspti.so"]


def test_implementation_and_stats_before_init(monkeypatch):
    monkeypatch.setenv("NPU_AGENT_WORKER_IMPL", "python")
    assert worker_mod.implementation() == "python"
    monkeypatch.delenv("NPU_AGENT_WORKER_IMPL")
    try:
        import agent._native  # noqa: F401
        expected = "native"
    except ImportError:
        expected = "python"
    assert worker_mod.implementation() == expected
    if worker_mod._worker is None:
        assert worker_mod.stats()["initialised"] is False


def test_start_before_init_is_false(monkeypatch):
    monkeypatch.setattr(worker_mod, "_worker", None)
    assert worker_mod.start_taskd_worker() is False


@pytest.mark.parametrize("rank, limit", [(-1, 5000), ("0", 5000), (1.0, 5000), (True, 5000), (0, -1), (0, "5")])
def test_init_rejects_bad_arguments(rank, limit, monkeypatch):
    monkeypatch.setattr(worker_mod, "_worker", None)
    assert worker_mod.init_taskd_worker(rank, limit) is False
    assert worker_mod._worker is None
