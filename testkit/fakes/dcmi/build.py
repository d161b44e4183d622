"""Compile the fake libdcmi.so."""

from __future__ import annotations

from pathlib import Path

from testkit.fakes.cc import FLAGS, build_shared_library

_HERE = Path(__file__).resolve().parent
_DEPENDS = (_HERE / "dcmi_abi.h", Path(__file__).resolve())
_VARIANTS = {
    "full": [],
    # A driver too old to have dcmi_subscribe_fault_event at all.
    "no_subscribe": ["-DFAKE_DCMI_OMIT_SUBSCRIBE"],
    # Driver headers without dcmi_get_device_multi_utilization_rate_period (the exporter falls back).
    "no_period": ["-DFAKE_DCMI_OMIT_PERIOD"],
}


def build_fake_dcmi(out_dir: Path, variant: str = "full") -> Path:
    """Build ``<out_dir>/<variant>/libdcmi.so`` unless it is already up to date."""
    if variant not in _VARIANTS:
        raise ValueError(f"unknown fake DCMI variant {variant!r}; known: {sorted(_VARIANTS)}")
    return build_shared_library(_HERE / "fake_dcmi.c", Path(out_dir) / variant / "libdcmi.so", _DEPENDS,
                                [*FLAGS, *_VARIANTS[variant]])
