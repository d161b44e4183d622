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
EXIT_OK, EXIT_FAILED, EXIT_INCOMPLETE = 0, 1, 3  # 2 is bad usage (agent.cli)


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
                 credentials: grpc.ChannelCredentials | None = None, err=sys.stderr) -> int:
    """Print the agent's faults (and with `follow` every change until interrupted); the exit code:
    EXIT_OK, EXIT_FAILED (cannot reach or read the stream) or EXIT_INCOMPLETE (the agent said it
    cannot see all of its devices: the list may be incomplete or out of date)."""
    epoch, revision, delay = "", 0, 0.5
    deadline = time.monotonic() + timeout
    with grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target) as channel:
        stub = pb_grpc.NodeFaultsStub(channel)
        snapshot, problem = _first_answer(channel, stub, target, timeout)
        if problem:
            print(f"npu-node-agent: {problem}", file=err)
            return EXIT_FAILED
        if not follow:
            if snapshot.view.state == pb.DeviceView.NOT_READ_YET:
                snapshot = _once_read(stub, snapshot, deadline)
            _print_snapshot(snapshot, as_json, out)
            return EXIT_INCOMPLETE if _say_view(snapshot.view, None, err) else EXIT_OK
        view = None  # the last view said
        while True:
            try:
                for message in stub.Watch(pb.WatchRequest(epoch=epoch, since_revision=revision)):
                    kind = message.WhichOneof("kind")
                    if kind == "snapshot":
                        snapshot = message.snapshot
                        epoch, revision = snapshot.epoch, snapshot.revision
                        _print_snapshot(snapshot, as_json, out)
                        _say_view(snapshot.view, view, err)
                        view = snapshot.view
                    elif kind == "change":
                        change = message.change
                        revision = change.revision
                        if as_json:
                            out.write(json.dumps(device_json(change.node, change.device)) + "\n")
                        else:
                            out.write(device_line(change.device) + "\n")
                        out.flush()
                    elif kind == "keepalive" and message.keepalive.HasField("view"):
                        _say_view(message.keepalive.view, view, err)
                        view = message.keepalive.view
                    delay = 0.5
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    print(f"npu-node-agent: fault stream at {target} failed: {exc.code().name}: {_brief(exc.details())}",
                          file=err)
                    return EXIT_FAILED
                print(f"npu-node-agent: fault stream interrupted ({exc.code().name}); resuming", file=err)
                time.sleep(delay)  # back off before reconnecting
                delay = min(RETRY_MAX_S, delay * 2)


def _first_answer(channel: grpc.Channel, stub: pb_grpc.NodeFaultsStub, target: str,
                  timeout: float) -> tuple[pb.FaultSnapshot | None, str]:
    """The agent's snapshot, or why there is none (one line). A name that does not resolve fails at once;
    an agent that refuses connections is waited for until `timeout` (it may be starting)."""
    deadline = time.monotonic() + timeout
    try:
        return stub.GetFaults(pb.GetFaultsRequest(), timeout=timeout), ""  # fails fast: no wait_for_ready
    except grpc.RpcError as exc:
        code, details = exc.code(), _brief(exc.details())
    if code == grpc.StatusCode.UNAVAILABLE and "resolv" in details.lower():  # gRPC: "errors resolving <target>"
        return None, f"cannot resolve the host of {target}: {details}"
    if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return None, f"fault stream at {target} failed: {code.name}: {details}"
    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout=max(0.0, deadline - time.monotonic()))
        return stub.GetFaults(pb.GetFaultsRequest(), timeout=max(1.0, deadline - time.monotonic())), ""
    except grpc.FutureTimeoutError:
        ready.cancel()
    except grpc.RpcError as exc:
        details = _brief(exc.details())
    return None, f"cannot reach the agent's fault stream at {target} within {timeout:g}s ({details})"


def _once_read(stub: pb_grpc.NodeFaultsStub, snapshot: pb.FaultSnapshot, deadline: float) -> pb.FaultSnapshot:
    """An agent that has just started and not read every device yet: its snapshot once it has (the
    stream tells at once), or `snapshot` when that takes until `deadline`."""
    try:
        for message in stub.Watch(pb.WatchRequest(keepalive_seconds=1), timeout=max(0.1, deadline - time.monotonic())):
            kind = message.WhichOneof("kind")
            view = message.snapshot.view if kind == "snapshot" else message.keepalive.view if kind == "keepalive" else None
            if view is not None and view.state != pb.DeviceView.NOT_READ_YET:
                return stub.GetFaults(pb.GetFaultsRequest(), timeout=max(1.0, deadline - time.monotonic()))
    except grpc.RpcError:
        pass  # the deadline, or the agent went away: what it said first stands
    return snapshot


def _brief(details: str | None) -> str:
    text = " ".join((details or "").split())
    return text if len(text) <= 240 else text[:237] + "..."


def _say_view(view: pb.DeviceView, before: pb.DeviceView | None, err) -> bool:
    """Tell (on `err`) when the agent cannot see all of its devices, or sees them again after it could
    not; whether it cannot. An agent that does not say (older than the view) is taken at its word."""
    incomplete = view.state not in (pb.DeviceView.COMPLETE, pb.DeviceView.UNSPECIFIED)
    if incomplete and view != before:
        print(f"npu-node-agent: the agent cannot see all of its devices; the list may be incomplete or out of date: "
              f"{view.reason}", file=err, flush=True)
    elif not incomplete and before is not None and before.state not in (pb.DeviceView.COMPLETE, pb.DeviceView.UNSPECIFIED):
        print("npu-node-agent: the agent sees all of its devices again", file=err, flush=True)
    return incomplete


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
