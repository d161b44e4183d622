"""`npu-node-agent faults` tells "no faults" from "cannot look": the fault stream says what the agent
sees of its devices (FaultSnapshot.view, Keepalive.view), and the command exits 3 and says why when
that is not all of them; `--follow` says so on stderr as it changes."""

from __future__ import annotations

import subprocess
import sys
import threading

import grpc

from agent._proto import npu_agent_faults_pb2 as pb
from agent._proto import npu_agent_faults_pb2_grpc as pb_grpc
from testkit import REPO
from testkit.wait import wait_until

INCOMPLETE = "npu-node-agent: the agent cannot see all of its devices; the list may be incomplete or out of date: "


def faults(agent, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", "faults", "--target", f"127.0.0.1:{agent.grpc_port}", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def get_faults(agent) -> pb.FaultSnapshot:
    with grpc.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as channel:
        return pb_grpc.NodeFaultsStub(channel).GetFaults(pb.GetFaultsRequest(), timeout=10)


class Follower:
    """`faults --follow --json`, its stderr lines collected as they come."""

    def __init__(self, agent):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agent", "faults", "--follow", "--json", "--target", f"127.0.0.1:{agent.grpc_port}"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.said: list[str] = []
        threading.Thread(target=lambda: self.said.extend(iter(self.process.stderr.readline, "")), daemon=True).start()

    def wait_for(self, text: str, timeout: float = 15) -> str:
        return wait_until(lambda: next((line for line in list(self.said) if text in line), None), timeout,
                          lambda: f"{text!r} from faults --follow; it said {self.said}")

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(10)


def test_without_the_driver_faults_exits_3_and_says_why(start_agent, tmp_path):
    agent, _ = start_agent(library=str(tmp_path / "nowhere" / "libdcmi.so"), wait_ready=False)
    agent.wait_for_log("devices unavailable; retrying")  # the monitor's first attempt to open the library

    text = faults(agent)
    assert text.returncode == 3, text.stderr
    assert "0 of 0 devices with faults" in text.stdout  # what it has, as before ...
    [line] = text.stderr.splitlines()  # ... and why that is not "healthy", in one line
    assert line.startswith(INCOMPLETE + "no devices: dcmi backend unavailable: ") and "nowhere" in line, line
    listed = faults(agent, "--json")
    assert (listed.returncode, listed.stdout) == (3, "")
    view = get_faults(agent).view
    assert view.state == pb.DeviceView.NO_DEVICES and "libdcmi.so" in view.reason

    follower = Follower(agent)
    try:
        assert follower.wait_for(INCOMPLETE).endswith(view.reason + "\n")
    finally:
        follower.stop()


def test_unreadable_devices_are_said_by_faults_and_follow_and_so_is_their_return(start_agent):
    agent, fake = start_agent(devices={"poll_interval_seconds": 1})
    clean = faults(agent)
    assert clean.returncode == 0 and clean.stderr == "", clean.stderr
    assert get_faults(agent).view.state == pb.DeviceView.COMPLETE
    follower = Follower(agent)
    try:
        fake.hang("dcmi_get_device_health", 60)  # every device's read now times out: health unknown
        said = follower.wait_for("8 device(s) cannot be read, their last known faults are shown")  # maybe after 1..7
        assert said.startswith(INCOMPLETE) and "NPU" in said and "no answer from the driver" in said, said
        text = faults(agent)
        assert text.returncode == 3 and "cannot be read" in text.stderr, text.stderr
        view = get_faults(agent).view
        assert view.state == pb.DeviceView.DEVICES_UNKNOWN and len(view.unknown_devices) == 8

        fake.hang("dcmi_get_device_health", 0)
        follower.wait_for("npu-node-agent: the agent sees all of its devices again")
        wait_until(lambda: faults(agent).returncode == 0, 10, "faults exit 0 again")
        said = [line for line in follower.said if INCOMPLETE in line]
        assert all(a != b for a, b in zip(said, said[1:])), said  # each view said once, not at every poll
    finally:
        assert follower.stop() in (0, -15)
