"""Small file-system helpers shared by the components that keep state on disk."""

from __future__ import annotations

import logging
import os
import random
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` so that a reader or a crash sees the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def file_identity(path: str) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of what `path` resolves to now; a ConfigMap's symlink swap changes it."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class WriteRetry:
    """One piece of state on disk whose writes may fail for a while (disk full, read-only, EMFILE).

    The owner keeps what it could not write in memory and tries again after `failed()`'s delay;
    this logs when the failures start and when they end (not every attempt), counts them, and
    says what is wrong for /readyz."""

    def __init__(self, what: str, first_s: float = 1.0, max_s: float = 30.0):
        self.what = what
        self.failures = 0
        self.error = ""
        self._first_s, self._max_s = first_s, max_s
        self._streak = 0
        self._since = 0.0

    def failed(self, exc: OSError, **context) -> float:
        """Seconds to wait before the next attempt."""
        self.failures += 1
        self._streak += 1
        if not self.error:
            self._since = time.monotonic()
            log.error(f"cannot write the {self.what}; kept in memory and retried with backoff",
                      extra={"error": str(exc), **context})
        self.error = str(exc) or type(exc).__name__
        return min(self._max_s, self._first_s * 2 ** (self._streak - 1)) * random.uniform(0.8, 1.0)

    def succeeded(self) -> None:
        if self.error:
            log.info(f"{self.what} written again", extra={
                "failed_attempts": self._streak, "seconds": round(time.monotonic() - self._since, 1)})
        self.error, self._streak = "", 0

    @property
    def problem(self) -> str:
        return f"cannot write the {self.what}: {self.error}" if self.error else ""
