"""The agent's gRPC server: the fault stream, grpc.health.v1 and server reflection."""

from __future__ import annotations

import logging
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from agent.sinks.stream import service as stream
from agent.common.grpcutil import EXCLUSIVE, bind
from agent.faults.hub import FaultHub
from agent.model import PodsOf, no_pods

log = logging.getLogger(__name__)

REFLECTION = "grpc.reflection.v1alpha.ServerReflection"

# Let clients ping as often as every 10 s and keep idle streams open; close connections that stop answering.
SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_concurrent_streams", 128),
    *EXCLUSIVE,
]


class LazyReflection(grpc.GenericRpcHandler):
    """Server reflection, loaded when a client first asks for it (grpcurl, an operator): its modules
    would otherwise cost every agent memory for a tool most nodes never see."""

    def __init__(self, services: list[str]):
        self._services = services
        self._handler: grpc.GenericRpcHandler | None = None

    def service(self, details):
        if not details.method.startswith(f"/{REFLECTION}/"):
            return None
        if self._handler is None:
            from grpc_reflection.v1alpha import reflection, reflection_pb2 as pb

            servicer = reflection.aio.ReflectionServicer(self._services)
            self._handler = grpc.method_handlers_generic_handler(REFLECTION, {
                "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                    servicer.ServerReflectionInfo, request_deserializer=pb.ServerReflectionRequest.FromString,
                    response_serializer=pb.ServerReflectionResponse.SerializeToString)})
        return self._handler.service(details)


class GrpcServer:
    name = "grpc"

    def __init__(self, listen: str, hub: FaultHub, pods: PodsOf = no_pods,
                 credentials: Callable[[], grpc.ServerCredentials] | None = None,
                 devices: stream.DeviceSource | None = None):
        self._listen = listen
        self._credentials = credentials  # TLS (agent.tls keeps the certificate current); None: plaintext
        self._hub = hub
        self._pods = pods
        self._devices = devices  # the device monitor: what the stream says of the agent's view of its devices
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self.port = 0

    async def start(self) -> None:
        server = grpc.aio.server(options=SERVER_OPTIONS)
        service = stream.add_to_server(server, self._hub, self._pods, self._devices)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        server.add_generic_rpc_handlers((LazyReflection(
            [service, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, REFLECTION]),))
        self.port = bind(server, self._listen, "grpc.listen",
                         credentials=self._credentials() if self._credentials else None)
        await server.start()
        self._server = server
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("grpc server listening", extra={"address": self._listen.rsplit(":", 1)[0] + f":{self.port}",
                                                 "tls": self._credentials is not None})

    async def stop(self) -> None:
        if self._server is not None:
            await self._health.enter_graceful_shutdown()
            await self._server.stop(grace=2.0)

    def readiness(self) -> tuple[bool, str]:
        return (self._server is not None, "" if self._server is not None else "not listening")
