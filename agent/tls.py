"""The certificate `/metrics` and the gRPC server present (tls.cert_file, tls.key_file) and the CAs a
gRPC client's certificate must come from (tls.client_ca_file), re-read when a file changes.

Kubernetes updates a mounted Secret by swapping a symlink, and cert-manager renews certificates
long before they expire, so every 2 s the files' identities (inode, size and mtime of what each
path resolves to) are compared and, when one changed, the set is loaded again in the executor. A set
that does not load (a key that is not the certificate's, a file half-written) is logged with the
reason and counted, `/readyz` names it, and the set in force stays. New connections get the new
certificate; open ones keep theirs.

- HTTP: the server holds one SSLContext whose SNI callback, which OpenSSL calls at every
  ClientHello whether or not it names a server, hands the handshake the context of the set in force.
- gRPC: dynamic server credentials; gRPC's core asks the fetcher at each handshake, and gets the new
  configuration once after a reload.

At start the set must load: the agent refuses to start rather than serve plaintext where TLS is
configured.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import Counter
from dataclasses import dataclass

import grpc

from agent.common.errors import ConfigError
from agent.common.executor import Executor, Lane
from agent.common.families import counter, described
from agent.common.fsutil import file_identity
from agent.config import TlsConfig, read_config_file
from agent.lifecycle import Tasks

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 2.0
READ_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class _Loaded:
    identities: tuple
    context: ssl.SSLContext
    grpc_config: object  # grpc.ServerCertificateConfiguration


class TlsFiles:
    """The component "tls": loads the files at build, watches them while the agent runs."""

    name = "tls"

    def __init__(self, config: TlsConfig, lane: Lane | None = None, interval_s: float = CHECK_INTERVAL_S):
        self._config = config
        self._paths = tuple(p for p in (config.cert_file, config.key_file, config.client_ca_file) if p)
        self._lane = lane or Executor("tls").lane("tls")
        self._interval_s = interval_s
        self.reloads: Counter[str] = Counter()
        self.error = ""  # why the files on disk are not in force ("" when they are)
        self.tasks = Tasks(self.name)
        self._failed: tuple = ()  # the identities of the files that last failed to load
        try:
            self._loaded = self._load()
        except ValueError as exc:
            raise ConfigError([f"tls: {exc}"]) from None
        self._pending_grpc: object | None = None  # a reloaded gRPC configuration not yet fetched
        # What the HTTP server is given; each handshake is switched to the context in force.
        self.server_context = self._loaded.context
        self.server_context.sni_callback = self._pick

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._loaded.grpc_config, self._fetch,
                                                   require_client_authentication=bool(self._config.client_ca_file))

    async def start(self) -> None:
        self.tasks.start("watch", self._watch)

    async def stop(self) -> None:
        await self.tasks.stop()

    def readiness(self) -> tuple[bool, str]:
        problem = "; ".join(p for p in (self.error, self.tasks.problem) if p)
        return not problem, problem

    # ---- the handshakes' side (the loop for HTTP, gRPC's core threads for the fetcher) --------

    def _pick(self, ssl_object: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        current = self._loaded.context
        if ssl_object.context is not current:
            ssl_object.context = current

    def _fetch(self):
        pending, self._pending_grpc = self._pending_grpc, None
        return pending  # None: keep the configuration in force

    # ---- watching ------------------------------------------------------------------------------

    def _identities(self) -> tuple:
        return tuple(file_identity(path) for path in self._paths)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            seen = self._loaded.identities if not self.error else self._failed
            if await self._lane.run(self._identities, timeout=READ_TIMEOUT_S, key="tls") == seen:
                continue
            try:
                loaded = await self._lane.run(self._load, timeout=READ_TIMEOUT_S, key="tls")
            except ValueError as exc:
                self._failed = self._identities()
                self.reloads["failure"] += 1
                if str(exc) != self.error:
                    log.error("TLS files did not load; the certificate in force stays", extra={
                        "problem": str(exc), "files": list(self._paths)})
                self.error = f"TLS files not in force: {exc}"
                continue
            self._loaded, self._pending_grpc = loaded, loaded.grpc_config
            self.error = ""
            self.reloads["success"] += 1
            log.info("TLS files reloaded; new connections get the new certificate", extra={"files": list(self._paths)})

    def _load(self) -> _Loaded:
        """The files as they are now, checked (ValueError says what is wrong); blocking."""
        before = self._identities()
        cert, key = _read(self._config.cert_file), _read(self._config.key_file)
        ca = _read(self._config.client_ca_file) if self._config.client_ca_file else None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self._config.cert_file, self._config.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"{self._config.cert_file} with {self._config.key_file}: {_reason(exc)}") from None
        if ca is not None:
            try:
                ssl.create_default_context(cadata=ca.decode("ascii", "replace"))
            except (ssl.SSLError, ValueError) as exc:
                raise ValueError(f"{self._config.client_ca_file}: no CA certificate ({_reason(exc)})") from None
        if self._identities() != before:
            raise ValueError("a file changed while it was read (a rotation in progress); read again shortly")
        config = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
        return _Loaded(before, context, config)


def _read(path: str) -> bytes:
    """A regular text file, read without blocking on a FIFO or a device (as the configuration is)."""
    try:
        return read_config_file(path).encode()
    except ConfigError as exc:
        raise ValueError(exc.problems[0]) from None


def _reason(exc: Exception) -> str:
    return getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)


RELOADS = counter("npu_agent_tls_reloads", "Reloads of the TLS certificate, key and client CA files, by result "
                  "(a failure keeps the certificate in force)", "result")


class TlsCollector:
    def __init__(self, node: str, files: TlsFiles):
        self._node = node
        self._files = files

    def describe(self):
        return described([RELOADS])

    def collect(self):
        yield RELOADS.series(self._node, ((result, self._files.reloads[result]) for result in ("success", "failure")))
