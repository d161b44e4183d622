"""Test doubles for external dependencies of the agent."""
