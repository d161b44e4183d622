"""TLS on `/metrics` and the gRPC fault stream: real handshakes against the agent in a subprocess,
its certificate rotated on disk as the kubelet updates a mounted Secret, and gRPC clients' certificates
checked (mTLS)."""

from __future__ import annotations

import http.client
import socket
import ssl
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from testkit import REPO
from testkit.agent import AgentProcess
from testkit.certs import Authority, SecretVolume, serial_of
from testkit.wait import wait_until


def https(port: int, path: str, ca: bytes) -> tuple[int, str, int]:
    """(status, body, serial of the certificate the agent presented) of one HTTPS GET."""
    context = ssl.create_default_context(cadata=ca.decode())
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        connection.request("GET", path)
        serial = serial_of(connection.sock.getpeercert(binary_form=True))
        response = connection.getresponse()
        return response.status, response.read().decode(), serial
    finally:
        connection.close()


def grpc_check(port: int, ca: bytes, client=None) -> int:
    """The serving status grpc.health.v1 reports over a TLS channel (with `client`'s certificate)."""
    credentials = grpc.ssl_channel_credentials(ca, client.key if client else None, client.cert if client else None)
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def start(tmp_path, volume: SecretVolume, client_ca: bool = False) -> AgentProcess:
    tls = {"cert_file": volume.path("tls.crt"), "key_file": volume.path("tls.key")}
    if client_ca:
        tls["client_ca_file"] = volume.path("ca.crt")
    agent = AgentProcess(tmp_path, {"devices": {"backend": "simulated", "simulated": {"devices": 2}}, "tls": tls})
    return agent.start()


@pytest.fixture
def agents():
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.stop()


