"""Another node's traffic to ClusterD, to keep its shared delete queue busy.

ClusterD has one delete queue for every sender, so other nodes' recovers decide
when ours is executed: they keep the queue from going idle, and the sub-second
phase at which it was last idle shifts every deletion behind them.  This sender
plays those nodes: at a steady rate, with a random sub-second jitter, it sends
``recover`` for faultIds never seen before, so each one queues a deletion with
deadline floor(now) + 5 and changes nothing in the cache.
"""

from __future__ import annotations

import random
import secrets
import threading
import time

import grpc

from agent._proto import pubfault_pb2 as pb
from agent._proto import pubfault_pb2_grpc as pb_grpc

_CALL_TIMEOUT_S = 0.5  # bounds stop(): the loop checks for it between calls


class OtherSender:
    """Recovers of fresh faultIds for ``node``, one request every ``interval_s`` (plus jitter).

    It uses its own resource's bucket (1 token/s, burst 100): the default of one
    request per second on average never runs it dry.  Counters: ``sent`` (code 0),
    ``rejected`` (any other code, e.g. 410), ``failed`` (RPC errors, e.g. while
    ClusterD is down).
    """

    def __init__(self, target: int | str, *, interval_s: float = 1.0, jitter_s: float = 0.5,
                 faults_per_request: int = 3, node: str = "other-node", resource: str = "CCAE",
                 code: str = "020011001", seed: int | None = None):
        if not 0 <= jitter_s <= interval_s:
            raise ValueError("jitter_s must be within [0, interval_s], so the average rate stays 1/interval_s")
        self.address = f"127.0.0.1:{target}" if isinstance(target, int) else target  # a local port, or host:port
        self.interval_s, self.jitter_s = interval_s, jitter_s
        self.faults_per_request = faults_per_request
        self.node, self.resource, self.code = node, resource, code
        self.sent = self.rejected = self.failed = 0
        self._rng = random.Random(seed)
        self._prefix = f"other-{secrets.token_hex(4)}"  # fresh ids per sender, so every key is absent
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "OtherSender":
        if self._thread is not None:
            raise RuntimeError("OtherSender already started")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="clusterd-other-sender", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(5 * _CALL_TIMEOUT_S)
        if self._thread.is_alive():
            raise RuntimeError("OtherSender did not stop")
        self._thread = None

    def __enter__(self) -> "OtherSender":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        channel = grpc.insecure_channel(self.address)
        stub = pb_grpc.PubFaultStub(channel)
        try:
            # Ticks every interval_s, each send somewhere in [tick, tick + jitter_s): the jitter
            # moves the phase without raising the average rate.
            tick = time.monotonic()
            while not self._stop.wait(max(0.0, tick + self._rng.uniform(0, self.jitter_s) - time.monotonic())):
                self._send(stub)
                # After a stall, resume from now instead of catching up in a burst.
                tick = max(tick + self.interval_s, time.monotonic())
        finally:
            channel.close()

    def _send(self, stub: pb_grpc.PubFaultStub) -> None:
        now_ms = int(time.time() * 1000)
        self._seq += 1
        faults = [pb.Fault(faultId=f"{self._prefix}-{self._seq:08d}-{i}", faultType="NPU", faultCode=self.code,
                           faultTime=now_ms, assertion="recover",
                           influence=[pb.PubFaultInfo(nodeName=self.node, deviceIds=[0])])
                  for i in range(self.faults_per_request)]
        request = pb.PublicFaultRequest(id=f"{self._prefix}-{self._seq:08d}", timestamp=now_ms, version="1.0",
                                        resource=self.resource, faults=faults)
        try:
            reply = stub.SendPublicFault(request, timeout=_CALL_TIMEOUT_S)
        except grpc.RpcError:
            self.failed += 1
            return
        if reply.code == 0:
            self.sent += 1
        else:
            self.rejected += 1
