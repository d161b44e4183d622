"""Profiling switch files: `data-trace-<job>` ConfigMaps flushed to the `profilingSwitch` files of the node's jobs."""
