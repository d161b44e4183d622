"""Where fault changes go after the durable log: ClusterD, the device-info ConfigMap, the agent's own gRPC stream."""
