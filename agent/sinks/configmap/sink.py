"""The device-info ConfigMap sink: writes `kube-system/mindx-dl-deviceinfo-<node>` like the device plugin.

Written when its content changes and at least every 5 minutes (a heartbeat ClusterD and operators
can rely on), never more than once a second; update first, create when it does not exist. The
Kubernetes client is blocking, so calls run in the executor's kube lane with a time-out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Callable

import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

from agent.common.executor import CallTimeout, Lane
from agent.sinks.configmap.deviceinfo import LABELS, NAME_PREFIX, NAMESPACE, content_key, device_info_data
from agent.faults.hub import FaultHub
from agent.model import Change
from agent.kube.client import REQUEST_TIMEOUT_S, KubeUnavailable, core_api
from agent.lifecycle import Tasks

log = logging.getLogger(__name__)

HEARTBEAT_S = 300.0
MIN_INTERVAL_S = 1.0
RETRY_S = (1.0, 2.0, 5.0, 10.0)


class DeviceInfoConfigMapSink:
    """An agent.model.Sink."""

    name = "configmap"

    def __init__(self, node: str, hub: FaultHub, chip_name: Callable[[], str], *, kube: Lane,
                 api_factory: Callable[[], client.CoreV1Api] = core_api, clock: Callable[[], float] = time.time):
        self._node = node
        self._hub = hub
        self._chip_name = chip_name
        self._api_factory = api_factory
        self._clock = clock
        self._api: client.CoreV1Api | None = None
        self._wakeup = asyncio.Event()
        self.tasks = Tasks("configmap-sink")
        self._kube = kube
        self._written_key = ""
        self._written_at = 0.0
        self.error = ""
        self.counters: Counter[str] = Counter()
        self.last_success = 0.0
        self.pending = 0  # this sink writes the latest state; it has no backlog
        self.writes = ()  # it keeps nothing on disk (agent.model.Sink)

    @property
    def configmap_name(self) -> str:
        return NAME_PREFIX + self._node

    async def start(self) -> None:
        self.tasks.start("writer", self._run)

    async def stop(self) -> None:
        await self.tasks.stop(timeout=1.0)

    def readiness(self) -> tuple[bool, str]:
        return (not self.error, self.error)

    def notify(self, changes: list[Change]) -> None:
        self._wakeup.set()

    async def _run(self) -> None:
        failures = 0
        while True:
            # Cleared before the state is read, not after the write: a change that arrives while
            # the write is in flight must wake the next round, not wait for the heartbeat.
            self._wakeup.clear()
            wait = await self._write_if_due()
            if wait is None:  # the write failed
                failures += 1
                wait = RETRY_S[min(failures, len(RETRY_S)) - 1]
            else:
                failures = 0
            try:
                await asyncio.wait_for(self._wakeup.wait(), wait)
            except TimeoutError:
                pass

    async def _write_if_due(self) -> float | None:
        """Write when due; returns the seconds until the next heartbeat, or None after a failure."""
        states = [change.state for change in self._hub.snapshot().devices]
        if not states:
            return HEARTBEAT_S  # nothing known yet: writing "no devices" would be a lie
        now = self._clock()
        data = device_info_data(states, self._chip_name(), int(now))
        key = content_key(data)
        since = now - self._written_at
        if key == self._written_key and since < HEARTBEAT_S:
            return HEARTBEAT_S - since
        if since < MIN_INTERVAL_S:
            await asyncio.sleep(MIN_INTERVAL_S - since)
            return 0.0
        try:
            # The client's own time-out is per request; the write may make two (replace, then create).
            await self._kube.run(self._write, data, timeout=2 * REQUEST_TIMEOUT_S + 5, key=self.name)
        except (ApiException, KubeUnavailable, urllib3.exceptions.HTTPError, OSError, ValueError, CallTimeout) as exc:
            self.counters["error"] += 1
            reason = f"{getattr(exc, 'status', '')} {getattr(exc, 'reason', '') or exc}".strip()
            if reason != self.error:
                log.error("cannot write the device-info ConfigMap; retrying", extra={
                    "configmap": f"{NAMESPACE}/{self.configmap_name}", "reason": reason})
            self.error = f"cannot write {NAMESPACE}/{self.configmap_name}: {reason}"
            return None
        if self.error:
            log.info("device-info ConfigMap written again", extra={"configmap": f"{NAMESPACE}/{self.configmap_name}"})
        self.error = ""
        self._written_key, self._written_at = key, self._clock()
        self.counters["written"] += 1
        self.last_success = self._written_at
        return HEARTBEAT_S

    def _write(self, data: dict[str, str]) -> None:
        if self._api is None:
            self._api = self._api_factory()
        body = client.V1ConfigMap(metadata=client.V1ObjectMeta(name=self.configmap_name, namespace=NAMESPACE,
                                                               labels=dict(LABELS)), data=data)
        try:
            self._api.replace_namespaced_config_map(self.configmap_name, NAMESPACE, body,
                                                    _request_timeout=REQUEST_TIMEOUT_S)
        except ApiException as exc:
            if exc.status != 404:
                raise
            self._api.create_namespaced_config_map(NAMESPACE, body, _request_timeout=REQUEST_TIMEOUT_S)
