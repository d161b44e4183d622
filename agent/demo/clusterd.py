"""A small ClusterD for `npu-node-agent demo`: accepts /PubFault/SendPublicFault, checks each request
with ClusterD's rules (the same ones the agent applies before sending) and reports what arrived.

It is part of the demo only; the tests use a fuller stand-in with ClusterD's rate limits and
occur/recover semantics (testkit/fakes/clusterd).
"""

from __future__ import annotations

from typing import Callable

import grpc

from agent._proto import pubfault_pb2 as pb
from agent._proto import pubfault_pb2_grpc as pb_grpc
from agent.sinks.clusterd.pubfault import fault_problems, request_problems


class DemoClusterd(pb_grpc.PubFaultServicer):
    def __init__(self, known_codes: set[str], report: Callable[[str], None]):
        self._known = frozenset(known_codes)
        self._report = report
        self._server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = grpc.aio.server()
        pb_grpc.add_PubFaultServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=0.5)

    async def SendPublicFault(self, request: pb.PublicFaultRequest, context) -> pb.RespStatus:
        problems = request_problems(request)
        if problems:
            self._report(f"ClusterD rejected a request: {'; '.join(problems)}")
            return pb.RespStatus(code=409, info="; ".join(problems))
        for fault in request.faults:
            dropped = fault_problems(fault, self._known)
            devices = ",".join(str(d) for info in fault.influence for d in info.deviceIds)
            where = fault.faultLocation
            verdict = f"DROPPED ({'; '.join(dropped)})" if dropped else where.get("level", "")
            if "pod" in where and not dropped:
                verdict += f" pod {where['namespace']}/{where['pod']}"
            self._report(f"ClusterD <- {fault.assertion:<7} {fault.faultCode} NPU{devices} {verdict}")
        return pb.RespStatus(code=0, info="public fault send successfully")
