"""t2j_ad's modules import one way, down the floors: no import cycles.

Every import counts, module-level or inside a function, since a function-local
import that climbs back up is the same circle, only postponed.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "t2j_ad"
# Compiled modules (CMakeLists.txt): leaves that import nothing of ours, present
# as a name even where the extension is not built.
COMPILED = ("t2j_ad._ffi_ext",)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that importing ``name`` loads, if any."""
    while name:
        if name in modules or name in COMPILED:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (at any depth in its code)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in [*modules, *COMPILED]}
    for mod, path in modules.items():
        is_package = path.name == "__init__.py"
        package = mod if is_package else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1 if node.level else 0):
                    base = base.rpartition(".")[0]
                source = node.module or ""
                if node.level:
                    source = f"{base}.{source}" if source else base
                # `from pkg import name` loads pkg.name when it is a module.
                targets = [f"{source}.{alias.name}" for alias in node.names]
            for target in targets:
                found = _resolve(target, modules)
                if found is not None and found != mod:
                    graph[mod].add(found)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    # Module-level relative imports, function-local ones, and `from . import x`.
    assert "t2j_ad.primitive" in graph["t2j_ad.rules.jvp"]
    assert "t2j_ad.functorch_levels" in graph["t2j_ad.runtime"]  # imported inside a function
    assert "t2j_ad.backends.ffi" in graph["t2j_ad.backends"]
    assert "t2j_ad.registration" in graph["t2j_ad.api"]
    assert graph["t2j_ad.backends.ffi"] >= {"t2j_ad._ffi_ext", "t2j_ad.backends.registry"}


def test_find_cycle_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_primitive_imports_no_rule_and_torch_fn_no_transform():
    graph = import_graph()
    assert not {m for m in graph["t2j_ad.primitive"] if m.startswith("t2j_ad.rules")}
    assert "t2j_ad.registration" not in graph["t2j_ad.primitive"]
    assert graph["t2j_ad.torch_fn"] == set()
