"""A kubelet for `npu-node-agent demo`: answers `v1.PodResourcesLister/List` on a unix socket, saying
that the simulated training job's two pods hold the node's NPUs, four each — so the demo's metrics,
fault stream and ClusterD requests name the pod a fault hits, as they would on a real node.

It is part of the demo only; the tests use a stand-in they can make slow, broken or absent
(testkit/fakes/kubelet).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import grpc

from agent._proto import podresources_pb2 as pb
from agent._proto import podresources_pb2_grpc as pb_grpc

NAMESPACE, CONTAINER, RESOURCE = "demo", "ascend", "huawei.com/Ascend910"
MAX_SOCKET_PATH = 100  # a unix socket path has to fit in sun_path (108 bytes)


def demo_pods(devices: int, per_pod: int = 4) -> dict[str, list[int]]:
    """Pod name -> the physical NPU ids it holds: demo-job-worker-0 holds 0-3, -1 holds 4-7, ..."""
    return {f"demo-job-worker-{start // per_pod}": list(range(start, min(start + per_pod, devices)))
            for start in range(0, devices, per_pod)}


class DemoKubelet(pb_grpc.PodResourcesListerServicer):
    def __init__(self, workdir: Path, devices: int):
        self.pods = demo_pods(devices)
        socket_path = workdir / "kubelet.sock"
        if len(str(socket_path.absolute())) > MAX_SOCKET_PATH:  # a deep work directory: a short one for the socket
            socket_path = Path(tempfile.mkdtemp(prefix="npu-demo-kubelet-")) / "kubelet.sock"
        self.socket_path = socket_path.absolute()
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        if self.socket_path.exists():
            os.unlink(self.socket_path)  # left by an earlier demo in the same work directory
        self._server = grpc.aio.server()
        pb_grpc.add_PodResourcesListerServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix:{self.socket_path}")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=0.5)

    async def List(self, request, context) -> pb.ListPodResourcesResponse:
        return pb.ListPodResourcesResponse(pod_resources=[
            pb.PodResources(name=name, namespace=NAMESPACE, containers=[pb.ContainerResources(
                name=CONTAINER,
                devices=[pb.ContainerDevices(resource_name=RESOURCE, device_ids=[f"Ascend910-{i}" for i in ids])])])
            for name, ids in self.pods.items()])

    async def GetAllocatableResources(self, request, context) -> pb.AllocatableResourcesResponse:
        return pb.AllocatableResourcesResponse(devices=[pb.ContainerDevices(
            resource_name=RESOURCE, device_ids=[f"Ascend910-{i}" for ids in self.pods.values() for i in ids])])
