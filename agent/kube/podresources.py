"""Which pod holds which NPU: the kubelet's PodResources API (`v1.PodResourcesLister/List`) over its
unix socket, refreshed on an interval and soon after a fault changes.

The view is all or nothing: when the kubelet cannot be asked (socket absent, permission denied, a
slow or broken kubelet) the attribution is emptied — a stale pod label is worse than none — and one
log line says why; devices and faults are not affected.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections import Counter

import grpc

from agent._proto import podresources_pb2 as pb
from agent._proto import podresources_pb2_grpc as pb_grpc
from agent.lifecycle import Tasks
from agent.model import PodRef

log = logging.getLogger(__name__)

RESOURCE_PREFIX = "huawei.com/"  # Ascend910, Ascend310P, npu, and their virtual variants
# Ascend910-3, Ascend310P-1, npu-0, a bare 3, or a virtual NPU whose name ends in its physical id.
DEVICE_ID = re.compile(r"(?:(?:Ascend[0-9A-Za-z]*|npu)-(?:[0-9A-Za-z]+-)*)?([0-9]{1,5})")


def phy_id_of(resource: str, device_id: str) -> int | None:
    """The physical NPU id a device plugin id names; None for other resources or unknown forms."""
    if not resource.startswith(RESOURCE_PREFIX):
        return None
    match = DEVICE_ID.fullmatch(device_id)
    return int(match.group(1)) if match else None


def attribute(response: pb.ListPodResourcesResponse) -> tuple[dict[int, tuple[PodRef, ...]], list[str]]:
    """{physical id: the containers holding it} and the Ascend device ids of a form not understood."""
    holders: dict[int, list[PodRef]] = {}
    unknown: list[str] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            ref = PodRef(pod.namespace, pod.name, container.name)
            for devices in container.devices:
                for device_id in devices.device_ids:
                    phy = phy_id_of(devices.resource_name, device_id)
                    if phy is not None:
                        if ref not in holders.setdefault(phy, []):
                            holders[phy].append(ref)
                    elif devices.resource_name.startswith(RESOURCE_PREFIX):
                        unknown.append(f"{devices.resource_name}={device_id}")
    return {phy: tuple(refs) for phy, refs in holders.items()}, unknown


class PodAttribution:
    name = "pod_resources"

    def __init__(self, socket_path: str, refresh_s: float = 10.0, call_timeout_s: float = 2.0):
        self._socket = socket_path
        self._refresh_s = refresh_s
        self._timeout_s = call_timeout_s
        self.by_device: dict[int, tuple[PodRef, ...]] = {}
        self.refreshes: Counter[str] = Counter()  # ok, absent, error
        self.problem = ""  # why attribution is empty, "" when the kubelet answered
        self._wake: asyncio.Event | None = None
        self.tasks = Tasks("pod-attribution")
        self._channel: grpc.aio.Channel | None = None
        self._logged_unknown: set[str] = set()

    def pods_of(self, phy_id: int) -> tuple[PodRef, ...]:
        return self.by_device.get(phy_id, ())

    def refresh_soon(self, *_changes) -> None:
        """Fault listener: look again now, so a fault's change names the pod holding the NPU now."""
        if self._wake is not None:
            self._wake.set()

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._channel = grpc.aio.insecure_channel(f"unix://{self._socket}")
        await self.refresh()
        self.tasks.start("refresh", self._run)

    async def stop(self) -> None:
        await self.tasks.stop()
        if self._channel is not None:
            await self._channel.close()

    def readiness(self) -> tuple[bool, str]:
        return True, ""  # attribution is best effort; it never holds the agent back

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._refresh_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            await self.refresh()

    async def refresh(self) -> None:
        if not os.path.exists(self._socket):
            self._fail("absent", f"no kubelet PodResources socket at {self._socket} (not enabled on this kubelet, "
                                 "or not mounted into the agent)")
            return
        try:
            response = await pb_grpc.PodResourcesListerStub(self._channel).List(
                pb.ListPodResourcesRequest(), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._fail("error", f"kubelet PodResources List failed: {exc.code().name}: {exc.details()}")
            return
        self.by_device, unknown = attribute(response)
        self.refreshes["ok"] += 1
        if self.problem:
            log.info("pod attribution restored", extra={"socket": self._socket, "devices": len(self.by_device)})
            self.problem = ""
        for text in unknown:
            if text not in self._logged_unknown and len(self._logged_unknown) < 256:
                self._logged_unknown.add(text)
                log.warning("device id of an unknown form; not attributed", extra={"device": text})

    def _fail(self, result: str, problem: str) -> None:
        self.refreshes[result] += 1
        self.by_device = {}
        if problem != self.problem:
            log.warning("pod attribution off", extra={"reason": problem})
            self.problem = problem
