"""Stand-in for ClusterD's public-fault gRPC API (/PubFault/SendPublicFault)."""

from .other_sender import OtherSender
from .server import CLUSTERD_LISTENER_CAP, DEFAULT_CONFIG, ClusterdStandIn, Received, StoredFault

__all__ = ["CLUSTERD_LISTENER_CAP", "ClusterdStandIn", "DEFAULT_CONFIG", "OtherSender", "Received", "StoredFault"]
