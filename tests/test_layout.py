"""The package's shape, enforced: dependencies point one way, no import cycles, nothing ships test helpers.

Read from the source (AST), every import counted: top-level, inside functions, under ``TYPE_CHECKING``.
An import of ``fsdp_strategies.a.b`` also runs ``fsdp_strategies.a``'s ``__init__``, so it counts as an
import of that package too (the root ``fsdp_strategies/__init__`` is left out of that chain: it is the front
door that imports every layer to register the strategies, and it runs first whatever one imports). The rule is the one docs/architecture.md draws:

    base <- parallel <- flops <- memory
    base <- parallel <- checkpoint <- hf <- runtime <- strategies <- ft
    callbacks <- base, parallel, flops, memory (and protocols, which is base)
    testing: imported by nothing in the package
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "fsdp_strategies"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE

BASE = {"_options", "_torch_seam", "_lightning_seam", "_distributed", "protocols"}
# layer -> the layers it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "parallel": {"base"},
    "flops": {"base", "parallel"},
    "memory": {"base", "parallel", "flops"},
    "checkpoint": {"base", "parallel"},
    "hf": {"base", "parallel", "checkpoint"},
    "runtime": {"base", "parallel", "checkpoint", "hf"},
    "strategies": {"base", "parallel", "flops", "checkpoint", "hf", "runtime"},
    "ft": {"base", "parallel", "flops", "checkpoint", "hf", "runtime", "strategies"},
    "callbacks": {"base", "parallel", "flops", "memory"},
    # the package's front doors: may import any layer, never `testing`
    "top": {"base", "parallel", "flops", "memory", "checkpoint", "hf", "runtime", "strategies", "ft", "callbacks"},
    # fault injectors for tests, benchmarks and demo configs: may import anything, imported by nothing
    "testing": {"base", "parallel", "flops", "memory", "checkpoint", "hf", "runtime", "strategies", "ft", "callbacks", "top"},
}
TOP = {"__init__", "cli"}
MAX_MODULE_LINES = 600
MAX_ROOT_MODULES = 10


def module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "top"
    head = parts[1]
    if head in BASE:
        return "base"
    if head in TOP:
        return "top"
    if head == "testing":
        return "testing"
    assert head in ALLOWED, f"{module}: no layer is defined for `{head}`; add it to tests/test_layout.py"
    return head


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def imported(path: Path, module: str, known: set[str]) -> set[str]:
    """Every package module that importing ``module`` may run, parents included."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            # `from pkg import name`: the submodule `pkg.name` where there is one, else pkg itself
            names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target
                     for alias in node.names]
        for name in names:
            if not name.startswith(PACKAGE):
                continue
            parts = name.split(".")
            for i in range(1 if len(parts) == 1 else 2, len(parts) + 1):
                candidate = ".".join(parts[:i])
                if i < len(parts) and module.startswith(candidate + "."):
                    continue  # this module's own parent package: already running when it is imported
                if candidate in known and candidate != module:
                    found.add(candidate)
    return found


GRAPH = {m: imported(p, m, set(source_modules())) for m, p in source_modules().items()}


def test_the_scan_sees_the_package() -> None:
    """A guard for the guard: the graph holds the edges everybody knows exist."""
    assert "fsdp_strategies.strategies.fsdp2" in GRAPH["fsdp_strategies.strategies"]
    assert "fsdp_strategies.parallel" in GRAPH["fsdp_strategies.strategies.fsdp2"]
    assert "fsdp_strategies.strategies.fsdp2" in GRAPH["fsdp_strategies.ft.strategy"]
    assert len(GRAPH) > 30


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_dependencies_point_one_way(module: str) -> None:
    mine = layer(module)
    wrong = sorted(dep for dep in GRAPH[module] if layer(dep) != mine and layer(dep) not in ALLOWED[mine])
    assert not wrong, (f"{module} ({mine}) imports {wrong}; {mine} may import only {sorted(ALLOWED[mine])} "
                       f"(see docs/architecture.md). Fix: move the shared code down a layer, or the importer up.")


def test_nothing_in_the_package_imports_testing() -> None:
    users = sorted(m for m, deps in GRAPH.items() if "fsdp_strategies.testing" in deps)
    assert not users, f"production modules import fsdp_strategies.testing: {users}"


def test_no_import_cycles() -> None:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep):], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check: an edge back from a low layer to a high one is reported."""
    graph = {k: set(v) for k, v in GRAPH.items()}
    graph["fsdp_strategies.parallel.blocks"].add("fsdp_strategies.strategies.fsdp2")
    monkeypatch.setitem(globals(), "GRAPH", graph)
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycles()
    with pytest.raises(AssertionError, match="may import only"):
        test_dependencies_point_one_way("fsdp_strategies.parallel.blocks")


def test_modules_stay_small_and_the_root_stays_short() -> None:
    long = {m: n for m, p in source_modules().items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"
    root = sorted(p.name for p in SRC.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the package root: {root}"


def test_the_architecture_page_maps_every_module() -> None:
    """docs/architecture.md's tree names every module, so the map a contributor reads is the package's."""
    page = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    tree = page[page.index("src/fsdp_strategies/"):]
    tree = tree[: tree.index("```")]
    missing = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                     if p.name != "__main__.py" and p.name not in tree
                     and not (p.name == "__init__.py" and f"{p.parent.name}/" in tree))
    assert not missing, f"docs/architecture.md's tree does not name: {missing}"
