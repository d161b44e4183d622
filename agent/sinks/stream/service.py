"""The agent's own gRPC fault stream (npuagent.v1.NodeFaults): snapshot, then changes, resumable; with
what the agent sees of its devices (the view), so a client can tell "no faults" from "cannot look"."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Mapping, Protocol, Sequence

import grpc

from agent._proto import npu_agent_faults_pb2 as pb
from agent._proto import npu_agent_faults_pb2_grpc as pb_grpc
from agent.model import Change, DeviceInfo, DeviceState, PodsOf, Snapshot, no_pods
from agent.faults.hub import FaultHub

log = logging.getLogger(__name__)

DEFAULT_KEEPALIVE_S = 15.0
VIEW_CHECK_S = 1.0  # while the view is not complete, how often a subscriber's stream looks at it again
SERVICE_NAME = "npuagent.v1.NodeFaults"
MAX_REASONS = 3  # distinct read failures the view's reason spells out (every device is in unknown_devices)


class DeviceSource(Protocol):
    """What the stream reads of the device monitor (agent.devices.monitor.DeviceMonitor)."""

    devices: Sequence[DeviceInfo]  # as the driver listed them; empty until it did
    error: str  # why there are none
    polled_once: bool
    read_errors: Mapping[int, str]  # phy id -> why its last read failed


def view_message(source: DeviceSource | None, hub: FaultHub) -> pb.DeviceView:
    """Whether the hub's states are the devices' now, and if not why (an UNSPECIFIED view without a source)."""
    if source is None:
        return pb.DeviceView()
    if not source.devices:
        return pb.DeviceView(state=pb.DeviceView.NO_DEVICES, reason=f"no devices: {source.error or 'the driver lists none'}")
    if not (source.polled_once and hub.current):
        return pb.DeviceView(state=pb.DeviceView.NOT_READ_YET, reason=(
            "not every device was read since the agent started; the states shown may be from before"))
    failed = dict(source.read_errors)
    if failed:
        why: dict[str, list[int]] = {}
        for phy in sorted(failed):
            why.setdefault(failed[phy], []).append(phy)
        said = "; ".join(f"NPU{','.join(map(str, phys))}: {reason}" for reason, phys in list(why.items())[:MAX_REASONS])
        more = f"; {len(why) - MAX_REASONS} other reason(s)" if len(why) > MAX_REASONS else ""
        return pb.DeviceView(state=pb.DeviceView.DEVICES_UNKNOWN, unknown_devices=sorted(failed), reason=(
            f"{len(failed)} device(s) cannot be read, their last known faults are shown ({said}{more})"))
    return pb.DeviceView(state=pb.DeviceView.COMPLETE)


def device_message(state: DeviceState, revision: int, pods: PodsOf = no_pods) -> pb.DeviceFaults:
    return pb.DeviceFaults(
        pods=[pb.Pod(namespace=p.namespace, name=p.pod, container=p.container) for p in pods(state.phy_id)],
        revision=revision, device=state.phy_id, logic_id=state.logic_id, level=state.level.name, since_ms=state.since_ms,
        health=int(state.health),
        codes=[pb.ActiveCode(code=c.text, level=c.level.name, since_ms=c.since_ms,
                             severity=-1 if c.severity is None else c.severity, escalated_by=c.escalated_by)
               for c in state.codes])


class NodeFaultsServicer(pb_grpc.NodeFaultsServicer):
    def __init__(self, hub: FaultHub, pods: PodsOf, devices: DeviceSource | None = None):
        self._hub = hub
        self._pods = pods
        self._devices = devices

    def _snapshot_message(self, snapshot: Snapshot, view: pb.DeviceView) -> pb.FaultSnapshot:
        return pb.FaultSnapshot(node=self._hub.node, epoch=self._hub.epoch, revision=snapshot.revision, view=view,
                                devices=[device_message(c.state, c.revision, self._pods) for c in snapshot.devices])

    async def GetFaults(self, request, context):
        return self._snapshot_message(self._hub.snapshot(), view_message(self._devices, self._hub))

    async def Watch(self, request, context):
        keepalive = float(request.keepalive_seconds) or DEFAULT_KEEPALIVE_S
        subscription = self._hub.subscribe(request.epoch, request.since_revision)
        peer = context.peer()
        log.info("fault stream subscriber joined", extra={"peer": peer, "since_revision": request.since_revision})
        loop = asyncio.get_running_loop()
        told: pb.DeviceView | None = None  # the view this subscriber was last sent
        sent_at = loop.time()
        try:
            while True:
                view = view_message(self._devices, self._hub)
                if view != told:
                    wait = 0.0  # what is pending goes first, then a keepalive with the new view
                else:
                    wait = max(0.0, sent_at + keepalive - loop.time())
                    if view.state not in (pb.DeviceView.COMPLETE, pb.DeviceView.UNSPECIFIED):
                        wait = min(wait, VIEW_CHECK_S)  # the monitor has no signal for "first poll done"
                item = await subscription.next(wait)
                if item is None:
                    view = view_message(self._devices, self._hub)
                    if view == told and loop.time() - sent_at < keepalive:
                        continue  # only a look at the view
                    message = pb.WatchResponse(keepalive=pb.Keepalive(
                        revision=self._hub.revision, time_ms=int(time.time() * 1000), view=view))
                    told = view
                elif isinstance(item, Snapshot):
                    view = view_message(self._devices, self._hub)
                    message = pb.WatchResponse(snapshot=self._snapshot_message(item, view))
                    told = view
                else:
                    message = pb.WatchResponse(change=self._change_message(item))
                await context.write(message)
                sent_at = loop.time()
                if isinstance(item, Change):
                    self._hub.counters["delivered"] += 1
        finally:
            subscription.close()
            log.info("fault stream subscriber left", extra={"peer": peer})

    def _change_message(self, change: Change) -> pb.DeviceChange:
        return pb.DeviceChange(node=self._hub.node, epoch=self._hub.epoch, revision=change.revision,
                               device=device_message(change.state, change.revision, self._pods))


def add_to_server(server: grpc.aio.Server, hub: FaultHub, pods: PodsOf = no_pods,
                  devices: DeviceSource | None = None) -> str:
    pb_grpc.add_NodeFaultsServicer_to_server(NodeFaultsServicer(hub, pods, devices), server)
    return SERVICE_NAME
