"""Access to the Kubernetes API and the kubelet: the client, list+watch, the node's pods and jobs, PodResources attribution."""
