"""The agent's own gRPC fault stream (npuagent.v1.NodeFaults): snapshot, then changes, resumable."""

from __future__ import annotations

import logging
import time

import grpc

from agent._proto import npu_agent_faults_pb2 as pb
from agent._proto import npu_agent_faults_pb2_grpc as pb_grpc
from agent.model import Change, DeviceState, PodsOf, Snapshot, no_pods
from agent.faults.hub import FaultHub

log = logging.getLogger(__name__)

DEFAULT_KEEPALIVE_S = 15.0
SERVICE_NAME = "npuagent.v1.NodeFaults"


def device_message(state: DeviceState, revision: int, pods: PodsOf = no_pods) -> pb.DeviceFaults:
    return pb.DeviceFaults(
        pods=[pb.Pod(namespace=p.namespace, name=p.pod, container=p.container) for p in pods(state.phy_id)],
        revision=revision, device=state.phy_id, logic_id=state.logic_id, level=state.level.name, since_ms=state.since_ms,
        health=int(state.health),
        codes=[pb.ActiveCode(code=c.text, level=c.level.name, since_ms=c.since_ms,
                             severity=-1 if c.severity is None else c.severity, escalated_by=c.escalated_by)
               for c in state.codes])


class NodeFaultsServicer(pb_grpc.NodeFaultsServicer):
    def __init__(self, hub: FaultHub, pods: PodsOf):
        self._hub = hub
        self._pods = pods

    def _snapshot_message(self, snapshot: Snapshot) -> pb.FaultSnapshot:
        return pb.FaultSnapshot(node=self._hub.node, epoch=self._hub.epoch, revision=snapshot.revision,
                                devices=[device_message(c.state, c.revision, self._pods) for c in snapshot.devices])

    async def GetFaults(self, request, context):
        return self._snapshot_message(self._hub.snapshot())

    async def Watch(self, request, context):
        keepalive = float(request.keepalive_seconds) or DEFAULT_KEEPALIVE_S
        subscription = self._hub.subscribe(request.epoch, request.since_revision)
        peer = context.peer()
        log.info("fault stream subscriber joined", extra={"peer": peer, "since_revision": request.since_revision})
        try:
            while True:
                item = await subscription.next(keepalive)
                if item is None:
                    message = pb.WatchResponse(keepalive=pb.Keepalive(
                        revision=self._hub.revision, time_ms=int(time.time() * 1000)))
                elif isinstance(item, Snapshot):
                    message = pb.WatchResponse(snapshot=self._snapshot_message(item))
                else:
                    message = pb.WatchResponse(change=self._change_message(item))
                await context.write(message)
                if isinstance(item, Change):
                    self._hub.counters["delivered"] += 1
        finally:
            subscription.close()
            log.info("fault stream subscriber left", extra={"peer": peer})

    def _change_message(self, change: Change) -> pb.DeviceChange:
        return pb.DeviceChange(node=self._hub.node, epoch=self._hub.epoch, revision=change.revision,
                               device=device_message(change.state, change.revision, self._pods))


def add_to_server(server: grpc.aio.Server, hub: FaultHub, pods: PodsOf = no_pods) -> str:
    pb_grpc.add_NodeFaultsServicer_to_server(NodeFaultsServicer(hub, pods), server)
    return SERVICE_NAME
