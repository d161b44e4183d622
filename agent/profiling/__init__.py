"""Profiling hostPaths: the datatrace switch files, the disk guard, step metrics."""
