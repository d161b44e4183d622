"""Attributing a TCP connection to a training job through /proc (the proxy's PeerResolver), with real
processes holding real sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from agent.taskd.peers import PeerRefused, PeerResolver, parse_peer

HOLD = "import socket, sys; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); sys.stdin.read()"


@pytest.fixture
def listener():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server


def connect(listener, env: dict):
    """A child process with `env` connected to `listener`: (process, the child's address as gRPC names it)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("MINDX_TASK_ID", "MASTER_ADDR", "MS_SCHED_HOST")}
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(listener.getsockname()[1])], env={**clean, **env},
                             stdin=subprocess.PIPE)
    listener.settimeout(20)
    conn, (host, port) = listener.accept()
    return child, conn, f"ipv4:{host}:{port}"


def test_connection_is_traced_to_its_process_and_job(listener):
    child, conn, peer = connect(listener, {"MINDX_TASK_ID": "job-7f3a", "MASTER_ADDR": "10.0.0.8", "RANK": "12"})
    try:
        resolver = PeerResolver()
        found = resolver.resolve(peer)
        assert (found.pid, found.job, found.manager_host, found.rank) == (child.pid, "job-7f3a", "10.0.0.8", "12")
        assert resolver.cached(peer) == found  # one readlink while the socket lives
    finally:
        child.stdin.close()
        child.wait(10)
        conn.close()
    assert resolver.cached(peer) is None  # the process and its socket are gone: resolved afresh next time


def test_manager_host_follows_taskds_launcher_rules(listener):
    cases = [({"MS_SCHED_HOST": "10.1.1.1"}, "10.1.1.1"), ({}, "127.0.0.1"),
             ({"MASTER_ADDR": "10.0.0.8", "LOCAL_PROXY_ENABLE": "on"}, "127.0.0.1")]
    for env, host in cases:
        child, conn, peer = connect(listener, {"MINDX_TASK_ID": "job", **env})
        try:
            assert PeerResolver().resolve(peer).manager_host == host, env
        finally:
            child.stdin.close()
            child.wait(10)
            conn.close()


@pytest.mark.parametrize("env, reason", [({}, "has no MINDX_TASK_ID"),
                                         ({"MINDX_TASK_ID": "../etc"}, "is not a valid job id")])
def test_processes_outside_training_jobs_are_refused_with_the_reason(listener, env, reason):
    child, conn, peer = connect(listener, env)
    try:
        with pytest.raises(PeerRefused, match=reason) as refused:
            PeerResolver().resolve(peer)
        assert f"pid {child.pid}" in str(refused.value)
    finally:
        child.stdin.close()
        child.wait(10)
        conn.close()


def test_addresses_that_are_not_local_tcp_connections():
    with pytest.raises(PeerRefused, match="not a TCP connection"):
        parse_peer("unix:/run/x.sock")
    assert parse_peer("ipv6:[::1]:9602") == ("::1", 9602)
    with pytest.raises(PeerRefused, match="hostNetwork"):
        PeerResolver().resolve("ipv4:127.0.0.1:1")  # nothing connected from there
