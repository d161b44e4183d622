"""agent.lifecycle: a task that raises is logged, counted, named on readiness and started again."""

from __future__ import annotations

import asyncio
import logging

from agent import lifecycle as tasks
from agent.lifecycle import Tasks
from testkit.wait import until


def test_a_failing_task_is_restarted_after_reset_and_shows_until_it_has_run_a_while(caplog):
    runs, resets = [], []

    async def main():
        done = asyncio.Event()

        async def body():
            runs.append(len(runs))
            if len(runs) <= 2:
                raise OSError(f"boom {len(runs)}")
            await done.wait()

        group = Tasks("comp", backoff_first_s=0.05, healthy_after_s=0.3)
        group.start("loop", body, reset=lambda: resets.append(1))
        await until(lambda: len(runs) == 3, 20, "the third run")
        assert group.problem.startswith("task loop failed (OSError: boom 2)")
        assert group.running == ["loop"]
        await until(lambda: not group.problem, 20, "the third run to count as healthy")
        done.set()
        await until(lambda: not group.running, 20, "the task to finish")  # a body that returns is not restarted
        assert len(runs) == 3

    caplog.set_level(logging.ERROR, "agent.lifecycle")
    before = tasks.restarts["comp/loop"]
    asyncio.run(main())
    assert tasks.restarts["comp/loop"] - before == 2
    assert resets == [1, 1]
    failed = [r for r in caplog.records if r.getMessage() == "task failed; restarting it"]
    assert [r.error for r in failed] == ["OSError: boom 1", "OSError: boom 2"]
    assert [bool(r.exc_info) for r in failed] == [True, False]  # the traceback once per kind of error


def test_stop_cancels_tasks_and_a_failing_reset_does_not_end_the_task():
    async def main():
        runs = []

        async def body():
            runs.append(1)
            if len(runs) == 1:
                raise ValueError("first")
            await asyncio.Event().wait()

        def reset():
            raise RuntimeError("reset broke")

        group = Tasks("comp2", backoff_first_s=0.01, healthy_after_s=60)
        group.start("loop", body, reset=reset)
        await until(lambda: len(runs) == 2, 20, "the restart")
        assert "ValueError: first" in group.problem
        await group.stop(timeout=5)
        assert group.running == []

    asyncio.run(main())


def test_the_backoff_doubles_between_failures():
    async def main():
        loop = asyncio.get_running_loop()
        times = []

        async def body():
            times.append(loop.time())
            raise KeyError("x")

        group = Tasks("comp3", backoff_first_s=0.1, healthy_after_s=60)
        group.start("loop", body)
        await until(lambda: len(times) == 4, 20, "three restarts")
        await group.stop()
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert gaps[0] >= 0.08 and gaps[1] >= 0.16 and gaps[2] >= 0.32  # 1x, 2x, 4x (jitter: 80-100 %)

    asyncio.run(main())
