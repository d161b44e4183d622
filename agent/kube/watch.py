"""List-then-watch of one Kubernetes collection, kept as a plain dict of converted objects.

The official client is blocking, so each list and each watch runs in the executor's kube lane (a
dead connection must not hold up SIGTERM; a watch holds a thread of the lane for as long as it
lasts) and hands every new state to the event loop, which drives the retries. It lists, then
watches from the list's resourceVersion; a 410 Gone (the server compacted past it) relists at once, any
other failure retries after a backoff with jitter, resuming the watch from the last version seen
(like client-go's reflector). Both sides have time-outs: the server ends a
watch after `WATCH_TIMEOUT_S`, the client gives up on a silent connection a little later.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections import Counter
from typing import Any, Callable, Generic, TypeVar

import urllib3
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from agent.common.executor import CallTimeout, Lane
from agent.common.ratelimit import doubling
from agent.lifecycle import restarts

log = logging.getLogger(__name__)

T = TypeVar("T")
Key = tuple[str, str]  # (namespace, name)

LIST_TIMEOUT_S = 30.0
WATCH_TIMEOUT_S = 300  # server side: a watch ends cleanly after this and is resumed
WATCH_READ_SLACK_S = 30.0  # client side: no byte for this long after the server's time-out = dead
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 30.0


class ListWatch(Generic[T]):
    """Keeps `convert(obj)` of every object `list_call` returns, current through a watch.

    `on_change(objects, synced)` runs on the loop after the first list and after every change;
    `convert` may return None to ignore an object. Its owner runs `run()` as one of its tasks.
    """

    def __init__(self, name: str, list_call: Callable[..., Any], convert: Callable[[Any], T | None],
                 on_change: Callable[[dict[Key, T]], None], loop: asyncio.AbstractEventLoop, kube: Lane,
                 timeout_s: int = WATCH_TIMEOUT_S, **selectors: str):
        self.name = name
        self._list = list_call
        self._convert = convert
        self._on_change = on_change
        self._loop = loop
        self._kube = kube
        self._selectors = selectors
        self._timeout_s = timeout_s
        self._version: str | None = None  # resourceVersion reached; None: list first
        self._objects: dict[Key, T] = {}
        self._stopping = threading.Event()
        self._watch: watch.Watch | None = None
        self.synced = False
        self._seen: set[str] = set()  # unexpected errors whose traceback was logged
        self.problem = ""  # the last unexpected failure, until a list succeeds again
        self.forbidden = False  # the last list or watch was refused (403: a missing grant), until one works
        self.counters: Counter[str] = Counter()  # lists, events, relist_expired, error_<reason>

    def stop(self) -> None:
        """Make a watch under way return at its next event (its owner cancels `run`)."""
        self._stopping.set()
        if self._watch is not None:
            self._watch.stop()

    async def run(self) -> None:
        attempt = 0
        while not self._stopping.is_set():
            try:
                if self._version is None:
                    await self._kube.run(self._relist, timeout=LIST_TIMEOUT_S + 5, key=f"list/{self.name}")
                # Until the server ends the watch after timeout_s (then resumed), or the client gives up.
                await self._kube.run(self._follow, timeout=self._timeout_s + WATCH_READ_SLACK_S + 5,
                                     key=f"watch/{self.name}")
                attempt = 0
                continue
            except ApiException as exc:
                if exc.status == 410:  # compacted past our version: relist at once, nothing is wrong
                    self._version = None
                    self.counters["relist_expired"] += 1
                    log.info("kubernetes watch expired (410); relisting", extra={"watch": self.name})
                    continue
                reason = f"http_{exc.status}"
                self.forbidden = exc.status == 403
            except (urllib3.exceptions.HTTPError, OSError, ValueError, CallTimeout) as exc:
                reason = f"{type(exc).__name__}"
            except Exception as exc:  # a bug, or an object of a shape nobody foresaw: relist, never end the watch
                reason = f"unexpected_{type(exc).__name__}"
                self._version = None
                restarts[f"kube-watch/{self.name}"] += 1
                log.error("kubernetes watch failed unexpectedly; relisting", exc_info=reason not in self._seen,
                          extra={"watch": self.name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                self._seen.add(reason)
                self.problem = f"{self.name} watch failed unexpectedly ({type(exc).__name__}); relisting"
            if self._stopping.is_set():
                return
            self.counters[f"error_{reason}"] += 1
            attempt += 1
            delay = random.uniform(0.5, doubling(attempt, BACKOFF_FIRST_S, BACKOFF_MAX_S))
            # A broken watch resumes from the last version seen (a 410 then relists); a failed list retries.
            log.warning("kubernetes list/watch failed; retrying", extra={
                "watch": self.name, "reason": reason, "retry_in_s": round(delay, 2),
                "resume_from": self._version or "a fresh list"})
            await asyncio.sleep(delay)

    def _relist(self) -> None:
        result = self._list(_request_timeout=LIST_TIMEOUT_S, **self._selectors)
        self.counters["lists"] += 1
        objects = {}
        for item in result.items:
            converted = self._convert(item)
            if converted is not None:
                objects[(item.metadata.namespace or "", item.metadata.name)] = converted
        self._objects = objects
        self._version = result.metadata.resource_version
        self.problem = ""
        self.forbidden = False
        self._publish()

    def _follow(self) -> None:
        """Apply watch events from the current version until the server ends the watch."""
        self._watch = watch.Watch()
        stream = self._watch.stream(self._list, resource_version=self._version, timeout_seconds=self._timeout_s,
                                    _request_timeout=(LIST_TIMEOUT_S, self._timeout_s + WATCH_READ_SLACK_S),
                                    allow_watch_bookmarks=False, **self._selectors)
        for event in stream:
            if self._stopping.is_set():
                break
            kind, item = event["type"], event["object"]
            if kind == "ERROR":  # the client raises ApiException for error events; anything else is odd
                raise ValueError(f"watch error event: {event.get('raw_object')}")
            key = (item.metadata.namespace or "", item.metadata.name)
            self.counters["events"] += 1
            self._version = item.metadata.resource_version or self._version
            converted = None if kind == "DELETED" else self._convert(item)
            if converted is None:
                if self._objects.pop(key, None) is None:
                    continue
            else:
                self._objects[key] = converted
            self._publish()

    def _publish(self) -> None:
        snapshot = dict(self._objects)
        try:
            self._loop.call_soon_threadsafe(self._deliver, snapshot)
        except RuntimeError:  # the loop closed while stopping
            self._stopping.set()

    def _deliver(self, snapshot: dict[Key, T]) -> None:
        # Synced on the loop, with the objects: a reader on the loop never sees "synced" without them.
        self.synced = True
        self._on_change(snapshot)
