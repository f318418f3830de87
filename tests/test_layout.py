"""The package's shape, enforced: dependencies point one way, no import cycles, nothing ships test helpers.

Read from the source (AST), every import counted: top-level, inside functions, under ``TYPE_CHECKING``.
An import of ``fsdp_strategies.a.b`` also runs ``fsdp_strategies.a``'s ``__init__``, so it counts as an
import of that package too (the root ``fsdp_strategies/__init__`` is left out of that chain: it is the front
door that imports every layer to register the strategies, and it runs first whatever one imports). The rule is
the one docs/architecture.md draws:

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

BASE = {"_options", "_torch_seam", "_lightning_seam", "_distributed", "_atomic_file", "protocols"}
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
    "top": {"base", "parallel", "flops", "memory", "checkpoint", "hf", "runtime", "strategies", "ft",
            "callbacks"},
    # fault injectors for tests, benchmarks and demo configs: may import anything, imported by nothing
    "testing": {"base", "parallel", "flops", "memory", "checkpoint", "hf", "runtime", "strategies", "ft",
                "callbacks", "top"},
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
    assert not wrong, (
        f"{module} ({mine}) imports {wrong}; {mine} may import only {sorted(ALLOWED[mine])} "
        f"(see docs/architecture.md). Fix: move the shared code down a layer, or the importer up."
    )


#: what the launcher's side of ft/ may import of the training side: the contract between the two
CONTRACT = {"fsdp_strategies.ft.protocol", "fsdp_strategies.ft.timeouts"}


def _ft_side(module: str) -> str | None:
    if not module.startswith("fsdp_strategies.ft.") or module == "fsdp_strategies.ft.__main__":
        return None  # ft's __init__ exports the strategy; __main__ is the launcher's entry point
    return "launch" if module.startswith("fsdp_strategies.ft.launch") else "training"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _ft_side(m)))
def test_ft_training_and_launch_meet_only_in_the_contract(module: str) -> None:
    """ft/launch/ (the supervisor) and the rest of ft/ (training processes) import each other only through
    ft.protocol and ft.timeouts: a training module never imports the launcher, the launcher nothing else."""
    side = _ft_side(module)
    other = sorted(d for d in GRAPH[module] if _ft_side(d) not in (None, side) and d not in CONTRACT)
    assert not other, (f"{module} ({side} side of ft/) imports {other}. Fix: what both sides need belongs in "
                       "ft/protocol.py (the contract); see docs/architecture.md.")


def test_the_ft_side_check_sees_a_crossing() -> None:
    """A guard for the guard: the launcher's import of the protocol is seen as a crossing into the
    contract."""
    assert "fsdp_strategies.ft.protocol" in GRAPH["fsdp_strategies.ft.launch.launcher"]
    assert _ft_side("fsdp_strategies.ft.strategy") == "training"
    assert _ft_side("fsdp_strategies.ft.launch.launcher") == "launch"


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
    long = {
        m: n for m, p in source_modules().items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
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


# the two seams read Lightning's and torch's private names by design (each with its own test)
SEAMS = {"fsdp_strategies._lightning_seam", "fsdp_strategies._torch_seam"}


def defined_names(tree: ast.AST) -> set[str]:
    """Names a module defines itself: functions, classes, assigned names, attributes it assigns
    (``x._a = ...``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def private_string_reads(source: str, package_names: set[str]) -> list[str]:
    """``getattr`` / ``hasattr`` of a private name given as a string: on ``self`` always (a mixin reaching
    into its siblings, or a lazily-created attribute probed), on anything else when another module of the
    package defines the name and this one does not (another module's private attribute). A foreign library's
    private name is the seams' business (tests/test_lightning_seam.py)."""
    tree = ast.parse(source)
    own = defined_names(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
            continue
        target, name = node.args[0], node.args[1]
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            continue
        if not name.value.startswith("_") or name.value.startswith("__"):
            continue
        on_self = isinstance(target, ast.Name) and target.id in ("self", "cls")
        if on_self or (name.value in package_names and name.value not in own):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def package_defined_names() -> set[str]:
    return set().union(*(defined_names(ast.parse(p.read_text())) for p in source_modules().values()))


def test_no_private_attribute_is_read_by_string_across_modules() -> None:
    """Coupling the import scan cannot see: ``getattr(self, "_x")`` in one mixin for an attribute another
    module's mixin sets. A part that needs something from another is handed that part and asks it through a
    method (the strategy's preemption guard and async checkpointing, see docs/architecture.md)."""
    names = package_defined_names()
    found = {m: reads for m, p in source_modules().items()
             if m not in SEAMS and (reads := private_string_reads(p.read_text(), names))}
    assert not found, f"private attributes read by string (hand the object, ask it through a method): {found}"


def test_the_string_read_check_flags_the_old_mixins() -> None:
    """Mutation check: the coupling this layout had (an async-checkpoint mixin reading the preemption mixin's
    and Lightning's attributes by string) is flagged; a module's own private names on other objects, and a
    foreign library's, are not."""
    old = ('class AsyncCheckpointMixin:\n'
           '    def due(self):\n'
           '        return getattr(self, "_preempt_check_due", None), hasattr(self, "_timeout")\n'
           'class Guard:\n'
           '    _saving = False\n'
           'def saving(guard, module):\n'
           '    return getattr(guard, "_saving"), getattr(guard, '
           '"_other"), getattr(module, "_tp_plan", None)\n')
    reads = private_string_reads(old, {"_preempt_check_due", "_saving", "_other"})
    assert sorted(reads) == ["3: getattr(self, '_preempt_check_due', None)", "3: hasattr(self, '_timeout')",
                             "7: getattr(guard, '_other')"], reads
