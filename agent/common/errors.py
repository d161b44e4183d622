"""Bad input, told briefly: errors that carry a user-facing explanation (printed as one line per
problem, never a traceback), values quoted within a bound, and log-once bookkeeping."""

from __future__ import annotations

import reprlib
from collections.abc import Hashable

MAX_PROBLEMS = 20  # more are summed up in one line: a file with 100,000 bad entries is not 100,000 lines
MAX_PROBLEM_CHARS = 500


class ConfigError(Exception):
    """A configuration value or file is wrong; `problems` are `"<where>: <reason>"` lines, each clipped."""

    def __init__(self, problems: list[str]):
        problems = [clip(p, MAX_PROBLEM_CHARS) for p in problems]
        if len(problems) > MAX_PROBLEMS:
            problems = [*problems[:MAX_PROBLEMS], f"... and {len(problems) - MAX_PROBLEMS} more problems"]
        self.problems = problems
        super().__init__("; ".join(self.problems))


def file_problem(path: str, where: str, reason: str) -> str:
    return f"{path}: {where}: {reason}" if where else f"{path}: {reason}"


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit - 15]}... ({len(text)} chars)"


_quote = reprlib.Repr()
_quote.maxlevel, _quote.maxstring, _quote.maxother, _quote.maxlong = 3, 60, 60, 40
_quote.maxlist = _quote.maxtuple = _quote.maxdict = _quote.maxset = 6


def quote(value: object) -> str:
    """`repr(value)` within ~60 characters and 3 levels, whatever its size or depth (the repr of a
    value built by YAML aliases or 100,000 nested lists is never computed in full)."""
    return _quote.repr(value)


class Once:
    """True the first time each key is seen, for up to `limit` distinct keys; then never, so a
    flood of distinct bad values costs a bounded set and a bounded number of log lines."""

    def __init__(self, limit: int = 64):
        self._seen: set[Hashable] = set()
        self._limit = limit

    def __call__(self, key: Hashable) -> bool:
        if key in self._seen or len(self._seen) >= self._limit:
            return False
        self._seen.add(key)
        return True
