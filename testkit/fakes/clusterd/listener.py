"""ClusterD's connection-limited listener, in front of the stand-in's gRPC server.

ClusterD wraps its gRPC listener in a limiter: at most 1,024 connections at a time in all and 512
per client IP. A connection over either cap is accepted and closed at once with a reset (linger 0),
before any byte of HTTP/2: the client sees its connection fail, and the server never sees a call.

Python's gRPC server can cap its connections in total (`CoreCap` below) but not per IP, and does
not tell who is connected, so by default the stand-in listens here and relays every
admitted connection to its gRPC server on a private port (one relay per connection, both ways, on
one asyncio loop in a thread of its own). `stop()` closes the listener and every connection, as a
ClusterD that exits does; `start()` listens again on the same port.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections import Counter

TOTAL_LIMIT, PER_IP_LIMIT = 1024, 512
_CHUNK = 65536


class ConnectionCap:
    def __init__(self, host: str, backend_port: int, port: int = 0, total: int = TOTAL_LIMIT,
                 per_ip: int | None = PER_IP_LIMIT):
        self.host, self.port, self.backend_port = host, port, backend_port
        self.total, self.per_ip = total, per_ip
        self._lock = threading.Lock()
        self._by_ip: Counter[str] = Counter()
        self.open = 0  # admitted connections now
        self.peak = 0  # the most at once since the last reset_peak()
        self.admitted = 0
        self.refused = 0  # closed at once: over a cap
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task] = set()

    def start(self) -> "ConnectionCap":
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(asyncio.start_server(
                    self._accept, self.host, self.port, reuse_address=True, backlog=4096))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # noqa: BLE001 - handed to start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="clusterd-standin-listener", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise OSError(f"clusterd stand-in cannot listen on {self.host}:{self.port}: {failure[0]}")
        return self

    def stop(self) -> None:
        """Close the listener and every connection (ClusterD exits)."""
        if self._loop is None:
            return

        async def close() -> None:
            self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            if self._handlers:
                await asyncio.wait(list(self._handlers), timeout=5)
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = self._thread = self._server = None

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.open

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ip = writer.get_extra_info("peername")[0]
        with self._lock:
            over = self.open >= self.total or (self.per_ip is not None and self._by_ip[ip] >= self.per_ip)
            if over:
                self.refused += 1
            else:
                self.open += 1
                self.admitted += 1
                self.peak = max(self.peak, self.open)
                self._by_ip[ip] += 1
        if over:  # like ClusterD's limiter: a reset, nothing read or written
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return
        self._writers.add(writer)
        self._handlers.add(asyncio.current_task())
        try:
            try:
                backend_reader, backend_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
            except OSError:
                return
            self._writers.add(backend_writer)
            try:
                await asyncio.gather(_pipe(reader, backend_writer), _pipe(backend_reader, writer))
            finally:
                self._writers.discard(backend_writer)
                backend_writer.transport.abort()
        finally:
            self._writers.discard(writer)
            writer.transport.abort()
            self._handlers.discard(asyncio.current_task())
            with self._lock:
                self.open -= 1
                self._by_ip[ip] -= 1


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until either side ends; then end the other (a half-open relay would hold the connection)."""
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.transport.abort()


# Server-side TCP states in /proc/net/tcp: 01 ESTABLISHED; 04 FIN_WAIT1, 05 FIN_WAIT2, 06 TIME_WAIT
# are sockets the server closed first (the quota's refusals, or a stop).
_ESTABLISHED, _CLOSED_BY_SERVER = "01", {"04", "05", "06"}


class CoreCap:
    """The total cap kept by gRPC's own listener (``grpc.max_allowed_incoming_connections``), no relay.

    Over the cap gRPC's C core accepts the connection and closes it at once, before any byte of HTTP/2,
    as ClusterD's limiter does (a FIN here where ClusterD sends a reset: the client sees the connection
    fail either way). Being native it keeps up with a herd of a thousand clients, which the relay on a
    Python loop does not. It has no per-IP cap. gRPC does not tell Python about connections, so they
    are counted from the kernel's socket table (/proc/net/tcp) every ``every`` s: `open` (established
    and accepted on the port; the kernel's backlog is not counted) is exact when read, `peak` is the
    most seen by the sampler, and `refused` counts the distinct sockets seen closed by the server
    first (in a run: at the cap; a stop() adds its own). It is a lower bound: a refused connection
    whose client had already written ends in a reset and leaves no such socket.
    """

    def __init__(self, port: int, every: float = 0.02):
        self.port, self.every = port, every
        self.peak = 0
        self._closed: set[str] = set()
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._sample, name="clusterd-standin-conns", daemon=True)
        self._thread.start()

    @staticmethod
    def option(total: int) -> tuple[str, int]:
        return ("grpc.max_allowed_incoming_connections", total)

    def _scan(self) -> tuple[int, list[str]]:
        local = f":{self.port:04X}"
        established, closed = 0, []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as f:
                    next(f)
                    for line in f:
                        fields = line.split()
                        if not fields[1].endswith(local):
                            continue
                        # inode 0: still in the listen backlog, not yet accepted (nor refused) by gRPC
                        if fields[3] == _ESTABLISHED and fields[9] != "0":
                            established += 1
                        elif fields[3] in _CLOSED_BY_SERVER:
                            closed.append(fields[2])  # the client's address and port
            except FileNotFoundError:
                continue
        return established, closed

    def _sample(self) -> None:
        while self._running:
            established, closed = self._scan()
            with self._lock:
                self.peak = max(self.peak, established)
                self._closed.update(closed)
            time.sleep(self.every)

    @property
    def open(self) -> int:
        established = self._scan()[0]
        with self._lock:
            self.peak = max(self.peak, established)
        return established

    @property
    def refused(self) -> int:
        with self._lock:
            return len(self._closed)

    def reset_peak(self) -> None:
        established = self._scan()[0]
        with self._lock:
            self.peak = established

    def stop(self) -> None:
        self._running = False
        self._thread.join(5)
