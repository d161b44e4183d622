"""The one executor for blocking calls: daemon threads shared by every purpose, each purpose in its own lane.

The agent's work runs on one asyncio loop; whatever blocks (driver calls, file reads and fsyncs, the
Kubernetes client, /proc walks, getaddrinfo) runs here. Threads are daemons: a call that never
returns is abandoned at exit instead of holding up SIGTERM (concurrent.futures' pool joins its
threads at exit). Threads start on demand and end after `idle_s` without work, so an idle agent
holds only the threads its steady work uses.

A lane runs at most `limit` of its calls at once; the rest wait in order. A purpose whose calls
hang therefore fills its own lane and no other. `run` takes a time-out that counts from the call's
start (a call that waited as long for its turn is dropped unrun). A call whose caller gave up on
it after it started is *stuck*: it keeps its thread until it returns, is counted, and further
calls with the same `key` are refused at once until it does. Up to `stuck_limit` stuck calls leave the lane's
running count, so the lane's other calls go on (one stuck driver call per device must not stop the
reads of the others); past that a stuck call keeps its slot, and the lane fills up and stalls
instead of growing. The executor's threads are bounded by the sum of every lane's two limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Hashable

IDLE_S = 60.0  # a thread without work for this long ends


class CallTimeout(Exception):
    """No answer within the caller's time-out (the call may still be running: it is then stuck)."""


class StillStuck(CallTimeout):
    """Refused at once: an earlier call with the same key has not returned yet."""


def _outcome_not_wanted(waiter: asyncio.Future) -> None:
    """The caller went away: a failure of the call it left behind is not an unretrieved error."""
    if not waiter.cancelled():
        waiter.exception()


class _Call:
    __slots__ = ("future", "fn", "args", "lane", "key", "stuck", "started", "finished")

    def __init__(self, future: Future, fn: Callable, args: tuple, lane: "Lane", key: Hashable | None):
        self.future, self.fn, self.args, self.lane, self.key = future, fn, args, lane, key
        self.stuck = False
        self.started: float | None = None  # time.monotonic() when a thread took it
        self.finished = False  # returned (its slot is free); the future is set just after


class _Worker:
    __slots__ = ("call", "wake", "number")

    def __init__(self, call: _Call, number: int):
        self.call: _Call | None = call
        self.wake = threading.Event()
        self.number = number


class Lane(ThreadPoolExecutor):
    """One purpose's share of the executor. A ThreadPoolExecutor in type only (asyncio's
    `set_default_executor` insists on it); `submit` returns a concurrent Future."""

    def __init__(self, executor: "Executor", purpose: str, limit: int, stuck_limit: int):  # no super().__init__
        self._executor = executor
        self.purpose = purpose
        self.limit = limit
        self.stuck_limit = stuck_limit
        self.running = 0  # calls on a thread, stuck ones past stuck_limit included
        self.stuck = 0  # calls given up on by their callers, still on a thread
        self.waiting: deque[_Call] = deque()
        self.stuck_keys: dict[Hashable, _Call] = {}
        self.counters: Counter[str] = Counter()  # calls, timeouts, refused

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        if kwargs:
            return self._executor.call(self, lambda: fn(*args, **kwargs), (), None).future
        return self._executor.call(self, fn, args, None).future

    async def run(self, fn: Callable, *args, timeout: float | None = None, key: Hashable | None = None):
        """`fn(*args)` in a thread of this lane. CallTimeout when it has not started within `timeout`
        seconds (it is dropped: it waited behind slower calls), or started and ran that long (it is
        left stuck, see the module's doc). StillStuck at once while an earlier call with the same
        `key` is stuck."""
        executor = self._executor
        call = executor.call(self, fn, args, key)
        waiter = asyncio.wrap_future(call.future)
        try:
            if timeout is None:
                return await waiter
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(asyncio.shield(waiter), timeout)
            left = call.started + timeout - time.monotonic() if call.started is not None else 0.0
            if left > 0:  # it waited for its turn first: its own time counts from its start
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(asyncio.shield(waiter), left)
            if executor.give_up(call):
                waiter.add_done_callback(_outcome_not_wanted)
                raise CallTimeout(f"{self.purpose}: no answer within {timeout:g}s")
            return await waiter  # it finished just now
        except asyncio.CancelledError:
            executor.drop(call)
            waiter.add_done_callback(_outcome_not_wanted)
            raise

    def close(self) -> None:
        """Fail this lane's waiting calls (a component that stops); running ones finish or stay stuck."""
        self._executor.drop_waiting(self)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        # asyncio.run() shuts the default executor down with wait=True: joining a thread stuck in a
        # call would hold the exit forever, so nothing is joined.
        self.close()


