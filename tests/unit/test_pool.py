"""The daemon pool for driver calls: results, exceptions, and no thread left to join at exit."""

from __future__ import annotations

import threading

import pytest

from agent.devices.pool import DaemonPool


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
