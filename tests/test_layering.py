"""The package's import graph: no cycle between files or between subpackages, and each layer imports
only the layers below it (docs/design.md, "Layers").

Every import counts, also one inside a function; only imports under ``if TYPE_CHECKING:`` (type hints,
never executed) do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_maskllm"

# Lowest first: a unit may import units of its own layer's lower layers only (and itself). Top-level
# modules are units of their own; a subpackage is one unit.
LAYERS = [
    {"errors", "cache"},
    {"patterns", "modules", "hub"},
    {"serialization", "numerics", "kernels", "data"},
    {"priors", "optim", "perplexity", "training_args", "embedded"},
    {"sparse"},
    {"adapters"},
    {"check", "memory", "learn", "zero_shot"},
    {"cli"},
    {"__main__", "__init__"},
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    out.add(f"{target}.{alias.name}")
                elif target in modules:
                    out.add(target)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
    out.discard(name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _unit(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (as a path), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _files_without_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between files: a package's ``__init__`` re-exports, so edges into and out of it are dropped."""
    inits = {name for name, path in _modules().items() if path.name == "__init__.py"}
    return {k: {d for d in v if d not in inits} for k, v in graph.items() if k not in inits}


def test_no_import_cycle_between_files():
    cycle = _cycle(_files_without_packages(_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_subpackages():
    units: dict[str, set[str]] = {}
    for module, deps in _files_without_packages(_graph()).items():
        units.setdefault(_unit(module), set()).update(_unit(d) for d in deps if _unit(d) != _unit(module))
    cycle = _cycle(units)
    assert cycle is None, "import cycle between subpackages: " + " -> ".join(cycle)


def test_every_unit_has_a_layer():
    known = set().union(*LAYERS)
    units = {_unit(m) for m in _modules()}
    assert units <= known, f"place {sorted(units - known)} in LAYERS (and in docs/design.md's diagram)"


@pytest.mark.parametrize("module", sorted(_files_without_packages(_graph())))
def test_imports_only_from_lower_layers(module):
    level = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    graph = _files_without_packages(_graph())
    mine = _unit(module)
    upward = sorted(d for d in graph[module] if _unit(d) != mine and level[_unit(d)] >= level[mine])
    assert not upward, (
        f"{module} ({mine}, layer {level[mine]}) imports from its own or a higher layer: {upward}"
    )
