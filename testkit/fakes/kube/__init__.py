"""In-process stand-in for the Kubernetes API server (core/v1 ConfigMaps, Pods, Nodes and Events)."""

from .server import KubeStandIn

__all__ = ["KubeStandIn"]
