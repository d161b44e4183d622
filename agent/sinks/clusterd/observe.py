"""What the API server shows of ClusterD: when its process starts again, and what it saved.

ClusterD's replies carry no epoch and its API has no read call, so a sender cannot tell from them
that ClusterD restarted, nor what it holds. A node that keeps its connection hears of a restart when
the connection drops; on a large cluster nodes connect only to send, and hear nothing. Two things in
the API server tell the rest:

- ClusterD's pods (`clusterd.pods`). A process that starts again is a pod whose container count of
  restarts grew, or a new pod; when it is ready, it serves. `Starts` turns pod updates into "a new
  ClusterD process is serving".
- The ConfigMap ClusterD saves its public-fault cache to and reloads it from at start
  (`clusterd.saved_faults`, `cluster-system/statistic-fault-info`). `PublicFaults` maps each node
  to its faults (resource, faultId, faultCode, level, faultTime, devIds; empty fields left out);
  `FaultNum` is `{"publicFaultNum": N}`, the size of the whole cache. It is rewritten about a
  second after each change, and above 4,500 faults only `FaultNum` is, so `PublicFaults` is stale
  exactly when it does not list N faults. No ConfigMap means ClusterD saved nothing, and a ClusterD
  that starts without one holds nothing.

So after a restart, or instead of blindly re-sending its faults, a node reads what ClusterD saved for
it and sends only the difference (`batch.differences`); with the ConfigMap unreadable or stale it
re-sends everything, as without the API server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import urllib3
from kubernetes.client.exceptions import ApiException

from agent.common.errors import Once
from agent.common.executor import CallTimeout, Lane
from agent.common.ratelimit import doubling
from agent.config import namespaced
from agent.kube.client import REQUEST_TIMEOUT_S, KubeUnavailable
from agent.kube.watch import Key, ListWatch
from agent.lifecycle import Tasks
from agent.model import MIN_TIME_MS
from agent.sinks.clusterd.pubfault import PublicFault

log = logging.getLogger(__name__)

_ID = re.compile(r"[a-zA-Z0-9\-_.]{8,128}")
_CODE = re.compile(r"[0-9]{9}")
MAX_SAVED_BYTES = 4 << 20  # a ConfigMap is at most 1 MiB; anything larger is not ClusterD's
READ_TIMEOUT_S = (3.0, 5.0)  # connect, read: the delivery loop waits for the answer

Incarnation = tuple[str, int]  # (pod uid, restarts of its containers): one ClusterD process


def incarnation(pod: Any) -> tuple[Incarnation, bool]:
    """The process a pod runs and whether it serves (the pod is Ready)."""
    containers = (pod.status.container_statuses or []) if pod.status else []
    conditions = (pod.status.conditions or []) if pod.status else []
    restarts = sum(int(c.restart_count or 0) for c in containers)
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    return (str(pod.metadata.uid or pod.metadata.name), restarts), ready


class Starts:
    """Pod updates in, "another ClusterD process serves now" out: one that was not serving before
    is ready (a restart, a new pod), or one that served is gone while another serves (a rollout
    that started the new one first: until now the old one was told what the new one never saw).
    Processes serving at the first list are not news."""

    def __init__(self):
        self._served: set[Incarnation] | None = None  # processes seen serving, while their pods are there

    def update(self, pods: dict[Key, tuple[Incarnation, bool]]) -> bool:
        present = {process for process, _ in pods.values()}
        serving = {process for process, ready in pods.values() if ready}
        before, self._served = self._served, ((self._served or set()) & present) | serving
        if before is None:
            return False
        # (a process that stops being ready and is ready again is the same one: no news)
        return bool(serving - before) or bool(serving and before - present)


@dataclass
class Saved:
    """This node's faults under one resource, as ClusterD saved them (faultId -> fault)."""

    faults: dict[str, PublicFault]
    skipped: int = 0  # entries of this node and resource too malformed to act on
    exists: bool = True  # False: there is no ConfigMap (ClusterD saved nothing, or it is named wrong)


