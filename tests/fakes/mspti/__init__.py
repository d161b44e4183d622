"""Fake libmspti.so (C): the MSPTI activity-buffer ABI plus a ctypes control API (fake_mspti_*)."""

from __future__ import annotations

import ctypes
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_SOURCES = (_HERE / "fake_mspti.c", _HERE / "mspti_abi.h", Path(__file__).resolve())
_FLAGS = ["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread"]

__all__ = ["build_fake_mspti", "load_fake_mspti"]


def build_fake_mspti(out_dir: Path) -> Path:
    """Build ``<out_dir>/libmspti.so`` unless it is already up to date; return its path."""
    out = Path(out_dir) / "libmspti.so"
    newest_source = max(p.stat().st_mtime_ns for p in _SOURCES)
    if out.exists() and out.stat().st_mtime_ns > newest_source:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libmspti-", suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [*shlex.split(os.environ.get("CC") or "cc"), *_FLAGS, "-o", tmp, str(_HERE / "fake_mspti.c")]
    try:
        try:
            result = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:
            raise RuntimeError(f"cannot run the C compiler {cmd[0]!r}: {exc}") from exc
        if result.returncode != 0:
            raise RuntimeError(
                f"building fake libmspti.so failed ({shlex.join(cmd)}), exit {result.returncode}:\n{result.stderr}"
            )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load_fake_mspti(path: Path) -> ctypes.CDLL:
    """Load the fake (the same file the collector dlopens, so both see one instance) with signatures set."""
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    u64, c_int, c_char_p = ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p
    lib.fake_mspti_emit.argtypes = [u64, c_char_p, c_char_p, c_int, c_int]
    lib.fake_mspti_emit.restype = c_int
    lib.fake_mspti_emit_kind.argtypes = [c_int, u64, c_char_p, c_char_p, c_int, c_int]
    lib.fake_mspti_emit_kind.restype = c_int
    lib.fake_mspti_wait_idle.argtypes = []
    lib.fake_mspti_wait_idle.restype = None
    lib.fake_mspti_hold_completions.argtypes = [c_int]
    lib.fake_mspti_hold_completions.restype = None
    lib.fake_mspti_set_object_id.argtypes = [c_int, ctypes.c_uint32, ctypes.c_uint32]
    lib.fake_mspti_set_object_id.restype = None
    lib.fake_mspti_reset.argtypes = []
    lib.fake_mspti_reset.restype = None
    for name in ("emitted", "dropped", "filtered", "requests", "declined", "completed", "next_id", "held", "state"):
        fn = getattr(lib, f"fake_mspti_{name}")
        fn.argtypes, fn.restype = [], u64
    for name in ("msptiActivityEnable", "msptiActivityDisable"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [c_int], c_int
    lib.msptiActivityFlushAll.argtypes, lib.msptiActivityFlushAll.restype = [ctypes.c_uint32], c_int
    return lib
