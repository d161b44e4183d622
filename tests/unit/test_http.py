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
