"""tests/ and bench/ share testkit/ (the fakes, the stand-ins, the agent harness, polling) and never
import each other; testkit/ imports neither; the agent imports none of the three, so the wheel,
which holds agent* only, stands alone. Imports inside functions count."""

from __future__ import annotations

import ast

import pytest

from testkit import REPO

FORBIDDEN = {
    "agent": {"tests", "bench", "testkit"},
    "testkit": {"tests", "bench"},
    "tests": {"bench"},
    "bench": {"tests"},
}


def top_level_imports(source: str, filename: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.partition(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_go_one_way(package):
    wrong = {}
    for path in sorted((REPO / package).rglob("*.py")):
        bad = top_level_imports(path.read_text(), str(path)) & FORBIDDEN[package]
        if bad:
            wrong[str(path.relative_to(REPO))] = sorted(bad)
    assert wrong == {}


def test_the_check_sees_an_import_inside_a_function():
    assert top_level_imports("def f():\n    from bench.stats import percentile\n", "x.py") == {"bench"}
