"""The package's import graph: no cycle between files or between subpackages, and each layer imports
only the layers below it (docs/design.md, "Layers").

Every import counts: one inside a function, one under ``if TYPE_CHECKING:`` (a type hint still ties the
files together for a reader), and one of a package's ``__init__`` (``from .. import __version__`` is an
import of the whole package). A package's ``__init__`` is part of its unit; the top-level one sits on
the top layer, so a module importing it imports upward.
"""

from __future__ import annotations

import ast
import functools
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_maskllm"

# Lowest first: a unit may import units of its own layer's lower layers only (and itself). Top-level
# modules are units of their own; a subpackage is one unit.
LAYERS = [
    {"version", "errors", "cache"},
    {"patterns", "modules", "hub"},
    {"serialization", "numerics", "kernels", "data"},
    {"priors", "optim", "perplexity", "training_args", "embedded"},
    {"sparse"},
    {"adapters"},
    {"check", "memory", "learn", "zero_shot"},
    {"cli"},
    {"__main__", "__init__"},
]


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: Path) -> dict[str, Path]:
    return {_module_name(p, package): p for p in package.rglob("*.py")}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules (a package: its ``__init__``) that ``path`` imports, anywhere in the file."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
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


@functools.cache  # read once per package; never changed
def _graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = _modules(package)
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


def _unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for module, deps in graph.items():
        units.setdefault(_unit(module), set()).update(_unit(d) for d in deps if _unit(d) != _unit(module))
    return units


def _upward(graph: dict[str, set[str]], module: str) -> list[str]:
    """The imports of ``module`` from its own or a higher layer (other units only)."""
    level = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    mine = _unit(module)
    return sorted(d for d in graph[module] if _unit(d) != mine and level[_unit(d)] >= level[mine])


def _violations(package: Path) -> list[str]:
    """Every breach of the rules in ``package``: cycles between files and units, and upward imports."""
    graph = _graph(package)
    found = []
    if cycle := _cycle(graph):
        found.append("import cycle: " + " -> ".join(cycle))
    if cycle := _cycle(_unit_graph(graph)):
        found.append("import cycle between subpackages: " + " -> ".join(cycle))
    for module in sorted(graph):
        if upward := _upward(graph, module):
            found.append(f"{module} imports from its own or a higher layer: {upward}")
    return found


def test_no_import_cycle_between_files():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_subpackages():
    cycle = _cycle(_unit_graph(_graph()))
    assert cycle is None, "import cycle between subpackages: " + " -> ".join(cycle)


def test_every_unit_has_a_layer():
    known = set().union(*LAYERS)
    units = {_unit(m) for m in _modules(PACKAGE)}
    assert units <= known, f"place {sorted(units - known)} in LAYERS (and in docs/design.md's diagram)"


@pytest.mark.parametrize("module", sorted(_graph()))
def test_imports_only_from_lower_layers(module):
    graph = _graph()
    level = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    assert not (upward := _upward(graph, module)), (
        f"{module} ({_unit(module)}, layer {level[_unit(module)]}) imports from its own or a higher layer: {upward}"
    )


def _plant(tmp_path: Path, file: str, line: str) -> Path:
    """A copy of the package's sources with ``line`` added at the end of ``file``."""
    copy = tmp_path / "hf_maskllm"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("*.pyc", "__pycache__", "*.so", "*.cpp"))
    target = copy / file
    target.write_text(target.read_text() + "\n" + line + "\n")
    return copy


def test_the_real_package_passes_and_its_copy_too(tmp_path):
    assert _violations(PACKAGE) == []
    assert _violations(_plant(tmp_path, "errors.py", "# nothing planted")) == []


@pytest.mark.parametrize(
    ("file", "line", "expected"),
    [
        # the version read from the package's __init__, which imports every layer
        ("sparse/checkpoint.py", "from .. import __version__", "hf_maskllm.sparse.checkpoint imports from"),
        # a type-only import counts
        (
            "patterns.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .adapters.model import MaskModel",
            "hf_maskllm.patterns imports from its own or a higher layer: ['hf_maskllm.adapters.model']",
        ),
        # an import inside a function counts; from a subpackage's __init__ too
        ("optim.py", "def f():\n    from .sparse import SparseLinear", "hf_maskllm.optim imports from"),
        # a type-only edge that closes a cycle between files of one subpackage
        (
            "adapters/save_and_load.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .model import MaskModel",
            "import cycle: ",
        ),
    ],
    ids=["package-init", "type-only-upward", "function-level-subpackage-init", "type-only-cycle"],
)
def test_a_planted_import_is_caught(tmp_path, file, line, expected):
    found = _violations(_plant(tmp_path, file, line))
    assert any(expected in v for v in found), found