def saved_faults(data: dict[str, str] | None, node: str, resource: str) -> Saved | str:
    """What ClusterD saved for `node` under `resource` (`data`: the ConfigMap's data, None when there
    is no ConfigMap), or why that cannot be known."""
    if data is None:
        return Saved({}, exists=False)
    try:
        count = json.loads(data["FaultNum"])["publicFaultNum"]
        faults = json.loads(data["PublicFaults"])
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        return f"not ClusterD's format ({type(exc).__name__}: {str(exc)[:120]})"
    if not isinstance(faults, dict) or not all(isinstance(items, list) for items in faults.values()) \
            or not isinstance(count, int) or isinstance(count, bool):
        return "not ClusterD's format (PublicFaults is not a map of lists, or publicFaultNum not a number)"
    listed = sum(len(items) for items in faults.values())
    if listed != count:
        return f"stale: ClusterD holds {count} public faults and lists {listed} (it stops listing them above 4,500)"
    mine, skipped = {}, 0
    for item in faults.get(node, []):
        if not isinstance(item, dict) or item.get("resource", "") != resource:
            continue
        fault = _fault(item)
        if fault is None:
            skipped += 1
        else:
            mine[fault.fault_id] = fault
    return Saved(mine, skipped)


def _fault(item: dict) -> PublicFault | None:
    """An entry as a fault this node can recover (a recover needs the key, a device and a time)."""
    fault_id, code, devices, at = item.get("faultId"), item.get("faultCode"), item.get("devIds"), item.get("faultTime")
    if not (isinstance(fault_id, str) and _ID.fullmatch(fault_id) and isinstance(code, str) and _CODE.fullmatch(code)
            and isinstance(devices, list) and devices and all(type(d) is int and 0 <= d <= 31 for d in devices)):
        return None
    valid_time = type(at) is int and len(str(at)) == 13 and at >= MIN_TIME_MS
    level = item.get("level")
    return PublicFault(fault_id, code, at if valid_time else MIN_TIME_MS, devices[0],
                       level if isinstance(level, str) else "", "")


