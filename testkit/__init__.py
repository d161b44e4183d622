"""What the tests and the benchmarks both run against: the fake native libraries and the stand-ins
for the agent's peers (`testkit.fakes`), the agent in a subprocess (`testkit.agent`) and polling
with a deadline (`testkit.wait`).

It sits beside `tests/` and `bench/` so that each imports it and neither imports the other; it
imports neither of them. Only `agent*` goes into the wheel (pyproject.toml), so none of this ships.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the repository root, the working directory of subprocesses
