"""Helpers only the tests use; what the benchmarks use too is in testkit/."""
