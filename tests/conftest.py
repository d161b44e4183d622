"""Shared fixtures: where the reference data lives, and the fake DCMI driver built from C."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
REFERENCE = Path(os.environ.get("NPU_AGENT_REFERENCE_DIR", REPO.parent / "shared" / "reference"))


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """The peers' real data files (faultCode.json, faultCustomization.json) that sit beside the repository."""
    if not (REFERENCE / "faultCode.json").is_file():
        pytest.fail(f"reference data not found at {REFERENCE}; set NPU_AGENT_REFERENCE_DIR")
    return REFERENCE
