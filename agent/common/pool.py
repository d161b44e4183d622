"""A pool of daemon threads for driver calls.

concurrent.futures' pool joins its threads when the interpreter exits, so one driver call that
never returns would keep the agent from stopping on SIGTERM. These threads are daemons: a stuck
call is abandoned at exit instead.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable


class DaemonPool:
    def __init__(self, max_threads: int, name: str):
        self._max = max_threads
        self._name = name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("pool closed")
            if self._idle:
                self._idle -= 1  # an idle thread will take it
            elif self._threads < self._max:
                # The kernel may refuse a thread (a pod's PID limit): then this pool does not have it.
                threading.Thread(target=self._work, name=f"{self._name}-{self._threads + 1}", daemon=True).start()
                self._threads += 1
            # else: every thread is busy; the task waits in the queue
        self._tasks.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # handed to the waiter, never lost
                    future.set_exception(exc)
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        """Let idle threads end; threads stuck in a call end with the process."""
        with self._lock:
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._tasks.put(None)
