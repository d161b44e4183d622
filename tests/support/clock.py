"""A clock the test moves, for code that takes its time as a `clock` function."""

from __future__ import annotations


class FakeClock:
    """Seconds on time.time()'s scale that stand still until the test moves them. The default start
    is a fixed round time, so file names and stamps derived from it are the same in every run."""

    def __init__(self, start: float = 1_800_000_000.0):
        self.start = self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def at(self, offset: float) -> None:
        """Set the time to start + offset (no rounding accumulates, unlike repeated advance())."""
        self.now = self.start + offset
