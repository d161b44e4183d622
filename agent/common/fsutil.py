"""Small file-system helpers shared by the components that keep state on disk."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable, TypeVar

from agent.common.ratelimit import doubling

log = logging.getLogger(__name__)
T = TypeVar("T")

KEEP_ASIDE = 3  # moved-aside copies kept per state file; older ones are deleted
moved_aside: Counter[str] = Counter()  # state files moved aside, by file name (npu_agent_state_files_moved_aside_total)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def strict_json(raw: bytes | str):
    """JSON as the agent writes it: no NaN/Infinity, no number a float cannot hold (`1e400`)."""
    return json.loads(raw, parse_float=_finite, parse_constant=_no_constant)


def read_state(path: Path, what: str, parse: Callable[[object], T], clock: Callable[[], float] = time.time) -> T | None:
    """The state kept in `path`, as `parse` builds it from the decoded JSON; None if there is none.

    A state file is input like any other. One that cannot be used (not UTF-8 or JSON, nested too
    deeply, a number out of range, or of a shape `parse` refuses with ValueError, TypeError,
    KeyError or AttributeError) is moved aside to `<name>.corrupt-<unix time>` for inspection,
    logged once and counted; the caller starts fresh. One that cannot be read (EACCES, EIO) is
    logged and left where it is."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.error(f"{what} cannot be read; starting without it", extra={"path": str(path), "error": str(exc)})
        return None
    try:
        return parse(strict_json(raw))
    except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError, RecursionError) as exc:
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
    aside = _aside(path, clock)
    try:
        os.replace(path, aside)
        _prune_aside(path)
    except OSError as exc:
        aside = f"(not moved: {exc})"
    moved_aside[path.name] += 1
    log.error(f"{what} of the wrong shape; moved aside, starting without it",
              extra={"path": str(path), "error": error, "moved_to": str(aside)})
    return None


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


def keep_aside(path: Path, data: bytes, clock: Callable[[], float] = time.time) -> Path | None:
    """Keep `data` cut from `path` (e.g. a corrupt log tail) as `<name>.corrupt-<unix time>`; best effort."""
    aside = _aside(path, clock)
    try:
        atomic_write(aside, data)
        _prune_aside(path)
    except OSError as exc:
        log.warning("cannot keep the cut data for inspection", extra={"path": str(aside), "error": str(exc)})
        return None
    moved_aside[path.name] += 1
    return aside


def _aside(path: Path, clock: Callable[[], float]) -> Path:
    return path.with_name(f"{path.name}.corrupt-{int(clock())}")


def _prune_aside(path: Path) -> None:
    for old in sorted(path.parent.glob(f"{path.name}.corrupt-*"))[:-KEEP_ASIDE]:
        old.unlink(missing_ok=True)


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
        return doubling(self._streak - 1, self._first_s, self._max_s) * random.uniform(0.8, 1.0)

    def succeeded(self) -> None:
        if self.error:
            log.info(f"{self.what} written again", extra={
                "failed_attempts": self._streak, "seconds": round(time.monotonic() - self._since, 1)})
        self.error, self._streak = "", 0

    @property
    def problem(self) -> str:
        return f"cannot write the {self.what}: {self.error}" if self.error else ""
