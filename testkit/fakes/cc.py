"""Compiling the test-only C fakes into shared libraries."""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from pathlib import Path

FLAGS = ["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-pthread"]


def build_shared_library(source: Path, out: Path, depends: tuple[Path, ...], flags: list[str]) -> Path:
    """Compile `source` into `out` unless `out` is newer than `source` and `depends`.

    Compiled to a temporary name and renamed, so a concurrent build never dlopens a half-written
    library. `$CC` overrides the compiler."""
    newest_source = max(p.stat().st_mtime_ns for p in (source, *depends))
    if out.exists() and out.stat().st_mtime_ns > newest_source:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.stem}-", suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [*shlex.split(os.environ.get("CC") or "cc"), *flags, "-o", tmp, str(source)]
    try:
        try:
            result = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as exc:
            raise RuntimeError(f"cannot run the C compiler {cmd[0]!r}: {exc}") from exc
        if result.returncode != 0:
            raise RuntimeError(f"building {out.name} failed ({shlex.join(cmd)}), exit {result.returncode}:\n"
                               f"{result.stderr}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
