"""Fake libmspti.so (C): the MSPTI activity-buffer ABI plus a ctypes control API (fake_mspti_*).

`FAKE_MSPTI_FOREIGN_SUBSCRIBER=1` in the environment of the process that loads it: another profiler
holds MSPTI's only subscriber slot, so msptiSubscribe fails with
MSPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED (2), as with MindStudio running.
`trainer` is a stand-in training process that uses `agent.worker` on this fake."""

from __future__ import annotations

import ctypes
from pathlib import Path

from testkit.fakes.cc import FLAGS, build_shared_library

_HERE = Path(__file__).resolve().parent
_DEPENDS = (_HERE.parents[2] / "native" / "mspti_abi.h", Path(__file__).resolve())

__all__ = ["build_fake_mspti", "load_fake_mspti"]


def build_fake_mspti(out_dir: Path) -> Path:
    """Build ``<out_dir>/libmspti.so`` unless it is already up to date; return its path."""
    return build_shared_library(_HERE / "fake_mspti.c", Path(out_dir) / "libmspti.so", _DEPENDS,
                                [*FLAGS, "-Wextra"])


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
    lib.fake_mspti_set_foreign_subscriber.argtypes = [c_int]
    lib.fake_mspti_set_foreign_subscriber.restype = None
    lib.fake_mspti_set_result.argtypes = [c_char_p, c_int]
    lib.fake_mspti_set_result.restype = c_int
    for name in ("emitted", "dropped", "filtered", "requests", "declined", "completed", "next_id", "held", "state"):
        fn = getattr(lib, f"fake_mspti_{name}")
        fn.argtypes, fn.restype = [], u64
    for name in ("msptiActivityEnable", "msptiActivityDisable"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [c_int], c_int
    lib.msptiActivityFlushAll.argtypes, lib.msptiActivityFlushAll.restype = [ctypes.c_uint32], c_int
    return lib
