"""Tests for the Ascend NPU node agent."""
