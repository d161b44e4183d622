"""npu-node-agent: the per-node agent for Kubernetes clusters that train on Ascend NPUs."""

__version__ = "0.1.0"
