"""TaskD-compatible in-process profiling for training containers.

    from agent.worker import init_taskd_worker, start_taskd_worker
    init_taskd_worker(rank_id)      # loads libmspti.so; False (one log line) when it cannot
    start_taskd_worker()            # background thread: switch file -> mspti, records -> files

Records go to `<root>/<MINDX_TASK_ID>/<rank>/<10-digit unix seconds>` in TaskD's format, nothing is
collected until the switch turns the default domain on: the switch file, polled every second, or -
in a TaskD job with a manager (`tasknet.enabled`) once the worker has registered with it - the
manager's commands over TaskNet (`agent.worker.tasknet`). The native extension `agent._native`
does the collecting when it is built; otherwise a ctypes collector with the same output does
(`implementation()`). `NPU_AGENT_WORKER_IMPL=python` forces the ctypes one.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import threading

from agent.worker import tasknet
from agent.worker.runtime import Worker, job_id, profiling_root, switch_path

log = logging.getLogger("agent.worker")

LIBRARY = "libmspti.so"
TOOLKIT_LIBRARY = "/usr/local/Ascend/ascend-toolkit/latest/lib64/libmspti.so"

_lock = threading.Lock()
_worker: Worker | None = None
_atexit_registered = False

__all__ = ["init_taskd_worker", "start_taskd_worker", "stats", "implementation", "find_library", "Worker"]


def _collector_class():
    if os.environ.get("NPU_AGENT_WORKER_IMPL", "").lower() != "python":
        try:
            from agent import _native  # type: ignore[attr-defined]
            return _native.Collector, "native"
        except ImportError:
            pass
    from agent.worker.fallback import Collector
    return Collector, "python"


def implementation() -> str:
    """"native" when the C extension would be used, else "python"."""
    return _collector_class()[1]


def _ld_cache() -> list[str]:
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None)
    if ldconfig is None:
        return []
    try:
        out = subprocess.run([ldconfig, "-p"], capture_output=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    paths = []
    for line in out.decode("utf-8", "replace").splitlines():
        name, sep, path = line.strip().partition(" => ")
        if sep and name.split(" ", 1)[0] == LIBRARY:
            paths.append(path.strip())
    return paths


def find_library() -> str | None:
    """libmspti.so from $LD_LIBRARY_PATH, then the ld cache, then the toolkit's default path."""
    for directory in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        if directory:
            candidate = os.path.join(directory, LIBRARY)
            if os.path.isfile(candidate):
                return candidate
    for candidate in _ld_cache():
        if os.path.isfile(candidate):
            return candidate
    if os.path.isfile(TOOLKIT_LIBRARY):
        return TOOLKIT_LIBRARY
    return None


def _valid_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _forked(caller: str) -> bool:
    """True (logged) in a process forked from the one that initialised the worker: the rank's
    records are that process's to write, so a fork gets no worker of its own."""
    worker = _worker
    if worker is None or worker.pid == os.getpid():
        return False
    log.error("%s: process %d was forked from process %d, which initialised the profiling worker for rank %s; "
              "a forked process gets none (the rank's records are written by that process alone)",
              caller, os.getpid(), worker.pid, worker.rank)
    return True


def init_taskd_worker(rank_id, upper_limit_of_disk_in_mb=5000, framework="pt") -> bool:
    """Load libmspti and prepare the worker for `rank_id`; False (logged) when that is not possible,
    and in a process forked from one that has initialised it."""
    global _worker
    if not _valid_int(rank_id):
        log.error("init_taskd_worker: rank_id must be a non-negative int, got %r", rank_id)
        return False
    if not _valid_int(upper_limit_of_disk_in_mb):
        log.error("init_taskd_worker: upper_limit_of_disk_in_mb must be a non-negative int, got %r",
                  upper_limit_of_disk_in_mb)
        return False
    with _lock:
        if _forked("init_taskd_worker"):
            return False
        if _worker is not None:
            if _worker.rank == rank_id:
                return True
            log.error("init_taskd_worker: already initialised for rank %s", _worker.rank)
            return False
        path = find_library()
        if path is None:
            log.error("profiling disabled: %s not found in $LD_LIBRARY_PATH, the ld cache or %s",
                      LIBRARY, TOOLKIT_LIBRARY)
            return False
        cls, impl = _collector_class()
        try:
            collector = cls(path)
        except Exception as exc:  # OSError for a missing symbol; anything else must not stop training either
            log.error("profiling disabled: %s", exc)
            return False
        manager = tasknet.client_from_env(rank_id)
        _worker = Worker(rank_id, upper_limit_of_disk_in_mb, collector, root=profiling_root(), job=job_id,
                         switch_path=switch_path(), implementation=impl, manager=manager)
        log.info("profiling worker ready: rank %s, %s collector, library %s, framework %s, switch: %s",
                 rank_id, impl, path, framework,
                 "file" if manager is None else f"TaskD manager via {manager.address}, file until registered")
        return True


def start_taskd_worker() -> bool:
    """Start the background thread (after `init_taskd_worker`), and the TaskD manager client when the
    process is in a TaskD job with a manager; stops them and writes the rest at exit. False (logged)
    in a process forked from the one that initialised the worker: it gets no worker of its own."""
    global _atexit_registered
    with _lock:
        worker = _worker
        if worker is None:
            log.error("start_taskd_worker: init_taskd_worker has not succeeded")
            return False
        if _forked("start_taskd_worker"):
            return False
        started = worker.start()
        if started and not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
        return started


def _at_exit() -> None:
    worker = _worker
    if worker is not None and worker.pid == os.getpid():  # a forked child leaves the parent's records alone
        worker.stop()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork
    worker = _worker
    if worker is not None:
        worker.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def stats() -> dict:
    """The worker's counters (collector, switch, writer); only `implementation` before init."""
    worker = _worker
    if worker is None:
        return {"implementation": implementation(), "initialised": False}
    out = worker.stats()
    out["initialised"] = True
    return out
