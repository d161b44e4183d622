"""What the fault stream says of the agent's view of its devices, from the device monitor's state."""

from __future__ import annotations

import io
from types import SimpleNamespace

from agent._proto import npu_agent_faults_pb2 as pb
from agent.faults.hub import FaultHub
from agent.model import DeviceInfo
from agent.sinks.stream.client import _say_view
from agent.sinks.stream.service import view_message

DEVICES = [DeviceInfo(n, n, n, 0, "910B3", "910B3-Ascend-V1") for n in range(8)]


def monitor(devices=(), error="", polled_once=False, read_errors=None):
    return SimpleNamespace(devices=list(devices), error=error, polled_once=polled_once, read_errors=read_errors or {})


def hub(current=True) -> FaultHub:
    made = FaultHub("node")
    made.current = current
    return made


def test_each_state_of_the_view():
    assert view_message(None, hub()) == pb.DeviceView()  # nothing to say: UNSPECIFIED
    assert view_message(monitor(error="dcmi backend unavailable: libdcmi.so: cannot open"), hub()) == pb.DeviceView(
        state=pb.DeviceView.NO_DEVICES, reason="no devices: dcmi backend unavailable: libdcmi.so: cannot open")
    assert view_message(monitor(), hub()).reason == "no devices: the driver lists none"
    for polled, current in ((False, True), (True, False)):  # read, but not yet in the fault log and the hub
        assert view_message(monitor(DEVICES, polled_once=polled), hub(current)).state == pb.DeviceView.NOT_READ_YET
    assert view_message(monitor(DEVICES, polled_once=True), hub()) == pb.DeviceView(state=pb.DeviceView.COMPLETE)


def test_unreadable_devices_are_named_with_their_reasons_grouped():
    errors = {0: "no answer from the driver", 1: "no answer from the driver", 5: "dcmi_get_device_health returned -1",
              6: "a", 7: "b"}
    view = view_message(monitor(DEVICES, polled_once=True, read_errors=errors), hub())
    assert view.state == pb.DeviceView.DEVICES_UNKNOWN and list(view.unknown_devices) == [0, 1, 5, 6, 7]
    assert view.reason == ("5 device(s) cannot be read, their last known faults are shown (NPU0,1: no answer from "
                           "the driver; NPU5: dcmi_get_device_health returned -1; NPU6: a; 1 other reason(s))")


def test_the_client_tells_a_view_once_and_its_end_and_takes_an_older_agent_at_its_word():
    err = io.StringIO()
    unknown = pb.DeviceView(state=pb.DeviceView.DEVICES_UNKNOWN, reason="1 device(s) cannot be read")
    assert _say_view(pb.DeviceView(), None, err) is False and err.getvalue() == ""  # an agent that does not say
    assert _say_view(unknown, None, err) is True
    assert _say_view(unknown, unknown, err) is True  # the same again: not repeated
    assert _say_view(pb.DeviceView(state=pb.DeviceView.COMPLETE), unknown, err) is False
    assert err.getvalue().splitlines() == [
        "npu-node-agent: the agent cannot see all of its devices; the list may be incomplete or out of date: "
        "1 device(s) cannot be read", "npu-node-agent: the agent sees all of its devices again"]


def test_the_view_is_additive_on_the_wire_both_ways():
    """An older client (the messages without `view`) reads a new agent's snapshot; a new client reads an
    older agent's snapshot and keepalive as saying nothing (UNSPECIFIED: taken at its word)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    before = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(before)
    for message in before.message_type:
        kept = [f for f in message.field if f.name != "view"]
        del message.field[:]
        message.field.extend(kept)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(before)
    old_snapshot = message_factory.GetMessageClass(pool.FindMessageTypeByName("npuagent.v1.FaultSnapshot"))
    old_keepalive = message_factory.GetMessageClass(pool.FindMessageTypeByName("npuagent.v1.Keepalive"))

    new = pb.FaultSnapshot(node="n", revision=3, devices=[pb.DeviceFaults(device=2, level="SeparateNPU")],
                           view=pb.DeviceView(state=pb.DeviceView.NO_DEVICES, reason="x"))
    seen_by_old = old_snapshot.FromString(new.SerializeToString())
    assert (seen_by_old.node, seen_by_old.revision, seen_by_old.devices[0].level) == ("n", 3, "SeparateNPU")
    from_old = pb.FaultSnapshot.FromString(old_snapshot(node="n", revision=3).SerializeToString())
    assert from_old.view.state == pb.DeviceView.UNSPECIFIED and not from_old.HasField("view")
    assert not pb.Keepalive.FromString(old_keepalive(revision=1, time_ms=2).SerializeToString()).HasField("view")
    assert _say_view(from_old.view, None, io.StringIO()) is False
