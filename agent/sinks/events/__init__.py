"""Kubernetes Events for NPU faults: client-go's aggregation and rate limits (correlator), the sink that posts them."""
