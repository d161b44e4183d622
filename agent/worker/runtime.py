"""The worker's state: a collector, the switch, a rank writer, and the thread that ties them.

Every `interval` (1 s) the background thread polls the switch file (a change, or the first valid
read, is applied), then `collector.flush()` and appends the waiting lines to the rank's file: the
native collector writes them from its own buffer (`RankWriter.write_from`), the Python one hands
them over as bytes (`drain()`, `RankWriter.write`). `stop()` (the atexit hook) stops the TaskD
manager client, ends the thread, does a last flush and write, and closes the collector; it never
raises. A worker belongs to the process that made it: in a forked child (`after_fork_in_child`, and
a pid check in `start()` and `stop()`) it neither runs nor flushes, writes or closes anything.

The switch has two sources, applied by one method (`apply_switch`) so they behave alike: the file,
and in manager mode (`agent.worker.tasknet`) the TaskD manager's ACTION commands. Once the worker
has registered with a manager the file is no longer read; the manager's first command is always
applied, later ones only when they differ from the one in force.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from agent.worker.switch import ALL_OFF, MAX_BYTES, parse_switch
from agent.worker.writer import RankWriter

SWITCH_OFF, SWITCH_ON, SWITCH_EXCEPTION = 0, 1, 2  # a domain's result (collector.set_switch)
_RESULT_WORDS = {SWITCH_OFF: "off", SWITCH_ON: "on", SWITCH_EXCEPTION: "exception"}

log = logging.getLogger("agent.worker")

DEFAULT_ROOT = "/user/cluster-info/profiling"
DEFAULT_SWITCH = "/user/cluster-info/datatrace-config/profilingSwitch"
SWITCH_LOG_EVERY = 30.0
ERROR_LOG_EVERY = 60.0


class Worker:
    def __init__(self, rank: int, limit_mb: int, collector, *, root: str, job, switch_path: str,
                 interval: float = 1.0, implementation: str = "python", clock=time.time,
                 monotonic=time.monotonic, manager=None) -> None:
        """`job` is the job folder name, or a callable giving it at the first write; `manager` a
        `tasknet.ManagerClient` (not started) for TaskD's manager-driven switch, or None."""
        self.rank = rank
        self.limit_mb = limit_mb
        self.pid = os.getpid()  # the process whose records these are
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
        self.results = (SWITCH_OFF, SWITCH_OFF)  # of the last apply
        self._applied = False
        self.manager = manager
        self.manager_mode = False  # registered: the manager drives the switch, the file is not read
        self._switch_lock = threading.Lock()  # the switch and the collector's close (after _tick_lock)
        self._closed = False
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
        if self.manager_mode:
            return
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
        self.apply_switch(state, "file")

    def apply_switch(self, state: tuple[bool, bool], source: str) -> tuple[int, int] | None:
        """Apply `(default_on, comm_on)` from `source` ("file" or "manager") unless it is the
        command in force already: the per-domain results (0 off, 1 on, 2 exception), or None when
        nothing was done (the same command again, the file while the manager drives, or closed).
        An exception of the collector propagates, and the command counts as not applied."""
        state = (bool(state[0]), bool(state[1]))
        with self._switch_lock:
            if self._closed or (source == "file" and self.manager_mode):
                return None
            if self._applied and state == self.state:
                return None
            results = _results(self.collector.set_switch(*state), state)
            words = [_RESULT_WORDS.get(r, str(r)) for r in results]
            if SWITCH_EXCEPTION in results:
                log.warning("profiling switch (%s): default domain %s, communication %s (asked: %s, %s); an "
                            "MSPTI call failed, e.g. another profiler holds MSPTI's only subscriber slot",
                            source, *words, "on" if state[0] else "off", "on" if state[1] else "off")
            else:
                log.info("profiling switch (%s): default domain %s, communication %s", source, *words)
            self._applied = True
            self.state = state
            self.results = results
            self.switch_changes += 1
            return results

    # -- the TaskD manager (called from the manager client's thread) ----------------------------------

    def manager_registered(self) -> None:
        """Registered with the manager: from now on it alone drives the switch; its first command is
        applied whatever the file did before."""
        with self._switch_lock:
            if self.manager_mode:
                return
            self.manager_mode = True
            self._applied = False
        log.info("profiling switch: the TaskD manager drives it now; %s is no longer read", self.switch_path)

    def manager_action(self, state: tuple[bool, bool]) -> tuple[int, int] | None:
        """An ACTION: the results to report, or None when nothing was applied (no STATUS then)."""
        try:
            return self.apply_switch(state, "manager")
        except Exception as exc:  # noqa: BLE001 - reported to the manager as an exception of both domains
            log.warning("profiling switch (manager): the collector failed: %s: %s", type(exc).__name__, exc)
            return (SWITCH_EXCEPTION, SWITCH_EXCEPTION)

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

    def after_fork_in_child(self) -> None:
        """os.register_at_fork, in the child: the worker and whatever it holds are the parent's, so
        the child never stops (flushes, writes, closes) it. Its locks are made new, in case a
        thread of the parent held one at the fork: `stats()` must not hang in the child."""
        self._stopped = True
        self._tick_lock = threading.Lock()
        self._switch_lock = threading.Lock()
        forget = getattr(self.manager, "after_fork_in_child", None)
        if forget is not None:
            forget()

    def start(self) -> bool:
        if os.getpid() != self.pid:
            return False
        if self._thread is not None or self._stopped:
            return self._thread is not None and not self._stopped
        self._thread = threading.Thread(target=self._run, name="npu-agent-profiling", daemon=True)
        self._thread.start()
        if self.manager is not None:
            try:
                self.manager.start(self)
            except Exception as exc:  # noqa: BLE001 - the file keeps working without it
                log.error("TaskD manager mode not started: %s: %s", type(exc).__name__, exc)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.tick()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread, write what is left, close the collector. Idempotent; never raises. A no-op
        in any process but the one that made the worker (a forked child exiting)."""
        try:
            if self._stopped or os.getpid() != self.pid:
                return
            self._stopped = True
            self._stop.set()
            if self.manager is not None:
                try:
                    self.manager.stop()
                except Exception:
                    pass
            thread = self._thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)
            with self._tick_lock:
                try:
                    self.collect()
                except Exception as exc:
                    log.warning("profiling worker: last write failed: %s: %s", type(exc).__name__, exc)
                try:
                    with self._switch_lock:
                        self._closed = True
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
               "switch_results": list(self.results), "ticks": self.ticks, "tick_errors": self.tick_errors,
               "manager_mode": self.manager_mode, "manager_enabled": self.manager is not None,
               "manager_registered": False, "actions": 0, "statuses_sent": 0}
        if self.manager is not None:
            try:
                out.update(self.manager.stats())
            except Exception:
                pass
        try:
            out.update(self.collector.counters())
        except Exception:
            pass
        writer = self.writer
        if writer is not None:
            out.update(writer.stats())
            out["rank_dir"] = writer.rank_dir
        return out


def _results(value, state: tuple[bool, bool]) -> tuple[int, int]:
    """A collector's set_switch result; a collector that returns nothing succeeded as asked."""
    if value is None:
        return (int(state[0]), int(state[1]))
    default, comm = value
    return (int(default), int(comm))


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
