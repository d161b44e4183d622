"""The agent's own gRPC fault stream (npuagent.v1.NodeFaults) and the `faults` command that reads it."""
