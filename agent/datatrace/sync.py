"""The datatrace component: pods on this node (the shared pod watch) + `data-trace-*` ConfigMaps ->
switch files.

Level-triggered: every change of either watch recomputes the whole desired state (a handful of
jobs per node) and one writer pass makes the disk match it. Directories of jobs without a local
pod are removed only once both watches have listed, so a restart never empties the tree first.
A pass that failed somewhere (a directory removed under it, a full disk) is run again after
RETRY_FIRST_S, doubling to RETRY_MAX_S, until one succeeds; the task runs under agent.tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections import Counter
from pathlib import Path
from typing import Callable

from agent.common.executor import Lane
from agent.kube.client import KubeUnavailable
from agent.kube.pods import NodePods
from agent.kube.watch import ListWatch
from agent.datatrace.desired import PodInfo, SwitchConfigMap, desired, pod_info, switch_configmap
from agent.datatrace.files import ApplyResult, SwitchFiles
from agent.lifecycle import Tasks

log = logging.getLogger(__name__)

CONFIGMAP_SELECTOR = "reset=true"
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
APPLY_TIMEOUT_S = 60.0


class DatatraceSync:
    name = "datatrace"

    def __init__(self, root: Path, node: str, api_factory: Callable[[], object], pods: NodePods, *,
                 kube: Lane, files: Lane, watch_timeout_s: int = 300, namespaces: tuple[str, ...] = ()):
        self._files = SwitchFiles(root)
        self._files_lane = files
        self._kube = kube
        self._node = node
        self._node_pods = pods
        pods.subscribe(pod_info, self._pods_changed)
        self._api_factory = api_factory
        self._watch_timeout_s = watch_timeout_s
        self._pods: dict[tuple[str, str], PodInfo] = {}
        self._configmaps: dict[tuple[str, str], SwitchConfigMap] = {}
        # One watch of every namespace, or one per namespace listed (what per-namespace Roles allow);
        # the pods come from the shared pod watch.
        self._namespaces = tuple(namespaces)
        self._configmap_watches: list[ListWatch] = []
        self._found: dict[str, dict[tuple[str, str], SwitchConfigMap]] = {}  # by watch
        self._dirty = asyncio.Event()
        self.tasks = Tasks(self.name)
        self._rejected_seen: set[tuple[str, str]] = set()
        self.rejected: Counter[str] = Counter()  # by kind: name, switch
        self.last: ApplyResult = ApplyResult()
        self._unavailable = ""

    @property
    def counters(self) -> Counter[str]:
        return self._files.counters

    @property
    def watch_counters(self) -> dict[str, Counter[str]]:
        configmaps = sum((watch.counters for watch in self._configmap_watches), Counter())
        return {"pods": self._node_pods.counters, "configmaps": configmaps}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            api = self._api_factory()
        except KubeUnavailable as exc:
            self._unavailable = str(exc)
            log.error("datatrace sync cannot reach Kubernetes; switch files are not kept", extra={"error": str(exc)})
            return
        # The client finds what a list returns in its method's docstring: the namespace goes as a keyword.
        lists = [(f"configmaps/{namespace}", api.list_namespaced_config_map, {"namespace": namespace})
                 for namespace in self._namespaces] or [("configmaps", api.list_config_map_for_all_namespaces, {})]
        for name, list_call, where in lists:
            watch = ListWatch(name, list_call, switch_configmap, functools.partial(self._configmaps_changed, name),
                              loop, self._kube, timeout_s=self._watch_timeout_s, label_selector=CONFIGMAP_SELECTOR,
                              **where)
            self._configmap_watches.append(watch)
            self.tasks.start("configmap-watch" if name == "configmaps" else f"{name}-watch", watch.run)
        self.tasks.start("sync", self._run, reset=self._dirty.set)  # after a failure: a full pass
        log.info("datatrace sync started", extra={"root": str(self._files.root), "node": self._node,
                                                  "namespaces": list(self._namespaces) or "all"})

    async def stop(self) -> None:
        for watch in self._configmap_watches:
            watch.stop()
        await self.tasks.stop()

    @property
    def _configmaps_synced(self) -> bool:
        return bool(self._configmap_watches) and all(watch.synced for watch in self._configmap_watches)

    def readiness(self) -> tuple[bool, str]:
        if self._unavailable:
            return False, self._unavailable
        waiting = [name for name, synced in (("pods", self._node_pods.synced), ("configmaps", self._configmaps_synced))
                   if not synced]
        return (False, f"waiting for the first list of {', '.join(waiting)}") if waiting else (True, "")

    def _pods_changed(self, pods: dict) -> None:
        self._pods = pods
        self._dirty.set()

    def _configmaps_changed(self, watch: str, configmaps: dict) -> None:
        self._found[watch] = configmaps
        self._configmaps = {key: value for found in self._found.values() for key, value in found.items()}
        self._dirty.set()

    async def _run(self) -> None:
        retry_s = RETRY_FIRST_S
        while True:
            if self.last.errors:  # again after a while, or at the next change
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._dirty.wait(), retry_s * random.uniform(0.8, 1.0))
                retry_s = min(RETRY_MAX_S, retry_s * 2)
            else:
                retry_s = RETRY_FIRST_S
                await self._dirty.wait()
            self._dirty.clear()
            want = desired(list(self._pods.values()), self._configmaps)
            for what, why in want.rejected:
                if (what, why) not in self._rejected_seen:  # once per problem while it lasts, not per pass
                    self.rejected["switch" if what.startswith("configmap") else "name"] += 1
                    log.error("profiling switch not flushed", extra={"object": what, "reason": why})
            self._rejected_seen = set(want.rejected)
            synced = self._node_pods.synced and self._configmaps_synced
            # A pass that does not end in time fails the task (restarted with backoff, on /readyz);
            # the next pass waits for the stuck one to return (the lane refuses the key meanwhile).
            self.last = await self._files_lane.run(self._files.apply, want.directories, synced,
                                                   timeout=APPLY_TIMEOUT_S, key="apply")
