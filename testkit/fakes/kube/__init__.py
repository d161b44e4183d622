"""In-process stand-in for the Kubernetes API server (core/v1 ConfigMaps and Pods)."""

from .server import KubeStandIn

__all__ = ["KubeStandIn"]
