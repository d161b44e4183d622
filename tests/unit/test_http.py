"""The HTTP endpoint answers every request, even when a collector fails."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry

from agent.http import HttpEndpoint


class Broken:
    def describe(self):
        return []

    def collect(self):
        raise UnicodeEncodeError("utf-8", "\udcff", 0, 1, "surrogates not allowed")


async def get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


def test_a_collector_that_raises_gets_a_500_logged_once_and_the_endpoint_goes_on(caplog):
    async def main():
        registry = CollectorRegistry()
        registry.register(Broken())
        endpoint = HttpEndpoint("127.0.0.1:0", registry, lambda: (True, []))
        await endpoint.start()
        try:
            first = await get(endpoint.port, "/metrics")
            second = await get(endpoint.port, "/metrics")
            health = await get(endpoint.port, "/healthz")
        finally:
            await endpoint.stop()
        return first, second, health, endpoint.failures

    caplog.set_level(logging.ERROR, "agent.http")
    first, second, health, failures = asyncio.run(main())
    assert first.startswith(b"HTTP/1.1 500 ") and b"UnicodeEncodeError" in first
    assert second.startswith(b"HTTP/1.1 500 ")
    assert health.startswith(b"HTTP/1.1 200 ")
    assert failures == 2
    lines = [r for r in caplog.records if r.getMessage() == "http request failed; answered 500"]
    assert len(lines) == 1 and lines[0].exc_info


def test_request_headers_are_read_by_name():
    from agent.http import accepts_gzip, parse_headers

    headers = parse_headers(["Host: x", "ACCEPT: text/plain;q=0.5", "accept:  application/openmetrics-text ",
                             " folded continuation", "no colon here", ""])
    assert headers == {"host": "x", "accept": "text/plain;q=0.5, application/openmetrics-text"}
    assert accepts_gzip("gzip") and accepts_gzip("deflate, GZIP;q=0.5") and accepts_gzip("*")
    assert not accepts_gzip("") and not accepts_gzip("identity") and not accepts_gzip("gzip;q=0")
    assert not accepts_gzip("gzip;q=zero")


def test_a_request_larger_than_the_limit_gets_no_answer_and_the_endpoint_goes_on():
    async def main():
        endpoint = HttpEndpoint("127.0.0.1:0", CollectorRegistry(), lambda: (True, []))
        await endpoint.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
            writer.write(b"GET /metrics HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 10_000 + b"\r\n\r\n")
            await writer.drain()
            try:
                refused = await asyncio.wait_for(reader.read(), 10)
            except ConnectionResetError:  # closed with our bytes unread: the kernel resets instead
                refused = b""
            writer.close()
            return refused, await get(endpoint.port, "/healthz")
        finally:
            await endpoint.stop()

    refused, health = asyncio.run(main())
    assert refused == b"" and health.startswith(b"HTTP/1.1 200 ")
