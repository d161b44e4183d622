"""The worker's state: a collector, the switch file, a rank writer, and the thread that ties them.

Every `interval` (1 s) the background thread polls the switch file (a change, or the first valid
read, calls `collector.set_switch`), then `collector.flush()` and appends the waiting lines to the
rank's file: the native collector writes them from its own buffer (`RankWriter.write_from`), the
Python one hands them over as bytes (`drain()`, `RankWriter.write`). `stop()` (the atexit hook)
ends the thread, does a last flush and write, and closes the collector; it never raises.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from agent.worker.switch import ALL_OFF, MAX_BYTES, parse_switch
from agent.worker.writer import RankWriter

log = logging.getLogger("agent.worker")

DEFAULT_ROOT = "/user/cluster-info/profiling"
DEFAULT_SWITCH = "/user/cluster-info/datatrace-config/profilingSwitch"
SWITCH_LOG_EVERY = 30.0
ERROR_LOG_EVERY = 60.0


class Worker:
    def __init__(self, rank: int, limit_mb: int, collector, *, root: str, job, switch_path: str,
                 interval: float = 1.0, implementation: str = "python", clock=time.time,
                 monotonic=time.monotonic) -> None:
        """`job` is the job folder name, or a callable giving it at the first write."""
        self.rank = rank
        self.limit_mb = limit_mb
        self.collector = collector
        self._direct = callable(getattr(collector, "drain_to", None))  # writes its lines to a file itself
        self.root = root
        self._job = job
        self.switch_path = switch_path
        self.interval = interval
        self.implementation = implementation
        self._clock = clock
        self._monotonic = monotonic
        self.writer: RankWriter | None = None
        self.state = ALL_OFF
        self._applied = False
        self.switch_changes = 0
        self.switch_errors = 0
        self._switch_logged = None
        self._missing_logged = False
        self.ticks = 0
        self.tick_errors = 0
        self._tick_logged = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick_lock = threading.Lock()
        self._stopped = False

    # -- the switch --------------------------------------------------------------------------------

    def poll_switch(self) -> None:
        try:
            with open(self.switch_path, "rb") as handle:
                data = handle.read(MAX_BYTES)
        except OSError as exc:
            self.switch_errors += 1
            if isinstance(exc, FileNotFoundError):
                if not self._missing_logged:
                    self._missing_logged = True
                    log.info("profiling switch %s not found; collection stays %s until it appears",
                             self.switch_path, "on" if self.state[0] else "off")
            else:
                self._switch_warning(f"cannot read {self.switch_path}: {exc}")
            return
        state = parse_switch(data)
        if state is None:
            self.switch_errors += 1
            self._switch_warning(f"profiling switch {self.switch_path} is not valid; keeping the previous state")
            return
        self._missing_logged = False
        if self._applied and state == self.state:
            return
        self.collector.set_switch(*state)
        if state != self.state or not self._applied:
            log.info("profiling switch: default domain %s, communication %s",
                     "on" if state[0] else "off", "on" if state[1] else "off")
        self._applied = True
        self.state = state
        self.switch_changes += 1

    def _switch_warning(self, message: str) -> None:
        now = self._monotonic()
        if self._switch_logged is None or now - self._switch_logged >= SWITCH_LOG_EVERY:
            self._switch_logged = now
            log.warning(message)

    # -- one round ---------------------------------------------------------------------------------

    def _writer(self) -> RankWriter:
        if self.writer is None:
            job = self._job() if callable(self._job) else self._job
            self.writer = RankWriter(self.root, job, self.rank, self.limit_mb, clock=self._clock,
                                     monotonic=self._monotonic)
        return self.writer

    def collect(self) -> None:
        """flush, then write the collector's lines (complete, in order)."""
        self.collector.flush()
        self._write_waiting()

    def _write_waiting(self) -> None:
        if self._direct:
            if self.collector.pending():
                self._writer().write_from(self.collector)
            return
        data = self.collector.drain()
        if data:
            self._writer().write(data)

    def tick(self) -> None:
        with self._tick_lock:
            self.ticks += 1
            try:
                self.poll_switch()
                self.collect()
            except Exception as exc:  # the thread must survive anything
                self.tick_errors += 1
                now = self._monotonic()
                if self._tick_logged is None or now - self._tick_logged >= ERROR_LOG_EVERY:
                    self._tick_logged = now
                    log.warning("profiling worker round failed: %s: %s", type(exc).__name__, exc)

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> bool:
        if self._thread is not None or self._stopped:
            return self._thread is not None and not self._stopped
        self._thread = threading.Thread(target=self._run, name="npu-agent-profiling", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.tick()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, write what is left, close the collector. Idempotent; never raises."""
        try:
            if self._stopped:
                return
            self._stopped = True
            self._stop.set()
            thread = self._thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)
            with self._tick_lock:
                try:
                    self.collect()
                except Exception as exc:
                    log.warning("profiling worker: last write failed: %s: %s", type(exc).__name__, exc)
                try:
                    self.collector.close()  # switches off and flushes; what that completes...
                    self._write_waiting()  # ...is handed over here
                except Exception as exc:
                    log.warning("profiling worker: closing the collector failed: %s: %s", type(exc).__name__, exc)
        except BaseException:  # at exit, nothing may escape
            pass

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict:
        out = {"implementation": self.implementation, "rank": self.rank, "running": self.running,
               "switch_default_on": self.state[0], "switch_comm_on": self.state[1],
               "switch_changes": self.switch_changes, "switch_errors": self.switch_errors,
               "ticks": self.ticks, "tick_errors": self.tick_errors}
        try:
            out.update(self.collector.counters())
        except Exception:
            pass
        writer = self.writer
        if writer is not None:
            out.update(writer.stats())
            out["rank_dir"] = writer.rank_dir
        return out


def profiling_root() -> str:
    return os.environ.get("NPU_AGENT_PROFILING_ROOT") or DEFAULT_ROOT


def switch_path() -> str:
    return os.environ.get("NPU_AGENT_PROFILING_SWITCH") or DEFAULT_SWITCH


_job_lock = threading.Lock()
_default_job: str | None = None


def job_id() -> str:
    """`$MINDX_TASK_ID`, else `default_task_id_<unix seconds>` fixed at the first use in this process."""
    global _default_job
    task = os.environ.get("MINDX_TASK_ID")
    if task:
        return task
    with _job_lock:
        if _default_job is None:
            _default_job = f"default_task_id_{int(time.time())}"
        return _default_job
