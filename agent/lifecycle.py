"""How the agent's components live: started in order, stopped in reverse, their long-lived tasks supervised.

A task that raises is logged (with its traceback the first time that error is seen), counted in
`npu_agent_task_restarts_total`, shown on /readyz as its component's reason, and started again
after a backoff (1 s doubling to 60 s, reset by a run of a minute). Its component may pass a
`reset` that puts its state back to what a fresh start expects. No task dies silently."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from typing import Awaitable, Callable, Iterable, Protocol

from prometheus_client.core import Metric

from agent.common.families import counter, described, gauge

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
HEALTHY_AFTER_S = 10.0  # a restarted task that runs this long is no longer a reason to be unready
BACKOFF_RESET_S = 60.0  # a run this long starts the backoff over
STOP_BUDGET_S = 8.0  # SIGTERM to exit within 10 s, with room for the interpreter to wind down

restarts: Counter[str] = Counter()  # "<component>/<task>" -> restarts (npu_agent_task_restarts_total)


def spawn(coro, component: str, name: str) -> asyncio.Task:
    """A short task (one request, one confirmation poll) that nobody awaits: its failure is logged
    and counted like a long-lived task's, not lost with it."""
    task = asyncio.ensure_future(coro)

    def done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            restarts[f"{component}/{name}"] += 1
            log.error("task failed", exc_info=task.exception(), extra={"component": component, "task": name})

    task.add_done_callback(done)
    return task


class Tasks:
    """The long-lived tasks of one component."""

    def __init__(self, component: str, backoff_first_s: float = BACKOFF_FIRST_S,
                 healthy_after_s: float = HEALTHY_AFTER_S):
        self.component = component
        self._backoff_first_s = backoff_first_s
        self._healthy_after_s = healthy_after_s
        self._tasks: dict[str, asyncio.Task] = {}
        self._failures: dict[str, str] = {}  # task -> why it is not running as it should
        self._seen: set[tuple[str, str]] = set()  # (task, error type) whose traceback was logged

    def start(self, name: str, body: Callable[[], Awaitable[None]], reset: Callable[[], None] | None = None) -> None:
        """Run `body()` until it returns; when it raises, call `reset()` and run it again after the backoff."""
        if name in self._tasks and not self._tasks[name].done():
            raise RuntimeError(f"{self.component}/{name} is already running")
        self._tasks[name] = asyncio.create_task(self._supervise(name, body, reset), name=f"{self.component}/{name}")

    async def stop(self, timeout: float | None = None) -> None:
        """Cancel every task; one stuck in a call that ignores cancellation is left behind after `timeout`."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def cancel(self, name: str) -> None:
        """End one task (one that belongs to something that went away, e.g. a job's link)."""
        task = self._tasks.pop(name, None)
        self._failures.pop(name, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    @property
    def problem(self) -> str:
        return "; ".join(self._failures[name] for name in sorted(self._failures))

    @property
    def running(self) -> list[str]:
        return sorted(name for name, task in self._tasks.items() if not task.done())

    async def _supervise(self, name: str, body: Callable[[], Awaitable[None]], reset: Callable[[], None] | None) -> None:
        loop = asyncio.get_running_loop()
        backoff = self._backoff_first_s
        healthy: asyncio.TimerHandle | None = None
        try:
            while True:
                started = loop.time()
                try:
                    await body()
                    self._failures.pop(name, None)
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if healthy is not None:
                        healthy.cancel()
                    if loop.time() - started >= BACKOFF_RESET_S:
                        backoff = self._backoff_first_s
                    key = f"{self.component}/{name}"
                    restarts[key] += 1
                    error = f"{type(exc).__name__}: {str(exc)[:300]}"
                    self._failures[name] = f"task {name} failed ({error}); restarted with backoff"
                    first = (name, type(exc).__name__) not in self._seen
                    self._seen.add((name, type(exc).__name__))
                    log.error("task failed; restarting it", exc_info=first, extra={
                        "component": self.component, "task": name, "error": error,
                        "restarts": restarts[key], "backoff_s": round(backoff, 1)})
                await asyncio.sleep(backoff * random.uniform(0.8, 1.0))
                backoff = min(BACKOFF_MAX_S, backoff * 2)
                if reset is not None:
                    try:
                        reset()
                    except Exception:
                        log.exception("task reset failed; restarting it anyway",
                                      extra={"component": self.component, "task": name})
                healthy = loop.call_later(self._healthy_after_s, self._failures.pop, name, None)
        finally:
            if healthy is not None:
                healthy.cancel()


class Component(Protocol):
    """Runs its long-lived tasks through a `Tasks` named `tasks`, whose failures show on /readyz."""

    name: str

    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def readiness(self) -> tuple[bool, str]: ...


class Supervisor:
    def __init__(self, components: list[Component]):
        self.components = tuple(components)
        self._started: list[Component] = []

    async def start(self) -> None:
        for component in self.components:
            await component.start()
            self._started.append(component)

    async def stop(self, budget_s: float = STOP_BUDGET_S) -> None:
        deadline = time.monotonic() + budget_s
        for component in reversed(self._started):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                await asyncio.wait_for(component.stop(), remaining)
            except asyncio.TimeoutError:
                log.warning("component did not stop in time", extra={"component": component.name})
            except Exception:
                log.exception("component failed to stop", extra={"component": component.name})
        self._started.clear()


class Readiness:
    """/readyz and npu_agent_component_ready: each component's own word and its supervised tasks'.
    A component standing for others until they are built (agent.ondemand.OnDemand) lists them in
    `parts` once they are: they are reported in its place."""

    def __init__(self, components: list[Component]):
        self._components = tuple(components)

    def states(self) -> list[tuple[str, bool, str]]:
        """(component, ready, why not)."""
        states = []
        for component in (part for c in self._components for part in getattr(c, "parts", None) or (c,)):
            ok, why = component.readiness()
            tasks = getattr(component, "tasks", None)
            failed = tasks.problem if tasks is not None else ""
            states.append((component.name, ok and not failed, "; ".join(p for p in (why, failed) if p)))
        return states

    def ready_by_component(self) -> list[tuple[str, bool]]:
        return [(name, ok) for name, ok, _ in self.states()]

    def check(self) -> tuple[bool, list[str]]:
        reasons = [f"{name}: {why}" for name, ok, why in self.states() if not ok]
        return not reasons, reasons


TASK_RESTARTS = counter("npu_agent_task_restarts_total",
                        "Background tasks restarted after an unexpected error, by component/task", "task")
READY = gauge("npu_agent_component_ready", "1 when the component is ready", "component")


class LifecycleCollector:
    """Restarted tasks (every component's) and each component's readiness, at scrape time."""

    def __init__(self, node: str, readiness: Readiness):
        self._node = node
        self._readiness = readiness

    def describe(self) -> list[Metric]:
        return described((TASK_RESTARTS, READY))

    def collect(self) -> Iterable[Metric]:
        yield TASK_RESTARTS.counts(self._node, restarts)
        yield READY.series(self._node, ((name, 1 if ok else 0) for name, ok in self._readiness.ready_by_component()))
