"""Stand-in for ClusterD's public-fault gRPC API (/PubFault/SendPublicFault)."""

from .other_sender import OtherSender
from .server import DEFAULT_CONFIG, ClusterdStandIn, Received, StoredFault

__all__ = ["ClusterdStandIn", "DEFAULT_CONFIG", "OtherSender", "Received", "StoredFault"]
