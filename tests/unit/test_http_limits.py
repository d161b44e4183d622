"""What a client can cost the HTTP endpoint: concurrent scrapes share one rendering, an answer its
reader does not take is dropped after the write time-out, and connections are capped, the oldest
idle or stalled ones closed to make room (logged at most once per interval)."""

from __future__ import annotations

import asyncio
import gzip
import logging
import socket
import threading

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from agent.common.executor import Executor
from agent.http import HttpEndpoint
from testkit.wait import until

CAP_LOG = "http connection limit reached; closed the oldest connections, idle and stalled ones first"
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


class Page:
    """A page of `series` samples (about 60 bytes each); counts its collections."""

    def __init__(self, series: int = 10):
        self.series = series
        self.collects = 0

    def describe(self):
        return []

    def collect(self):
        self.collects += 1
        family = GaugeMetricFamily("test_series", "a sample per series", labels=["series", "padding"])
        for n in range(self.series):
            family.add_metric([str(n), "x" * 20], n)
        yield family


def registry_of(page: Page) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(page)
    return registry


async def get(port: int, path: str, *headers: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{''.join(h + chr(13) + chr(10) for h in headers)}\r\n".encode())
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


def body_of(answer: bytes) -> bytes:
    return answer.split(b"\r\n\r\n", 1)[1]


def non_reader(port: int, path: str = "/metrics") -> socket.socket:
    """A client that asks and never reads (a small receive buffer: the answer stalls at once)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    sock.setblocking(False)
    return sock


def answer_started(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return False


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the endpoint closed it (EOF or a reset), reading away what was sent before."""
    try:
        while sock.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_concurrent_scrapes_share_one_rendering_per_content_type():
    page = Page()

    async def main():
        lane = Executor("test").lane("metrics")
        endpoint = HttpEndpoint("127.0.0.1:0", registry_of(page), lambda: (True, []), lane=lane)
        await endpoint.start()
        gate = threading.Event()
        held = asyncio.ensure_future(lane.run(gate.wait))  # renderings queue behind it
        try:
            requests = [get(endpoint.port, "/metrics") for _ in range(20)]
            requests += [get(endpoint.port, "/metrics", f"Accept: {OPENMETRICS}") for _ in range(20)]
            requests += [get(endpoint.port, "/metrics", "Accept-Encoding: gzip") for _ in range(10)]
            answers = asyncio.gather(*requests)
            # Each request is read before its rendering task first runs: on a busy machine the count of
            # renderings trails that of requests by a turn of the loop, so both are awaited.
            await until(lambda: endpoint.requests == 50 and endpoint.renderings == 3, 10,
                        lambda: f"50 requests read and 3 renderings begun, now {endpoint.requests} and "
                                f"{endpoint.renderings}")
            in_flight = endpoint.renderings
            gate.set()
            answers = await answers
            await held
            again = await get(endpoint.port, "/metrics")
            return in_flight, answers, again, endpoint.renderings
        finally:
            gate.set()
            await endpoint.stop()

    in_flight, answers, again, renderings = asyncio.run(main())
    assert in_flight == 3 and page.collects == 4 and renderings == 4  # text, OpenMetrics, gzipped text; then one more
    text, openmetrics, gzipped = answers[:20], answers[20:40], answers[40:]
    assert all(a.startswith(b"HTTP/1.1 200 ") for a in answers)
    assert len(set(text)) == 1 and b"test_series{" in body_of(text[0]) and b"text/plain" in text[0]
    assert len(set(openmetrics)) == 1 and body_of(openmetrics[0]).endswith(b"# EOF\n")
    assert len(set(gzipped)) == 1 and b"Content-Encoding: gzip" in gzipped[0]
    assert gzip.decompress(body_of(gzipped[0])) == body_of(text[0])
    assert again == text[0]


def test_an_answer_its_reader_does_not_take_is_dropped_after_the_write_time_out():
    async def main():
        endpoint = HttpEndpoint("127.0.0.1:0", registry_of(Page(series=40_000)), lambda: (True, []),
                                write_timeout_s=0.5)
        await endpoint.start()
        sock = non_reader(endpoint.port)
        try:
            await until(lambda: endpoint.slow_readers == 1, 10, "the slow reader dropped")
            await until(lambda: endpoint.connections == 0, 10, "its connection let go")
            await until(lambda: closed_by_peer(sock), 10, "the client to see its connection closed")
            return await get(endpoint.port, "/healthz")
        finally:
            sock.close()
            await endpoint.stop()

    assert asyncio.run(main()).startswith(b"HTTP/1.1 200 ")


def test_at_the_connection_limit_the_oldest_idle_connections_are_closed_and_logged_once_per_interval(caplog):
    async def main():
        endpoint = HttpEndpoint("127.0.0.1:0", registry_of(Page()), lambda: (True, []), max_connections=4,
                                log_interval_s=0.2)
        await endpoint.start()
        clients = []
        try:
            for n in range(10):
                clients.append(await asyncio.open_connection("127.0.0.1", endpoint.port))
                await until(lambda: endpoint.connections == min(n + 1, 4), 10, f"connection {n} taken in")
            first_six = [await asyncio.wait_for(reader.read(), 10) for reader, _ in clients[:6]]
            health = await get(endpoint.port, "/healthz")  # in, by closing one more: the oldest left
            await until(lambda: clients[6][0].at_eof(), 10, "connection 6 closed")
            lines = lambda: [r for r in caplog.records if r.getMessage() == CAP_LOG]  # noqa: E731
            await until(lambda: sum(r.closed for r in lines()) == 7, 10, lambda: f"7 closes logged: {lines()}")
            return first_six, health, endpoint.closed_for_room, lines(), [not r.at_eof() for r, _ in clients[7:]]
        finally:
            for _, writer in clients:
                writer.close()
            await endpoint.stop()

    caplog.set_level(logging.WARNING, "agent.http")
    first_six, health, closed, lines, others_open = asyncio.run(main())
    assert first_six == [b""] * 6 and health.startswith(b"HTTP/1.1 200 ") and closed == 7
    assert others_open == [True, True, True]
    assert lines[0].closed == 1 and lines[0].limit == 4 and lines[0].levelname == "WARNING"
    assert all(b.created - a.created >= 0.15 for a, b in zip(lines, lines[1:])), [r.created for r in lines]


def test_a_probe_gets_in_when_the_only_slot_holds_an_answer_nobody_reads():
    async def main():
        endpoint = HttpEndpoint("127.0.0.1:0", registry_of(Page(series=40_000)), lambda: (True, []),
                                max_connections=1)
        await endpoint.start()
        sock = non_reader(endpoint.port)
        try:
            await until(lambda: answer_started(sock), 10, "the answer on its way")
            health = await get(endpoint.port, "/healthz")
            await until(lambda: closed_by_peer(sock), 10, "the slow reader's connection closed")
            return health, endpoint.closed_for_room
        finally:
            sock.close()
            await endpoint.stop()

    health, closed_for_room = asyncio.run(main())
    assert health.startswith(b"HTTP/1.1 200 ") and closed_for_room == 1
