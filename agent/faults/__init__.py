"""Fault classification and escalation (pure core) and the fault outputs."""
