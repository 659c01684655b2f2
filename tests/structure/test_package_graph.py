"""dfm's imports run one way, and the library holds no test or demo hooks.

Every import statement counts: at module level, inside functions (a late import hides a circle from
Python, not from a reader) and under ``if TYPE_CHECKING:`` (a reader follows those too; a type that a
lower module needs from a higher one is a protocol of its own, as dfm/parallel/rules.py's). No two
modules import each other, directly or around a circle, and a package imports only packages drawn on a
lower floor of the picture in docs/architecture.md.
"""

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DFM = ROOT / "dfm"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(DFM.rglob("*.py"))}
# dfm's packages and top-level modules: dfm/config/ -> "config", dfm/errors.py -> "errors".
PACKAGES = sorted({name.split(".")[1] for name in MODULES if "." in name})


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "dfm" and len(parts) > 1 else None


def imported_modules(module: str) -> set[str]:
    """The dfm modules ``module`` imports anywhere in its file; ``from pkg import name`` is pkg.name
    where that is a module, else pkg."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # a name inside a module: the module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


@cache
def module_imports() -> dict[str, set[str]]:
    return {module: imported_modules(module) for module in MODULES}


def package_imports() -> dict[str, set[str]]:
    """package -> the other dfm packages its modules import."""
    graph: dict[str, set[str]] = {}
    for module, targets in module_imports().items():
        source = package_of(module)
        if source:
            graph.setdefault(source, set()).update(package_of(t) for t in targets if package_of(t) != source)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], node, nxt] if nxt in path else [*path, node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, node])):
                return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def drawn_floors() -> list[list[str]]:
    """The floors of docs/architecture.md's picture (its first code block), top first: the dfm packages
    (``name/``) and top-level modules (``name.py``) each line names."""
    block = ARCHITECTURE.read_text().split("```")[1]
    floors = []
    for line in block.splitlines():
        names = [a or b for a, b in re.findall(r"\b(\w+)/|\b(\w+)\.py\b", line)]
        if drawn := [name for name in names if name in PACKAGES]:
            floors.append(drawn)
    return floors


def test_no_import_cycle_between_modules():
    graph = module_imports()
    assert {"dfm.convert.cli", "dfm.diffusion.pipeline", "dfm.parallel.layout"} <= graph.keys()
    cycle = find_cycle(graph)
    assert cycle is None, "modules import each other: " + " -> ".join(cycle)


def test_no_import_cycle_between_packages():
    graph = package_imports()
    assert {"config", "data", "models", "training", "inference", "checkpoint", "parallel"} <= graph.keys()
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle) + f"\npackage imports: {graph}"


def leaf_modules() -> set[str]:
    """dfm's top-level modules that import nothing of dfm: below every floor, drawn or not."""
    graph = module_imports()
    return {name for name in PACKAGES if f"dfm.{name}" in MODULES and not graph[f"dfm.{name}"]}


def test_the_picture_draws_every_package_once():
    drawn = [name for floor in drawn_floors() for name in floor]
    assert len(drawn) == len(set(drawn)), f"docs/architecture.md draws a package twice: {drawn}"
    missing = sorted(set(PACKAGES) - set(drawn) - leaf_modules())
    assert set(drawn) <= set(PACKAGES) and not missing, f"docs/architecture.md draws {drawn}; not drawn: {missing}"


def test_packages_import_only_packages_drawn_below_them():
    floors = drawn_floors()
    floor = {name: len(floors) for name in leaf_modules()}  # the ground, under the picture
    floor |= {name: level for level, names in enumerate(floors) for name in names}
    upward = [
        f"{module} -> {target}"
        for module, targets in module_imports().items()
        for target in sorted(targets)
        if package_of(module) != package_of(target)
        and package_of(module) in floor
        and floor[package_of(target)] <= floor[package_of(module)]
    ]
    assert not upward, "imports of a package drawn on the same or a higher floor (docs/architecture.md):\n" + (
        "\n".join(upward)
    )


def test_the_checks_see_what_they_must():
    """The parser follows late, TYPE_CHECKING and ``from package import module`` imports."""
    graph = module_imports()
    assert "dfm.parallel.rules" in graph["dfm.parallel.layout"]  # from dfm.parallel import rules
    assert "dfm.data.packed_batch" in graph["dfm.parallel.layout"]  # under TYPE_CHECKING
    assert "dfm.convert.lora" in graph["dfm.training.setup"]  # inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


@pytest.mark.parametrize("needle", ["examples/", '"examples"', "parents[2]", "dump_full_weights"])
def test_library_does_not_reach_into_examples_or_carry_test_hooks(needle):
    hits = [str(p.relative_to(DFM)) for p in DFM.rglob("*.py") if needle in p.read_text()]
    assert not hits, f"{needle!r} in {hits}"