class ClusterdObserver:
    """Watches ClusterD's pods and reads its saved faults; the ClusterD sink subscribes to its starts."""

    name = "clusterd-observer"

    def __init__(self, pods: str, saved: str, *, api_factory: Callable[[], Any], kube: Lane,
                 watch_timeout_s: int = 300):
        self._pods_namespace, self._selector = namespaced(pods)
        self._saved_namespace, self._saved_name = namespaced(saved)
        self._api_factory = api_factory
        self._api = None
        self._kube = kube
        self._watch_timeout_s = watch_timeout_s
        self._watch: ListWatch | None = None
        self._starts = Starts()
        self._listeners: list[Callable[[], None]] = []
        self._once = Once()
        self.tasks = Tasks(self.name)
        self.unavailable = ""
        self.counters: Counter[str] = Counter()  # starts seen, and reads by result

    @property
    def reads(self) -> bool:
        """Whether what ClusterD saved is read at all (`clusterd.saved_faults` is set)."""
        return bool(self._saved_name)

    def on_start(self, listener: Callable[[], None]) -> None:
        """`listener()` on the loop whenever a new ClusterD process serves."""
        self._listeners.append(listener)

    async def start(self) -> None:
        self.tasks.start("watch", self._run)

    async def _run(self) -> None:
        attempt = 0
        while self._api is None:  # (a busy node at start can take its time reading the configuration)
            try:
                self._api = await self._kube.run(self._api_factory, timeout=REQUEST_TIMEOUT_S, key="clusterd-api")
                self.unavailable = ""
            except (KubeUnavailable, CallTimeout) as exc:
                if not self.unavailable:
                    log.error("cannot reach Kubernetes; ClusterD restarts are not watched and its saved faults not "
                              "read until it can", extra={"error": str(exc)})
                self.unavailable = str(exc)
                attempt += 1
                await asyncio.sleep(random.uniform(0.5, doubling(attempt, 1.0, 30.0)))
        if self._selector:
            self._watch = ListWatch("clusterd-pods", self._api.list_namespaced_pod, incarnation, self._changed,
                                    asyncio.get_running_loop(), self._kube, timeout_s=self._watch_timeout_s,
                                    namespace=self._pods_namespace, label_selector=self._selector)
            await self._watch.run()

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        await self.tasks.stop(timeout=1.0)

    def readiness(self) -> tuple[bool, str]:
        if self.unavailable:
            return False, f"cannot reach Kubernetes for ClusterD's pods and saved faults: {self.unavailable}"
        if self._watch is not None and self._watch.forbidden:
            return False, (f"no grant to list and watch pods in {self._pods_namespace} (clusterd.pods): "
                           "ClusterD restarts go unnoticed")
        if self._watch is not None and self._watch.problem:
            return False, self._watch.problem
        return True, ""

    def _changed(self, pods: dict[Key, tuple[Incarnation, bool]]) -> None:
        if self._starts.update(pods):
            self.counters["starts"] += 1
            log.info("a new ClusterD process is serving", extra={"pods": sorted(f"{ns}/{name}" for ns, name in pods)})
            for listener in self._listeners:
                listener()

    async def saved(self, node: str, resource: str) -> Saved | str:
        """What ClusterD saved for this node under `resource`, or why that is not known."""
        if self._api is None or not self._saved_name:
            return "not read (no Kubernetes client yet, or clusterd.saved_faults is empty)"
        where = f"{self._saved_namespace}/{self._saved_name}"
        try:
            result = await self._kube.run(self._read, node, resource, timeout=sum(READ_TIMEOUT_S) + 2,
                                          key="clusterd-saved-faults")
        except ApiException as exc:
            result = f"{where} not readable (HTTP {exc.status} {exc.reason})"
        except (urllib3.exceptions.HTTPError, OSError, CallTimeout) as exc:
            result = f"{where} not readable ({type(exc).__name__})"
        except Exception as exc:  # a bug, or input nobody foresaw: this check is unknown, the sink goes on
            result = f"{where} not read ({type(exc).__name__}: {str(exc)[:120]})"
            if self._once(("bug", type(exc).__name__)):
                log.exception("reading ClusterD's saved faults failed unexpectedly", extra={"configmap": where})
        self.counters["read_ok" if isinstance(result, Saved) else "read_unknown"] += 1
        if isinstance(result, str) and self._once(result.partition("(")[0].partition(":")[0]):
            log.warning("ClusterD's saved faults are not known; re-sending every fault instead",
                        extra={"configmap": where, "reason": result})
        elif isinstance(result, Saved) and not result.exists and self._once("missing"):
            log.info("ClusterD's saved faults ConfigMap does not exist: ClusterD saved nothing (or "
                     "clusterd.saved_faults names another ConfigMap); re-sending every fault", extra={"configmap": where})
        elif isinstance(result, Saved) and result.skipped and self._once(("skipped", node)):
            log.warning("entries of this node in ClusterD's saved faults are malformed; skipped", extra={
                "configmap": where, "skipped": result.skipped})
        return result

    def _read(self, node: str, resource: str) -> Saved | str:
        """In the kube lane: the GET and the parse (up to a MiB of JSON) stay off the loop."""
        try:
            item = self._api.read_namespaced_config_map(self._saved_name, self._saved_namespace,
                                                        _request_timeout=READ_TIMEOUT_S, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return saved_faults(None, node, resource)
            raise
        body = item.read(MAX_SAVED_BYTES + 1)
        if len(body) > MAX_SAVED_BYTES:
            item.close()  # the rest unread: the connection cannot go back to the pool
            return f"larger than {MAX_SAVED_BYTES} bytes: not ClusterD's ConfigMap"
        item.release_conn()
        try:
            data = json.loads(body).get("data") or {}
        except (ValueError, AttributeError, RecursionError) as exc:
            return f"not a ConfigMap ({type(exc).__name__})"
        return saved_faults(data if isinstance(data, dict) else {}, node, resource)