def test_metrics_and_the_stream_serve_tls_and_a_rotated_certificate_is_served_without_a_restart(tmp_path, agents):
    ca = Authority()
    first = ca.issue("agent")
    volume = SecretVolume(tmp_path / "tls", {"tls.crt": first.cert, "tls.key": first.key})
    agents.append(agent := start(tmp_path, volume))

    status, body, serial = https(agent.http_port, "/metrics", ca.cert)
    assert status == 200 and "npu_chip_info_health_status" in body and serial == first.serial
    assert grpc_check(agent.grpc_port, ca.cert) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises((ConnectionError, http.client.HTTPException)):  # plaintext gets no answer
        plain = http.client.HTTPConnection("127.0.0.1", agent.http_port, timeout=10)
        plain.request("GET", "/healthz")
        plain.getresponse()

    # The `faults` command over TLS; without the CA it does not trust the agent.
    command = [sys.executable, "-m", "agent", "faults", "--json", "--target", f"127.0.0.1:{agent.grpc_port}",
               "--timeout", "10"]
    (tmp_path / "ca.pem").write_bytes(ca.cert)
    done = subprocess.run([*command, "--ca-file", str(tmp_path / "ca.pem")], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr

    second = ca.issue("agent")
    volume.update({"tls.crt": second.cert, "tls.key": second.key})
    wait_until(lambda: https(agent.http_port, "/healthz", ca.cert)[2] == second.serial, 20, "the new certificate")
    status, body, _ = https(agent.http_port, "/metrics", ca.cert)
    assert 'npu_agent_tls_reloads_total{node="test-node",result="success"} 1.0' in body
    agent.wait_for_log("TLS files reloaded; new connections get the new certificate")
    assert grpc_check(agent.grpc_port, ca.cert) == health_pb2.HealthCheckResponse.SERVING


def test_a_bad_rotation_keeps_the_certificate_in_force_and_fails_readiness_until_mended(tmp_path, agents):
    ca = Authority()
    first, second = ca.issue("agent"), ca.issue("agent")
    volume = SecretVolume(tmp_path / "tls", {"tls.crt": first.cert, "tls.key": first.key})
    agents.append(agent := start(tmp_path, volume))
    wait_until(lambda: https(agent.http_port, "/readyz", ca.cert)[0] == 200, 20, "ready")

    volume.update({"tls.crt": second.cert, "tls.key": first.key})  # a key that is not the certificate's
    status, body, serial = wait_until(lambda: (r := https(agent.http_port, "/readyz", ca.cert))[0] == 503 and r,
                                      20, "/readyz 503")
    assert "TLS files not in force" in body and serial == first.serial
    record = agent.wait_for_log("TLS files did not load; the certificate in force stays")
    assert "tls.crt" in record["problem"]
    assert https(agent.http_port, "/metrics", ca.cert)[0] == 200  # still served, with the old certificate

    volume.update({"tls.crt": second.cert, "tls.key": second.key})
    wait_until(lambda: https(agent.http_port, "/readyz", ca.cert)[:3:2] == (200, second.serial), 20,
               "ready with the new certificate")
    body = https(agent.http_port, "/metrics", ca.cert)[1]
    assert 'npu_agent_tls_reloads_total{node="test-node",result="failure"} 1.0' in body
    assert len([r for r in agent.logs if r.get("msg") == "TLS files did not load; the certificate in force stays"]) == 1


def test_grpc_clients_must_present_a_certificate_of_the_client_ca(tmp_path, agents):
    ca, clients, strangers = Authority("server CA"), Authority("client CA"), Authority("another CA")
    server = ca.issue("agent")
    volume = SecretVolume(tmp_path / "tls", {"tls.crt": server.cert, "tls.key": server.key, "ca.crt": clients.cert})
    agents.append(agent := start(tmp_path, volume, client_ca=True))

    assert grpc_check(agent.grpc_port, ca.cert, clients.issue("prometheus", client=True)) == \
        health_pb2.HealthCheckResponse.SERVING
    for client in (None, strangers.issue("intruder", client=True)):
        with pytest.raises(grpc.RpcError) as info:
            grpc_check(agent.grpc_port, ca.cert, client)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # /metrics asks for no client certificate (the kubelet's probes have none).
    assert https(agent.http_port, "/healthz", ca.cert)[0] == 200


def test_a_handshake_that_never_comes_does_not_hold_the_endpoint(tmp_path, agents):
    ca = Authority()
    issued = ca.issue("agent")
    volume = SecretVolume(tmp_path / "tls", {"tls.crt": issued.cert, "tls.key": issued.key})
    agents.append(agent := start(tmp_path, volume))
    silent = [socket.create_connection(("127.0.0.1", agent.http_port)) for _ in range(80)]  # more than the cap
    try:
        assert https(agent.http_port, "/healthz", ca.cert)[0] == 200
        silent[0].settimeout(40)
        assert silent[0].recv(1) == b""  # closed by the agent after the idle time-out (10 s)
    finally:
        for connection in silent:
            connection.close()


@pytest.mark.parametrize("files, problem", [
    ({"tls.crt": b"not a certificate", "tls.key": b"not a key"}, "tls: "),
    ({}, "cannot read"),
])
def test_tls_files_that_do_not_load_stop_the_start_with_the_reason(tmp_path, files, problem):
    directory = tmp_path / "tls"
    directory.mkdir()
    for name, data in files.items():
        (directory / name).write_bytes(data)
    agent = AgentProcess(tmp_path, {"devices": {"backend": "simulated"}, "tls": {
        "cert_file": str(directory / "tls.crt"), "key_file": str(directory / "tls.key")}})
    done = subprocess.run([sys.executable, "-m", "agent", "run", "--config", str(agent.config_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and problem in done.stderr and "tls.crt" in done.stderr, done.stderr


def test_check_config_loads_the_tls_files(tmp_path):
    ca = Authority()
    one, other = ca.issue("agent"), ca.issue("agent")
    volume = SecretVolume(tmp_path / "tls", {"tls.crt": one.cert, "tls.key": other.key})
    agent = AgentProcess(tmp_path, {"tls": {"cert_file": volume.path("tls.crt"), "key_file": volume.path("tls.key")}})
    command = [sys.executable, "-m", "agent", "check-config", str(agent.config_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith(f"tls: {volume.path('tls.crt')} with "), done.stderr
    volume.update({"tls.crt": one.cert, "tls.key": one.key})
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
