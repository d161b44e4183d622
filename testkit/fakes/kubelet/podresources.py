"""A kubelet PodResources stand-in: `v1.PodResourcesLister` from the same proto, on a real unix socket.

Tests set which containers hold which devices, make the kubelet slow or broken, or take the socket away.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from agent._proto import podresources_pb2 as pb
from agent._proto import podresources_pb2_grpc as pb_grpc


class PodResourcesStandIn(pb_grpc.PodResourcesListerServicer):
    def __init__(self, socket_path: Path):
        self.socket_path = socket_path
        self._lock = threading.Lock()
        self._pods: list[tuple[str, str, str, str, list[str]]] = []
        self.delay_s = 0.0  # a slow kubelet
        self.failure: grpc.StatusCode | None = None  # a broken one
        self.calls = 0
        self._server: grpc.Server | None = None

    def set_pods(self, *pods: tuple[str, str, str, str, list[str]]) -> None:
        """Each (namespace, pod, container, resource name, device ids); replaces what was there."""
        with self._lock:
            self._pods = list(pods)

    def List(self, request, context):
        with self._lock:
            self.calls += 1
            pods = list(self._pods)
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.failure is not None:
            context.abort(self.failure, "stand-in kubelet failure")
        by_pod: dict[tuple[str, str], pb.PodResources] = {}
        for namespace, name, container, resource, ids in pods:
            pod = by_pod.setdefault((namespace, name), pb.PodResources(name=name, namespace=namespace))
            pod.containers.append(pb.ContainerResources(
                name=container, devices=[pb.ContainerDevices(resource_name=resource, device_ids=ids)]))
        return pb.ListPodResourcesResponse(pod_resources=list(by_pod.values()))

    def GetAllocatableResources(self, request, context):
        return pb.AllocatableResourcesResponse()

    def start(self) -> "PodResourcesStandIn":
        server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_PodResourcesListerServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        """The kubelet goes away: the socket file is removed."""
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        self.socket_path.unlink(missing_ok=True)

    def __enter__(self) -> "PodResourcesStandIn":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