class Executor:
    def __init__(self, name: str = "blocking", idle_s: float = IDLE_S):
        self.name = name
        self._idle_s = idle_s
        self._lock = threading.RLock()  # a future cancelled under it may run callbacks that submit
        self._lanes: dict[str, Lane] = {}
        self._idle: list[_Worker] = []  # last in, first out: the threads beyond the steady need idle out
        self._threads = 0
        self._numbers = 0
        self._closed = False

    def lane(self, purpose: str, limit: int = 1, stuck_limit: int = 0) -> Lane:
        """The lane for `purpose`, made on first use with these limits."""
        with self._lock:
            lane = self._lanes.get(purpose)
            if lane is None:
                lane = self._lanes[purpose] = Lane(self, purpose, max(1, limit), max(0, stuck_limit))
            return lane

    @property
    def lanes(self) -> list[Lane]:
        return list(self._lanes.values())

    @property
    def threads(self) -> int:
        return self._threads

    @property
    def max_threads(self) -> int:
        return sum(lane.limit + lane.stuck_limit for lane in self.lanes)

    def call(self, lane: Lane, fn: Callable, args: tuple, key: Hashable | None) -> _Call:
        """Queue `fn(*args)` in `lane` and start it if the lane has room. RuntimeError when closed, or
        when the kernel refuses the thread it needs (a pod's PID limit) and nothing else would run it."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} executor closed")
            if key is not None and key in lane.stuck_keys:
                lane.counters["refused"] += 1
                raise StillStuck(f"{key}: the previous call has not returned yet")
            call = _Call(Future(), fn, args, lane, key)
            lane.counters["calls"] += 1
            lane.waiting.append(call)
            try:
                self._pump(lane)
            except RuntimeError:
                if call in lane.waiting:  # not started: the caller hears why
                    lane.waiting.remove(call)
                    raise
        return call

    def give_up(self, call: _Call) -> bool:
        """The caller stops waiting for `call`: drop it if it has not started; else leave it stuck.
        False if it finished meanwhile."""
        with self._lock:
            lane = call.lane
            if call.finished or call.future.done():
                return False
            lane.counters["timeouts"] += 1
            if call.future.cancel():
                self._forget(call)
                return True
            if call.key is not None:
                lane.stuck_keys[call.key] = call
            if lane.stuck < lane.stuck_limit:
                call.stuck = True
                lane.stuck += 1
                lane.running -= 1
                try:
                    self._pump(lane)
                except RuntimeError:  # no thread now: the next call that ends takes the waiting ones
                    pass
            return True

    def drop(self, call: _Call) -> None:
        """The caller went away (cancelled): a call not started yet is not run."""
        with self._lock:
            if call.future.cancel():
                self._forget(call)

    def drop_waiting(self, lane: Lane) -> None:
        """Waiting calls fail with RuntimeError (cancelling them would look, to the task awaiting one,
        as if that task had been cancelled)."""
        with self._lock:
            while lane.waiting:
                lane.waiting.popleft().future.set_exception(RuntimeError(f"{lane.purpose}: closed"))

    def close(self) -> None:
        """Idle threads end now, busy ones after their call; a stuck one ends with the process."""
        with self._lock:
            self._closed = True
            for lane in self._lanes.values():
                self.drop_waiting(lane)
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.wake.set()

    # ---- inside the lock ------------------------------------------------------------------------

    def _forget(self, call: _Call) -> None:
        if call in call.lane.waiting:
            call.lane.waiting.remove(call)

    def _pump(self, lane: Lane) -> None:
        """Start `lane`'s waiting calls while it has room."""
        while lane.waiting and lane.running < lane.limit:
            call = lane.waiting.popleft()
            lane.running += 1
            if self._idle:
                worker = self._idle.pop()
                worker.call = call
                worker.wake.set()
                continue
            self._numbers += 1
            worker = _Worker(call, self._numbers)
            try:
                threading.Thread(target=self._work, args=(worker,), name=f"{self.name}-{worker.number}",
                                 daemon=True).start()
            except RuntimeError:  # e.g. "can't start new thread": not counted, the call waits
                lane.running -= 1
                lane.waiting.appendleft(call)
                raise
            self._threads += 1

    def _next(self, done: _Call) -> _Call | None:
        """Account for `done`; the next call this thread runs: its lane's first, else any lane's."""
        lane = done.lane
        done.finished = True
        if done.stuck:
            lane.stuck -= 1
        else:
            lane.running -= 1
        if done.key is not None and lane.stuck_keys.get(done.key) is done:
            del lane.stuck_keys[done.key]
        for candidate in (lane, *self._lanes.values()):
            if candidate.waiting and candidate.running < candidate.limit:
                candidate.running += 1
                return candidate.waiting.popleft()
        return None

    # ---- the threads ----------------------------------------------------------------------------

    def _work(self, worker: _Worker) -> None:
        thread = threading.current_thread()
        call = worker.call
        while True:
            ran = call.future.set_running_or_notify_cancel()
            if ran:
                thread.name = f"{self.name}-{worker.number}:{call.lane.purpose}"
                call.started = time.monotonic()
                try:
                    result, failed = call.fn(*call.args), False
                except BaseException as exc:  # handed to the waiter, never lost
                    result, failed = exc, True
                call.fn = call.args = None  # nothing kept alive by an idle thread
            with self._lock:
                future, call = call.future, self._next(call)
                ending = call is None and self._closed
                if ending:
                    self._threads -= 1
                elif call is None:  # idle before the result is out: the caller's next call finds this thread
                    worker.call = None
                    worker.wake.clear()
                    self._idle.append(worker)
            if ran and failed:
                future.set_exception(result)
            elif ran:
                future.set_result(result)
            result = None
            if ending:
                return
            if call is not None:
                continue
            worker.wake.wait(self._idle_s)
            with self._lock:
                if worker.call is None:  # nobody handed it work: this thread ends
                    if worker in self._idle:
                        self._idle.remove(worker)
                    self._threads -= 1
                    return
                call = worker.call
