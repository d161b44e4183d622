"""A token bucket (rate and burst), for driver events and for requests to ClusterD; exponential backoff."""

from __future__ import annotations

from typing import Callable


def doubling(attempt: int, first_s: float, max_s: float) -> float:
    """`first_s` doubled `attempt` times, at most `max_s`. The exponent is capped: a peer away for
    days makes thousands of attempts, and 2.0 ** 1024 is an OverflowError, not a long wait."""
    return min(max_s, first_s * 2.0 ** min(max(attempt, 0), 64))


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float]):
        self._rate = rate_per_s
        self._capacity = float(burst)
        self._tokens = float(burst)
        self._clock = clock
        self._last = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self._capacity, self._tokens + (now - self._last) * self._rate)
        self._last = now

    def take(self) -> bool:
        self._refill()
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False

    def wait_time(self) -> float:
        """Seconds until a token is available (0 when one is)."""
        self._refill()
        return 0.0 if self._tokens >= 1 else (1 - self._tokens) / self._rate
