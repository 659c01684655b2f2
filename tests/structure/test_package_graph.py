"""The packages of dfm/ import each other without cycles, and the library holds no test or demo hooks.

Every import counts, also those inside functions (a late import hides a cycle from Python, not from
a reader); imports under ``if TYPE_CHECKING:`` name types for annotations only and never run, so they
are not dependencies. The allowed direction is what docs/architecture.md draws.
"""

import ast
from pathlib import Path

import pytest

DFM = Path(__file__).resolve().parents[2] / "dfm"


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "dfm" and len(parts) > 1 else None


def runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            continue
        yield node
        yield from runtime_nodes(node)


def package_imports() -> dict[str, set[str]]:
    """package -> the other dfm packages its modules import."""
    graph: dict[str, set[str]] = {}
    for path in DFM.rglob("*.py"):
        relative = path.relative_to(DFM).parts
        if len(relative) == 1:
            continue  # dfm/__init__.py
        source = relative[0]
        targets = graph.setdefault(source, set())
        for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                target = package_of(name)
                if target and target != source:
                    targets.add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path, node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, node])):
                return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def test_no_import_cycle_between_packages():
    graph = package_imports()
    assert {"config", "data", "models", "training", "inference", "checkpoint", "parallel"} <= graph.keys()
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle) + f"\npackage imports: {graph}"


@pytest.mark.parametrize("needle", ["examples/", '"examples"', "parents[2]", "dump_full_weights"])
def test_library_does_not_reach_into_examples_or_carry_test_hooks(needle):
    hits = [str(p.relative_to(DFM)) for p in DFM.rglob("*.py") if needle in p.read_text()]
    assert not hits, f"{needle!r} in {hits}"
