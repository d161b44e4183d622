"""The one executor for blocking calls: lanes with their own limits, stuck calls kept apart and
refused by key, idle threads that end, daemon threads that never hold up the exit."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from agent.common.executor import CallTimeout, Executor, StillStuck
from testkit.wait import until


def test_results_exceptions_and_thread_reuse():
    executor = Executor(name="t")
    lane = executor.lane("files", 2)
    assert [lane.submit(pow, 2, n).result(5) for n in range(10)] == [2**n for n in range(10)]
    with pytest.raises(ZeroDivisionError):
        lane.submit(lambda: 1 / 0).result(5)
    assert executor.threads == 1  # one call at a time: one thread, reused
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("t-"))
    executor.close()
    with pytest.raises(RuntimeError):
        lane.submit(print)


def test_a_lane_runs_at_most_its_limit_at_once():
    executor = Executor()
    lane = executor.lane("driver", 2)
    release = threading.Event()
    running, peak = [0], [0]
    lock = threading.Lock()

    def call(n: int) -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        release.wait(10)
        with lock:
            running[0] -= 1

    futures = [lane.submit(call, n) for n in range(6)]
    release.set()
    for future in futures:
        future.result(10)
    assert peak[0] == 2 and executor.threads <= 2
    executor.close()


def test_a_stuck_call_is_counted_its_key_refused_and_the_lanes_other_calls_go_on():
    async def body():
        executor = Executor()
        lane = executor.lane("driver", 1, stuck_limit=4)
        release = threading.Event()
        with pytest.raises(CallTimeout):
            await lane.run(release.wait, 30, timeout=0.1, key="read/3")
        assert (lane.stuck, lane.counters["timeouts"]) == (1, 1)
        with pytest.raises(StillStuck):  # at once, not after another time-out
            await lane.run(print, timeout=0.1, key="read/3")
        assert lane.counters["refused"] == 1
        # The stuck call left the lane's one running slot: another device's read runs.
        assert await lane.run(lambda: "read/4", timeout=5, key="read/4") == "read/4"
        release.set()
        await until(lambda: lane.stuck == 0, 20, "the stuck call to return")
        assert await lane.run(lambda: "again", timeout=5, key="read/3") == "again"
        executor.close()

    asyncio.run(body())


def test_past_its_stuck_limit_a_lane_stalls_its_waiting_calls_time_out_unrun_and_other_lanes_go_on():
    async def body():
        executor = Executor()
        files, driver = executor.lane("rule-files", 1, stuck_limit=0), executor.lane("driver", 1)
        release = threading.Event()
        with pytest.raises(CallTimeout):
            await files.run(release.wait, 30, timeout=0.1)
        ran = []
        with pytest.raises(CallTimeout):
            await files.run(ran.append, 1, timeout=0.1)  # waits behind the stuck call, then is dropped
        assert await driver.run(lambda: "other lane", timeout=5) == "other lane"
        release.set()
        assert await files.run(lambda: "after", timeout=5) == "after"
        assert ran == [] and executor.threads <= executor.max_threads
        executor.close()

    asyncio.run(body())


def test_idle_threads_end_and_a_thread_is_started_again_when_needed():
    executor = Executor(name="idle", idle_s=0.1)
    lane = executor.lane("driver", 4)
    barrier = threading.Barrier(4)
    for future in [lane.submit(barrier.wait, 10) for _ in range(4)]:
        future.result(10)
    assert executor.threads == 4
    asyncio.run(until(lambda: executor.threads == 0, 20, "idle threads to end"))
    assert lane.submit(lambda: "fresh").result(10) == "fresh"
    executor.close()


def test_a_cancelled_caller_leaves_no_call_waiting():
    async def body():
        executor = Executor()
        lane = executor.lane("kube", 1)
        release = threading.Event()
        first = asyncio.ensure_future(lane.run(release.wait, 30))
        await until(lambda: lane.running == 1, 20, "the first call to run")
        ran = []
        second = asyncio.ensure_future(lane.run(ran.append, 1))
        await until(lambda: len(lane.waiting) == 1, 20, "the second call to wait")
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        assert not lane.waiting
        release.set()
        await first
        assert ran == []
        executor.close()

    asyncio.run(body())


EXIT_WITH_A_STUCK_CALL = r"""
import asyncio, threading
from agent.common.executor import Executor

async def main():
    executor = Executor()
    asyncio.get_running_loop().set_default_executor(executor.lane("default", 2))
    asyncio.get_running_loop().run_in_executor(None, threading.Event().wait)  # never returns
    print(await asyncio.to_thread(lambda: "to_thread ran"), flush=True)

asyncio.run(main())  # shuts the default executor down: must not join the stuck thread
print("exited", flush=True)
"""


def test_as_the_loops_default_executor_a_stuck_call_does_not_hold_up_the_exit():
    done = subprocess.run([sys.executable, "-c", EXIT_WITH_A_STUCK_CALL], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["to_thread ran", "exited"]


UNDER_A_PID_LIMIT = r"""
import sys
from pathlib import Path
from agent.common.executor import Executor

cgroup = Path(sys.argv[1])
lane = Executor().lane("files", 1)
(cgroup / "cgroup.procs").write_text("0")  # this process
(cgroup / "pids.max").write_text((cgroup / "pids.current").read_text().strip())
try:
    lane.submit(print)
    print("no refusal")
except RuntimeError as exc:
    print("refused:", exc)
(cgroup / "pids.max").write_text("max")
print("after:", lane.submit(lambda: "ran").result(10))
"""


def test_a_thread_the_kernel_refuses_is_not_counted_so_the_lane_works_once_it_may_start_one(pids_limit):
    done = subprocess.run([sys.executable, "-c", UNDER_A_PID_LIMIT, str(pids_limit.path)],
                          capture_output=True, text=True, timeout=30)
    assert "refused: can't start new thread" in done.stdout, done.stdout + done.stderr
    assert "after: ran" in done.stdout, done.stdout + done.stderr


def test_a_calls_time_out_counts_from_its_start_not_from_its_wait_for_a_turn():
    async def body():
        executor = Executor()
        lane = executor.lane("driver", 1)
        # The second call waits 1 s for the first, then runs 1 s: 2 s in all, each within its 1.9 s.
        calls = [asyncio.ensure_future(lane.run(time.sleep, 1.0, timeout=1.9)) for _ in range(2)]
        assert await asyncio.gather(*calls) == [None, None]
        assert lane.counters["timeouts"] == 0
        executor.close()

    asyncio.run(body())
