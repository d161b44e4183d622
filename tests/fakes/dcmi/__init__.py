"""Fake libdcmi.so (C) plus its build helper and control-socket client."""

from .build import build_fake_dcmi
from .control import FakeDcmiControl

__all__ = ["build_fake_dcmi", "FakeDcmiControl"]
