"""The daemon pool for driver calls: results, exceptions, and no thread left to join at exit."""

from __future__ import annotations

import threading

import pytest

from agent.common.pool import DaemonPool


def test_results_exceptions_and_reuse():
    pool = DaemonPool(max_threads=2, name="t")
    assert [pool.submit(pow, 2, n).result(5) for n in range(10)] == [2**n for n in range(10)]
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    assert sum(t.name.startswith("t-") for t in threading.enumerate()) <= 2
    pool.close()


def test_a_stuck_call_does_not_block_the_others_and_its_thread_is_a_daemon():
    pool = DaemonPool(max_threads=3, name="s")
    release = threading.Event()
    stuck = pool.submit(release.wait, 30)
    assert pool.submit(lambda: "free").result(5) == "free"
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("s-"))
    release.set()
    assert stuck.result(5) is True
    pool.close()
    with pytest.raises(RuntimeError):
        pool.submit(print)


POOL_UNDER_A_PID_LIMIT = r"""
import sys, time
from pathlib import Path
from agent.common.pool import DaemonPool

cgroup = Path(sys.argv[1])
pool = DaemonPool(max_threads=1, name="p")
(cgroup / "cgroup.procs").write_text("0")  # this process
(cgroup / "pids.max").write_text((cgroup / "pids.current").read_text().strip())
try:
    pool.submit(print)
    print("no refusal")
except RuntimeError as exc:
    print("refused:", exc)
(cgroup / "pids.max").write_text("max")
print("after:", pool.submit(lambda: "ran").result(10))
"""


def test_a_thread_the_kernel_refuses_is_not_counted_so_the_pool_works_once_it_may_start_one(pids_limit):
    """A pod's PID limit refuses the pool a thread: the caller gets the error, and the pool must not
    believe it has that thread (with one thread allowed, every later call would wait forever)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", POOL_UNDER_A_PID_LIMIT, str(pids_limit.path)],
                          capture_output=True, text=True, timeout=30)
    assert "refused: can't start new thread" in done.stdout, done.stdout + done.stderr
    assert "after: ran" in done.stdout, done.stdout + done.stderr
