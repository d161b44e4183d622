"""What the agent's gRPC servers share: a listening port that is theirs alone."""

from __future__ import annotations

import grpc

# gRPC turns SO_REUSEPORT on by default: a second process could bind the same port and silently
# take half of the connections. Every listening port of the agent is exclusive.
EXCLUSIVE = [("grpc.so_reuseport", 0)]


def bind(server: grpc.aio.Server, listen: str, key: str, hint: str = "",
         credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind `listen` (the configuration key `key`), with TLS when given `credentials`; OSError with
    one clear line when it cannot."""
    try:
        port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
    except RuntimeError:  # grpcio >= 1.60 raises where older versions returned 0
        port = 0
    if port == 0:
        raise OSError(f"{key} {listen}: cannot listen there (address in use or not local){hint}")
    return port
