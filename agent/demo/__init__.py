"""`npu-node-agent demo`: the agent on a simulated node with a small ClusterD, kubelet and training job."""
