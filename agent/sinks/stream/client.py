"""`npu-node-agent faults`: read the active faults of a running agent from its fault stream."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import grpc

from agent._proto import npu_agent_faults_pb2 as pb
from agent._proto import npu_agent_faults_pb2_grpc as pb_grpc

RETRY_MAX_S = 10.0


def device_json(node: str, device: pb.DeviceFaults) -> dict:
    return {"node": node, "device": device.device, "logic_id": device.logic_id,
            "codes": [c.code for c in device.codes], "level": device.level, "since_ms": device.since_ms,
            "revision": device.revision, "health": device.health,
            "escalated": {c.code: c.escalated_by for c in device.codes if c.escalated_by},
            "pods": [{"namespace": p.namespace, "pod": p.name, "container": p.container} for p in device.pods]}


def device_line(device: pb.DeviceFaults) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(device.since_ms / 1000)) if device.since_ms else "-"
    codes = ", ".join(f"{c.code} {c.level}" + (f" ({c.escalated_by})" if c.escalated_by else "") for c in device.codes)
    health = {1: "healthy", 0: "unhealthy", -1: "unknown"}.get(device.health, str(device.health))
    pods = "; ".join(f"{p.namespace}/{p.name}" for p in device.pods)
    return (f"{device.device:>6} {device.logic_id:>5}  {device.level:<20} {health:<9} {since:<19}  {codes or '-'}"
            + (f"  [pod {pods}]" if pods else ""))


HEADER = f"{'DEVICE':>6} {'LOGIC':>5}  {'LEVEL':<20} {'HEALTH':<9} {'SINCE':<19}  CODES"


def _faulty(device: pb.DeviceFaults) -> bool:
    return bool(device.codes) or device.level != "NormalNPU"


def channel_credentials(ca_file: str = "", cert_file: str = "", key_file: str = "") -> grpc.ChannelCredentials | None:
    """TLS to an agent with tls.cert_file set (`ca_file`: the CAs its certificate comes from), with this
    client's certificate when the agent asks for one (tls.client_ca_file); None: plaintext."""
    if not (ca_file or cert_file):
        return None
    read = {path: Path(path).read_bytes() for path in (ca_file, cert_file, key_file) if path}
    return grpc.ssl_channel_credentials(read.get(ca_file), read.get(key_file), read.get(cert_file))


def print_faults(target: str, follow: bool, as_json: bool, timeout: float, out=sys.stdout,
                 credentials: grpc.ChannelCredentials | None = None) -> int:
    epoch, revision, delay = "", 0, 0.5
    with grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target) as channel:
        stub = pb_grpc.NodeFaultsStub(channel)
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            print(f"npu-node-agent: cannot reach the agent's fault stream at {target} within {timeout:g}s",
                  file=sys.stderr)
            return 1
        while True:
            try:
                for message in stub.Watch(pb.WatchRequest(epoch=epoch, since_revision=revision)):
                    kind = message.WhichOneof("kind")
                    if kind == "snapshot":
                        snapshot = message.snapshot
                        epoch, revision = snapshot.epoch, snapshot.revision
                        _print_snapshot(snapshot, as_json, out)
                        if not follow:
                            return 0
                    elif kind == "change":
                        change = message.change
                        revision = change.revision
                        if as_json:
                            out.write(json.dumps(device_json(change.node, change.device)) + "\n")
                        else:
                            out.write(device_line(change.device) + "\n")
                        out.flush()
                    delay = 0.5
            except grpc.RpcError as exc:
                if not follow or exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    print(f"npu-node-agent: fault stream at {target} failed: {exc.code().name}: {exc.details()}",
                          file=sys.stderr)
                    return 1
                print(f"npu-node-agent: fault stream interrupted ({exc.code().name}); resuming", file=sys.stderr)
                time.sleep(delay)  # back off before reconnecting
                delay = min(RETRY_MAX_S, delay * 2)


def _print_snapshot(snapshot: pb.FaultSnapshot, as_json: bool, out) -> None:
    faulty = [d for d in snapshot.devices if _faulty(d)]
    if as_json:
        for device in faulty:
            out.write(json.dumps(device_json(snapshot.node, device)) + "\n")
    else:
        out.write(f"node {snapshot.node}: {len(faulty)} of {len(snapshot.devices)} devices with faults "
                  f"(revision {snapshot.revision})\n")
        if faulty:
            out.write(HEADER + "\n")
            for device in faulty:
                out.write(device_line(device) + "\n")
    out.flush()
