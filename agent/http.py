"""The HTTP endpoint: GET /metrics (Prometheus text or OpenMetrics, gzip when asked), /healthz, /readyz and the
status page / (agent.status), on the agent's event loop.

A deliberately small HTTP/1.1 server (GET and HEAD, one request per connection). A scrape collects
the components' state on the loop that changes it (no locks); formatting and compressing the page,
most of a scrape's cost, run in the executor's `metrics` lane, and requests that arrive while a page
is being rendered get that page. Nothing a client does can hold the agent: connections are capped
(the oldest idle or slowest ones make room), a request must arrive within the idle time-out, and an
answer must be taken within the write time-out, a chunk at a time. With `http.token_auth`, /metrics
answers only scrapers the API server vouches for (agent.tokenauth); /healthz and /readyz stay open. The
status page shows what /metrics and /readyz show, so it is guarded as /metrics: its SubjectAccessReview
asks for `get /metrics` (as the kubelet maps its paths to what they expose), and whoever may scrape
may read it, with no other grant.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import logging
import socket
import ssl
from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from agent.common.executor import Executor, Lane
from agent.config import split_host_port

if TYPE_CHECKING:
    from agent.status import StatusPage
    from agent.tokenauth import TokenAuth  # imported by agent.app only with http.token_auth

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 10.0  # the idle time-out: a connection's request must have arrived by then
# Scrapers and probes need a few connections at a time; this bounds the descriptors HTTP can take
# (far under the 1024 container runtimes leave, should the hard limit be that low too) and what
# answers waiting on their readers hold: MAX_CONNECTIONS x (two chunks + the kernel's buffer), 24 MiB.
MAX_CONNECTIONS = 64
WRITE_TIMEOUT_S = 10.0  # Prometheus's default scrape_timeout: an answer taken slower is discarded anyway
WRITE_CHUNK = 64 * 1024  # the transport's high-water mark: a reader that stops holds at most two chunks
# The kernel's send buffer per connection (it books twice this). Left to autotuning, an answer
# nobody reads may take 4 MiB of the pod's memory; this still sends 100 MB/s at a 1 ms round trip.
SEND_BUFFER = 128 * 1024
LIMIT_LOG_INTERVAL_S = 60.0

CHALLENGE = 'WWW-Authenticate: Bearer realm="npu-node-agent"\r\n'  # with a 401 (http.token_auth)
# The paths http.token_auth guards, and the non-resource URL each one's SubjectAccessReview asks for.
AUTHORIZED_AS = {"/metrics": "/metrics", "/": "/metrics"}

IDLE, BUSY, STALLED = "idle", "busy", "stalled"  # no request yet / being answered / the answer waits on its reader


class HttpEndpoint:
    name = "http"

    def __init__(self, listen: str, registry: CollectorRegistry, readiness: Callable[[], tuple[bool, list[str]]],
                 liveness: Callable[[], tuple[bool, str]] = lambda: (True, ""), lane: Lane | None = None,
                 max_connections: int = MAX_CONNECTIONS, idle_timeout_s: float = READ_TIMEOUT_S,
                 write_timeout_s: float = WRITE_TIMEOUT_S, log_interval_s: float = LIMIT_LOG_INTERVAL_S,
                 tls: ssl.SSLContext | None = None, auth: TokenAuth | None = None, page: StatusPage | None = None):
        self._host, self._port = split_host_port(listen)
        self._tls = tls  # HTTPS (agent.tls keeps the certificate current); None: plaintext
        self._auth = auth  # who may scrape /metrics and read / (http.token_auth); None: anyone
        self._page = page  # the status page at /; None: / is not found
        self._registry = registry
        self._readiness = readiness
        self._liveness = liveness
        self._lane = lane or Executor("http").lane("metrics")  # the agent passes its executor's lane
        self._max_connections = max(1, max_connections)
        self._idle_timeout_s = idle_timeout_s
        self._write_timeout_s = write_timeout_s
        self._log_interval_s = log_interval_s
        self._server: asyncio.base_events.Server | None = None
        self._logged: set[tuple[str, str]] = set()  # (path, error type) already logged
        self._connections: dict[asyncio.StreamWriter, str] = {}  # open connections, oldest first -> state
        self._renderings: dict[tuple[str, bool], asyncio.Future] = {}  # (content type, gzip) -> page in the making
        self._unlogged = 0  # connections closed for room since the last log line
        self._limit_log: asyncio.TimerHandle | None = None
        self.requests = 0
        self.failures = 0
        self.renderings = 0
        self.closed_for_room = 0
        self.slow_readers = 0  # answers not taken within the write time-out
        self.port = 0

    async def start(self) -> None:
        try:
            # A handshake must end within the idle time-out too: a client that connects and says nothing holds nothing.
            self._server = await asyncio.start_server(
                self._serve, self._host, self._port, limit=MAX_REQUEST_BYTES, ssl=self._tls,
                ssl_handshake_timeout=self._idle_timeout_s if self._tls else None)
        except OSError as exc:
            raise OSError(f"http.listen {self._host}:{self._port}: cannot listen there ({exc.strerror or exc})") from None
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("http endpoint listening", extra={"address": f"{self._host}:{self.port}", "tls": self._tls is not None})

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for writer in list(self._connections):  # a reader that does not read must not hold up the exit
            writer.transport.abort()
        self._connections.clear()
        if self._limit_log is not None:
            self._limit_log.cancel()
            self._limit_log = None

    def readiness(self) -> tuple[bool, str]:
        return (self._server is not None, "" if self._server is not None else "not listening")

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self._max_connections:
            self._make_room()
        self._connections[writer] = IDLE
        with contextlib.suppress(OSError, AttributeError):  # AttributeError: no socket (closed meanwhile)
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._idle_timeout_s)
            self._mark(writer, BUSY)
            request, *lines = head.decode("latin-1").split("\r\n")
            method, target, _ = request.split(" ", 2)
            headers = parse_headers(lines)
            path = target.split("?", 1)[0]
            self.requests += 1
            try:
                status, content_type, body, gzipped, extra = await self._route(method, path, headers, peer(writer))
            except Exception as exc:  # a collector's bug costs this answer, never the endpoint or a silent close
                (status, content_type, body), gzipped, extra = self._failed(path, exc), False, ""
            encoding = "Content-Encoding: gzip\r\n" if gzipped else ""
            encoding += CHALLENGE if status.startswith("401") else ""
            header = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n{encoding}{extra}Content-Length: "
                      f"{len(body)}\r\nConnection: close\r\n\r\n").encode("latin-1")
            async with asyncio.timeout(self._write_timeout_s):
                await self._write(writer, header, b"" if method == "HEAD" else body)
        except TimeoutError:
            if self._connections.get(writer) == STALLED:
                self.slow_readers += 1
            writer.transport.abort()  # close() would wait for the unread answer to drain
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, ConnectionError):
            writer.transport.abort()  # a bad or vanished client: nothing to answer
        finally:
            self._connections.pop(writer, None)
            writer.close()

    async def _write(self, writer: asyncio.StreamWriter, header: bytes, body: bytes) -> None:
        """The answer a chunk at a time: one page shared by many requests is not copied into each
        transport's buffer, and a reader that stops costs at most two chunks."""
        view = memoryview(body)
        for chunk in (header, *(view[offset:offset + WRITE_CHUNK] for offset in range(0, len(view), WRITE_CHUNK))):
            if writer.is_closing():  # closed to make room
                raise ConnectionResetError("closed to make room")
            writer.write(chunk)
            if writer.transport.get_write_buffer_size():
                self._mark(writer, STALLED)
                await writer.drain()
                self._mark(writer, BUSY)
        await writer.drain()

    def _mark(self, writer: asyncio.StreamWriter, state: str) -> None:
        if writer in self._connections:  # not if it was closed to make room
            self._connections[writer] = state

    def _make_room(self) -> None:
        """Close the oldest idle connection, else the oldest whose answer waits on its reader, else
        the oldest: a new request (a probe) always gets in, and descriptors stay bounded."""
        victim = next((w for state in (IDLE, STALLED, BUSY) for w, s in self._connections.items() if s == state))
        del self._connections[victim]
        victim.transport.abort()
        self.closed_for_room += 1
        self._unlogged += 1
        if self._limit_log is None:
            self._log_limit()

    def _log_limit(self) -> None:
        """At once the first time, then at most once per interval while connections are closed."""
        if not self._unlogged:
            self._limit_log = None
            return
        log.warning("http connection limit reached; closed the oldest connections, idle and stalled ones first",
                    extra={"limit": self._max_connections, "closed": self._unlogged})
        self._unlogged = 0
        self._limit_log = asyncio.get_running_loop().call_later(self._log_interval_s, self._log_limit)

    def _failed(self, path: str, exc: Exception) -> tuple[str, str, bytes]:
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
        self.failures += 1
        if (path, type(exc).__name__) not in self._logged:  # once per kind: a failing scrape repeats every 15 s
            self._logged.add((path, type(exc).__name__))
            log.error("http request failed; answered 500", exc_info=exc, extra={"path": path, "error": error})
        return "500 Internal Server Error", "text/plain", f"{error}\n".encode()

    async def _route(self, method: str, path: str, headers: dict[str, str],
                     client: str) -> tuple[str, str, bytes, bool, str]:
        """(status, content type, body, gzipped, extra header lines); `client` is the peer's address."""
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"only GET\n", False, ""
        page = self._page
        if self._auth and (path == "/metrics" or (path == "/" and page)):
            # HEAD is a get, as the kubelet authorises it; the probes' paths below are open.
            refused = await self._auth.check(headers.get("authorization", ""), AUTHORIZED_AS[path], client,
                                             requested=path)
            if refused:
                return refused.status, "text/plain", refused.body.encode(), False, ""
        if path == "/metrics":
            gzipped = accepts_gzip(headers.get("accept-encoding", ""))
            content_type, body = await self._metrics(headers.get("accept", ""), gzipped)
            return "200 OK", content_type, body, gzipped, ""
        if path == "/" and page:
            return "200 OK", page.content_type, page.render(), False, "".join(f"{k}: {v}\r\n" for k, v in page.headers)
        if path == "/healthz":
            alive, why = self._liveness()
            return ("200 OK", "text/plain", b"ok\n", False, "") if alive else (
                "503 Service Unavailable", "text/plain", f"{why}\n".encode(), False, "")
        if path == "/readyz":
            ready, reasons = self._readiness()
            text = "ok\n" if ready else "".join(f"{r}\n" for r in reasons)
            return ("200 OK" if ready else "503 Service Unavailable"), "text/plain", text.encode(), False, ""
        served = "/, /metrics, /healthz or /readyz" if page else "/metrics, /healthz or /readyz"
        return "404 Not Found", "text/plain", f"not found: try {served}\n".encode(), False, ""

    async def _metrics(self, accept: str, gzipped: bool) -> tuple[str, bytes]:
        # OpenMetrics when the scraper asks for it, else the text format (prometheus_client decides).
        encode, content_type = choose_encoder(accept)
        key = (content_type, gzipped)
        rendering = self._renderings.get(key)
        if rendering is None:  # else this request gets the page being rendered: a storm costs one rendering
            rendering = self._renderings[key] = asyncio.ensure_future(self._render(encode, gzipped))
            rendering.add_done_callback(functools.partial(self._rendered, key))
        return content_type, await asyncio.shield(rendering)  # one request that goes away cancels no other's

    def _rendered(self, key: tuple[str, bool], rendering: asyncio.Future) -> None:
        if self._renderings.get(key) is rendering:
            del self._renderings[key]
        if not rendering.cancelled():
            rendering.exception()  # each waiter has it; none left is no unretrieved error

    async def _render(self, encode: Callable, gzipped: bool) -> bytes:
        self.renderings += 1
        # Collected here, on the loop, where the collectors read the components' state without locks
        # (16 ms for 64 NPUs with telemetry); formatting and gzip, 90 % of a scrape, in the lane.
        collected = _Collected(list(self._registry.collect()))
        return await self._lane.run(_encode, encode, collected, gzipped)


class _Collected:
    """Families collected already, as the encoders want them: something with `collect()`."""

    def __init__(self, families: list):
        self._families = families

    def collect(self) -> list:
        return self._families


def _encode(encode: Callable, collected: _Collected, gzipped: bool) -> bytes:
    body = encode(collected)
    return gzip.compress(body, compresslevel=6) if gzipped else body


def peer(writer: asyncio.StreamWriter) -> str:
    """The client's address (without its port: a scraper's every connection has a new one)."""
    address = writer.get_extra_info("peername")
    return str(address[0]) if isinstance(address, tuple) and address else ""


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
