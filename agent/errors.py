"""Errors that carry a user-facing explanation (printed as one line per problem, never a traceback)."""

from __future__ import annotations


class ConfigError(Exception):
    """A configuration value or file is wrong; `problems` are `"<where>: <reason>"` lines."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


def file_problem(path: str, where: str, reason: str) -> str:
    return f"{path}: {where}: {reason}" if where else f"{path}: {reason}"
