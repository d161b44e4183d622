"""The layout keeps its promises: no import cycle between the agent's modules (counting imports made
inside functions), the shared types in `agent.model` depend on nothing of the agent, `agent.common`
depends on nothing but itself and the model, and the pure rules core reads no subsystem."""

from __future__ import annotations

import ast
from pathlib import Path

import agent

ROOT = Path(agent.__file__).parent


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if "._proto" not in name:
            found[name] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Agent modules `name` imports anywhere in its body; `from package import module` counts the module."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name and m != "agent"}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return out


def test_no_module_imports_itself_through_others():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_shared_types_and_the_common_helpers_are_leaves():
    edges = graph()
    assert edges["agent.model"] == set()
    for name, targets in edges.items():
        if name.startswith("agent.common"):
            assert all(t.startswith("agent.common") or t == "agent.model" for t in targets), (name, targets)


def test_the_rules_core_reads_no_subsystem():
    for name, targets in graph().items():
        if name.startswith("agent.faults.rules"):
            outside = {t for t in targets if not t.startswith(("agent.faults.rules", "agent.common", "agent.model"))}
            assert outside <= {"agent.config"}, (name, outside)  # the YAML/JSON file reader of rule files
