"""What the environment adds to the configuration, seen through the real agent."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from testkit.agent import AgentProcess
from testkit.fakes.clusterd import ClusterdStandIn
from testkit.wait import wait_until
from tests.integration.conftest import phy


def test_an_ipv6_mindx_server_ip_reaches_clusterd_over_ipv6(start_agent):
    with ClusterdStandIn(host="::1") as clusterd:
        # The configured host is replaced by MINDX_SERVER_IP (bare, as MindX sets it); the port stays.
        agent, fake = start_agent(devices={"poll_interval_seconds": 1}, env={"MINDX_SERVER_IP": "::1"},
                                  clusterd={"enabled": True, "address": f"clusterd.invalid:{clusterd.port}"})
        fake.occur(2, 0x80E18402, severity=3)
        clusterd.wait_for(lambda s: any(f.influence[0].deviceIds == [phy(2)] and f.faultCode == "020011001"
                                        for r in s.requests if r.code == 0 for f in r.request.faults), timeout=10)
        wait_until(lambda: agent.metric("npu_agent_fault_reports_total", sink="clusterd", result="sent") == 1, 10,
                   "the send counted")


def test_mindx_server_ip_is_not_looked_at_with_clusterd_off(start_agent):
    agent, _ = start_agent(env={"MINDX_SERVER_IP": "fd00::5"})  # once refused: "clusterd.address is not HOST:PORT"
    assert agent.http("/readyz")[0] == 200


def test_the_listen_host_comes_from_the_environment_and_no_other_address_answers(tmp_path):
    """As the chart binds the pod's IP under hostNetwork (`${POD_IP}` from the downward API): here
    127.0.0.2, so 127.0.0.1 (another address of the same host) must not answer."""
    agent = AgentProcess(tmp_path, {"devices": {"backend": "simulated", "simulated": {"devices": 1}},
                                    "http": {"listen": "${POD_IP}:0"}, "grpc": {"listen": "${POD_IP}:0"}},
                         env={"POD_IP": "127.0.0.2"}).start()
    try:
        assert agent.wait_for_log("http endpoint listening")["address"] == f"127.0.0.2:{agent.http_port}"
        assert agent.wait_for_log("grpc server listening")["address"] == f"127.0.0.2:{agent.grpc_port}"
        with urllib.request.urlopen(f"http://127.0.0.2:{agent.http_port}/healthz", timeout=10) as response:
            assert response.status == 200
        for port in (agent.http_port, agent.grpc_port):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=10).close()
    finally:
        agent.stop()
