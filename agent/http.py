"""The HTTP endpoint: GET /metrics (Prometheus text or OpenMetrics, gzip when asked), /healthz and /readyz, on the
agent's event loop.

A deliberately small HTTP/1.1 server (GET and HEAD, one request per connection) so the scrape reads
the components' state on the same loop that changes it, with no locks and no extra thread.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from agent.config import split_host_port

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 10.0


class HttpEndpoint:
    name = "http"

    def __init__(self, listen: str, registry: CollectorRegistry, readiness: Callable[[], tuple[bool, list[str]]],
                 liveness: Callable[[], tuple[bool, str]] = lambda: (True, "")):
        self._host, self._port = split_host_port(listen)
        self._registry = registry
        self._readiness = readiness
        self._liveness = liveness
        self._server: asyncio.base_events.Server | None = None
        self._logged: set[tuple[str, str]] = set()  # (path, error type) already logged
        self.failures = 0
        self.port = 0

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._serve, self._host, self._port, limit=MAX_REQUEST_BYTES)
        except OSError as exc:
            raise OSError(f"http.listen {self._host}:{self._port}: cannot listen there ({exc.strerror or exc})") from None
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("http endpoint listening", extra={"address": f"{self._host}:{self.port}"})

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def readiness(self) -> tuple[bool, str]:
        return (self._server is not None, "" if self._server is not None else "not listening")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            request, *lines = head.decode("latin-1").split("\r\n")
            method, target, _ = request.split(" ", 2)
            headers = parse_headers(lines)
            path = target.split("?", 1)[0]
            try:
                status, content_type, body = self._route(method, path, headers)
            except Exception as exc:  # a collector's bug costs this answer, never the endpoint or a silent close
                status, content_type, body = self._failed(path, exc)
            encoding = ""
            if path == "/metrics" and status.startswith("200") and accepts_gzip(headers.get("accept-encoding", "")):
                body, encoding = gzip.compress(body, compresslevel=6), "Content-Encoding: gzip\r\n"
            header = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n{encoding}Content-Length: {len(body)}"
                      "\r\nConnection: close\r\n\r\n").encode("latin-1")
            writer.write(header if method == "HEAD" else header + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ValueError,
                ConnectionError):
            pass  # a bad or vanished client: nothing to answer
        finally:
            writer.close()

    def _failed(self, path: str, exc: Exception) -> tuple[str, str, bytes]:
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
        self.failures += 1
        if (path, type(exc).__name__) not in self._logged:  # once per kind: a failing scrape repeats every 15 s
            self._logged.add((path, type(exc).__name__))
            log.error("http request failed; answered 500", exc_info=exc, extra={"path": path, "error": error})
        return "500 Internal Server Error", "text/plain", f"{error}\n".encode()

    def _route(self, method: str, path: str, headers: dict[str, str]) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        if path == "/metrics":
            # OpenMetrics when the scraper asks for it, else the text format (prometheus_client decides).
            encode, content_type = choose_encoder(headers.get("accept", ""))
            return "200 OK", content_type, encode(self._registry)
        if path == "/healthz":
            alive, why = self._liveness()
            return ("200 OK", "text/plain", b"ok\n") if alive else ("503 Service Unavailable", "text/plain", f"{why}\n".encode())
        if path == "/readyz":
            ready, reasons = self._readiness()
            text = "ok\n" if ready else "".join(f"{r}\n" for r in reasons)
            return ("200 OK" if ready else "503 Service Unavailable"), "text/plain", text.encode()
        return "404 Not Found", "text/plain", b"not found: try /metrics, /healthz or /readyz\n"


def parse_headers(lines: list[str]) -> dict[str, str]:
    """Header fields by lower-case name (repeated fields joined by ", "); the request size limit bounds them."""
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if colon and name and not name[0].isspace():
            key = name.strip().lower()
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    return headers


def accepts_gzip(accept_encoding: str) -> bool:
    """True when Accept-Encoding lists gzip (or *) without q=0."""
    for item in accept_encoding.split(","):
        coding, *params = (part.strip() for part in item.split(";"))
        if coding.lower() in ("gzip", "*"):
            weights = [p.split("=", 1)[1] for p in params if p.lower().startswith("q=") and "=" in p]
            try:
                return not weights or float(weights[0]) > 0
            except ValueError:
                return False
    return False
