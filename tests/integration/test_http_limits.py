"""The real agent's HTTP endpoint under load from outside: a storm of scrapes that never read their
answers, and more idle connections than the descriptor limit container runtimes leave (1024). In
both /healthz must still answer quickly."""

from __future__ import annotations

import resource
import selectors
import socket
import sys
import time
from pathlib import Path

import pytest

from agent.http import MAX_CONNECTIONS
from testkit.agent import AgentProcess
from testkit.wait import wait_until

PROBE_BOUND_S = 1.0
CAP_LOG = "http connection limit reached; closed the oldest connections, idle and stalled ones first"
# Starts the agent's command line with the soft descriptor limit common container runtimes set.
LOW_SOFT_LIMIT = ("import os, resource, sys; hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
                  "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)); os.execv(sys.argv[1], sys.argv[1:])")


def probe(port: int, path: str = "/healthz") -> tuple[bytes, float]:
    """One request on a fresh connection: (answer, seconds it took); the answer is b"" when none came in 5 s."""
    started, answer = time.monotonic(), b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            while chunk := sock.recv(65536):
                answer += chunk
    except (socket.timeout, ConnectionError):
        pass
    return answer, time.monotonic() - started


def open_connections(port: int, count: int, request: bytes = b"", deadline_s: float = 10.0) -> list[socket.socket]:
    """`count` connections opened at once (non-blocking), each sending `request` once connected and then
    never reading (a small receive buffer, so that the agent's writes stall at once)."""
    selector = selectors.DefaultSelector()
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        sockets.append(sock)
        selector.register(sock, selectors.EVENT_WRITE)
    deadline = time.monotonic() + deadline_s
    pending = len(sockets)
    while pending and time.monotonic() < deadline:
        for key, _ in selector.select(0.1):
            selector.unregister(key.fileobj)
            pending -= 1
            if request and key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                try:
                    key.fileobj.send(request)
                except OSError:  # the agent closed it already (the connection limit)
                    pass
    selector.close()
    return sockets


def connect_idle(agent: AgentProcess, count: int, batch: int = 50) -> list[socket.socket]:
    """`count` idle connections, each accepted by the agent: opened in batches its accept queue (100)
    holds, since the kernel drops the handshakes past a full queue without a trace on either side."""
    sockets: list[socket.socket] = []
    for start in range(0, count, batch):
        sockets += open_connections(agent.http_port, min(batch, count - start))
        wait_until(lambda: not_accepted(agent.http_port) == 0, 5,
                   lambda: f"the agent to accept connection {start + batch} ({not_accepted(agent.http_port)} waiting, "
                           f"{descriptors(agent.process.pid)} descriptors open)")
    return sockets


def not_accepted(port: int) -> int:
    """Connections to 127.0.0.1:`port` the agent has not accepted yet: in its accept queue, or
    handshakes the kernel holds back while that queue is full."""
    local, waiting = f"0100007F:{port:04X}", 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[3] == "0A":  # LISTEN: rx_queue is the accept queue
            waiting += int(fields[4].split(":")[1], 16)
        elif fields[1] == local and fields[3] == "03":  # SYN_RECV
            waiting += 1
    return waiting


def descriptors(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def open_files_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open files line")


@pytest.fixture
def many_descriptors():
    """This process opens more than 1,024 sockets: its own soft limit up to its hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2500:
        pytest.skip(f"the hard descriptor limit {hard} is too low for 1,100 connections and an agent")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_scrapes_that_never_read_leave_healthz_fast(tmp_path):
    # 64 simulated NPUs with telemetry: a 1.6 MB page whose rendering costs >100 ms of CPU.
    agent = AgentProcess(tmp_path, {"devices": {"backend": "simulated", "poll_interval_seconds": 1,
                                                "simulated": {"devices": 64}},
                                    "telemetry": {"enabled": True}}).start()
    storm: list[socket.socket] = []
    try:
        wait_until(lambda: len(agent.http("/metrics")[1]) > 1_000_000, 20, "a full page of telemetry")
        storm = open_connections(agent.http_port, 200, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = [probe(agent.http_port, path) for path in ("/healthz", "/readyz", "/healthz", "/healthz")]
        slowest = max(seconds for _, seconds in answers)
        assert all(answer.startswith(b"HTTP/1.1 200 ") for answer, _ in answers), answers
        assert slowest < PROBE_BOUND_S, f"/healthz took {slowest:.2f}s during the storm"
        # Scrapes that do read get whole pages meanwhile.
        status, text = agent.http("/metrics")
        assert status == 200 and text.endswith("\n") and "npu_agent_build_info" in text
    finally:
        for sock in storm:
            sock.close()
        assert agent.stop() < 10


def test_idle_connections_past_the_soft_descriptor_limit_leave_healthz_answering(tmp_path, many_descriptors):
    agent = AgentProcess(tmp_path, {"devices": {"backend": "simulated", "simulated": {"devices": 4}}})
    agent.launcher = [sys.executable, "-c", LOW_SOFT_LIMIT]
    agent.start()
    idle: list[socket.socket] = []
    try:
        pid = agent.process.pid
        wait_until(lambda: agent.http("/readyz")[0] == 200, 10, "/readyz 200")
        before = descriptors(pid)
        idle = connect_idle(agent, 1100)
        answer, seconds = probe(agent.http_port)
        assert answer.startswith(b"HTTP/1.1 200 ") and seconds < PROBE_BOUND_S, (answer, seconds)
        # The agent holds at most its limit of HTTP connections, whatever the soft limit would allow.
        assert descriptors(pid) <= before + MAX_CONNECTIONS + 8
        soft, hard = open_files_limit(pid)
        assert soft == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        raised = agent.wait_for_log("open files limit")
        assert (raised["was"], raised["soft"], raised["hard"]) == (1024, hard, hard)
        first = agent.wait_for_log(CAP_LOG)
        assert first["limit"] == MAX_CONNECTIONS and first["closed"] >= 1
        # A second wave within the minute: turned away as well, and not logged again.
        idle += connect_idle(agent, 300)
        answer, seconds = probe(agent.http_port)
        assert answer.startswith(b"HTTP/1.1 200 ") and seconds < PROBE_BOUND_S, (answer, seconds)
        assert [r["msg"] for r in agent.logs].count(CAP_LOG) == 1
        assert not [line for line in agent.raw_stderr if "out of system resource" in line]
    finally:
        for sock in idle:
            sock.close()
        assert agent.stop() < 10
