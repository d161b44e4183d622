"""Fake libdcmi.so (C) plus its build helper and control-socket client."""

from .build import build_fake_dcmi
from .control import FakeDcmiControl

__all__ = ["build_fake_dcmi", "FakeDcmiControl", "physical_id"]


def physical_id(logic: int, devices: int) -> int:
    """The fake's physical id of a logic id when FAKE_DCMI_PHY_IDS is not set: the reverse order, so
    code that mixes up the two ids fails."""
    return devices - 1 - logic
