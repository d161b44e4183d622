"""The pods on this node, from one list+watch that every component needing them shares.

The datatrace switch files and the step metrics' job labels both follow this node's pods; one
watch (not one per feature) keeps the API server's load and the agent's memory at one copy. Each
subscriber brings its own conversion, so only the fields somebody uses are kept, and receives its
own view after the first list and after every change.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, Callable

from agent.common.executor import Lane
from agent.kube.client import KubeUnavailable
from agent.kube.watch import Key, ListWatch
from agent.lifecycle import Tasks

log = logging.getLogger(__name__)


class NodePods:
    name = "node-pods"

    def __init__(self, node: str, api_factory: Callable[[], object], kube: Lane, watch_timeout_s: int = 300):
        self._node = node
        self._kube = kube
        self.tasks = Tasks(self.name)
        self._api_factory = api_factory
        self._watch_timeout_s = watch_timeout_s
        self._subscribers: list[tuple[Callable[[Any], Any], Callable[[dict[Key, Any]], None]]] = []
        self._watch: ListWatch | None = None
        self.unavailable = ""  # why the API server cannot be asked, "" when it can

    def subscribe(self, convert: Callable[[Any], Any], on_change: Callable[[dict[Key, Any]], None]) -> None:
        """Before start: `on_change({(namespace, name): convert(pod)})`, pods converted to None left out."""
        self._subscribers.append((convert, on_change))

    @property
    def subscribed(self) -> bool:
        return bool(self._subscribers)

    @property
    def synced(self) -> bool:
        return self._watch is not None and self._watch.synced

    @property
    def counters(self) -> Counter[str]:
        return self._watch.counters if self._watch is not None else Counter()

    async def start(self) -> None:
        try:
            api = self._api_factory()
        except KubeUnavailable as exc:
            self.unavailable = str(exc)
            log.error("cannot reach Kubernetes; nothing that needs this node's pods works", extra={"error": str(exc)})
            return
        self._watch = ListWatch("pods", api.list_pod_for_all_namespaces, self._convert, self._changed,
                                asyncio.get_running_loop(), self._kube, timeout_s=self._watch_timeout_s,
                                field_selector=f"spec.nodeName={self._node}")
        self.tasks.start("watch", self._watch.run)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        await self.tasks.stop(timeout=1.0)

    def readiness(self) -> tuple[bool, str]:
        if self.unavailable:
            return False, self.unavailable
        if self._watch is not None and self._watch.problem:
            return False, self._watch.problem
        return (True, "") if self.synced else (False, "waiting for the first list of pods")

    def _convert(self, pod) -> tuple:
        return tuple(convert(pod) for convert, _ in self._subscribers)

    def _changed(self, pods: dict[Key, tuple]) -> None:
        for index, (_, on_change) in enumerate(self._subscribers):
            on_change({key: views[index] for key, views in pods.items() if views[index] is not None})
