"""Compile the fake libdcmi.so."""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_SOURCES = (_HERE / "fake_dcmi.c", _HERE / "dcmi_abi.h", Path(__file__).resolve())
_FLAGS = ["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-pthread"]
_VARIANTS = {
    "full": [],
    # A driver too old to have dcmi_subscribe_fault_event at all.
    "no_subscribe": ["-DFAKE_DCMI_OMIT_SUBSCRIBE"],
}


def build_fake_dcmi(out_dir: Path, variant: str = "full") -> Path:
    """Build ``<out_dir>/<variant>/libdcmi.so`` unless it is already up to date."""
    if variant not in _VARIANTS:
        raise ValueError(f"unknown fake DCMI variant {variant!r}; known: {sorted(_VARIANTS)}")
    out = Path(out_dir) / variant / "libdcmi.so"
    newest_source = max(p.stat().st_mtime_ns for p in _SOURCES)
    if out.exists() and out.stat().st_mtime_ns > newest_source:
        return out

    out.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name and rename, so a concurrent build (e.g. two
    # pytest-xdist workers) never dlopens a half-written library.
    fd, tmp = tempfile.mkstemp(prefix=".libdcmi-", suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [
        *shlex.split(os.environ.get("CC") or "cc"),
        *_FLAGS,
        *_VARIANTS[variant],
        "-o",
        tmp,
        str(_HERE / "fake_dcmi.c"),
    ]
    try:
        try:
            result = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:
            raise RuntimeError(f"cannot run the C compiler {cmd[0]!r}: {exc}") from exc
        if result.returncode != 0:
            raise RuntimeError(
                f"building fake libdcmi.so failed ({shlex.join(cmd)}), "
                f"exit {result.returncode}:\n{result.stderr}"
            )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
