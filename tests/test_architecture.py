"""Data flows one way: no import cycles in ``treerl/``, and no module imports from a higher floor.

Every ``import`` statement of every module is read with ``ast``, those inside functions too
(a lazy import is still a dependency), docstring examples not. The floors, bottom up:

    errors, config -> envs, agents, models (and the package root, which re-exports envs)
    -> kernels -> rollout, serve -> learners -> cli, trainer

The one exception is the root's ``__getattr__``, which loads TRL's entry points
(``from treerl import GRPOTrainer``, ``SDPOTrainer``, ``AsyncGRPOTrainer``) from the top floor on first
use (``LAZY_EXPORTS``).

A module may import from its own floor or below; within a floor the imports must not form a
cycle. A failure names the two files.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "treerl"

FLOORS: dict[str, int] = {
    "treerl.errors": 0,
    "treerl.config": 0,
    "treerl": 1,  # the root re-exports the environment API
    "treerl.envs": 1,
    "treerl.agents": 1,
    "treerl.models": 1,
    "treerl.kernels": 2,
    "treerl.rollout": 3,
    "treerl.serve": 3,  # the OpenAI-compatible server: the rollout floor's, beside the engine it reuses
    "treerl.learners": 4,
    "treerl.cli": 5,
    "treerl.trainer": 5,  # TRL's GRPOTrainer, SDPOTrainer and AsyncGRPOTrainer over the learners
}

LAZY_EXPORTS = {("treerl", "treerl.trainer")}
"""Imports in the root's ``__getattr__``: run on the first ``treerl.GRPOTrainer`` (or ``SDPOTrainer``, ...),
never by ``import treerl`` or by a module below (so that TRL's import line ports), hence neither upward nor a cycle."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The treerl modules ``name`` imports, anywhere in its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # `from treerl.envs import builtin` imports the submodule treerl.envs.builtin
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: {dep for dep in _imports(name, path) if (name, dep) not in LAZY_EXPORTS}
         for name, path in MODULES.items()}


def floor(name: str) -> int:
    while name not in FLOORS:
        name = name.rpartition(".")[0]
        assert name, "a module outside the floors: add it to FLOORS"
    return FLOORS[name]


def _file(name: str) -> str:
    return str(MODULES[name].relative_to(PACKAGE.parent))


def test_every_module_has_a_floor():
    for name in MODULES:
        floor(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_from_a_higher_floor(name):
    upward = sorted(dep for dep in GRAPH[name] if floor(dep) > floor(name))
    assert not upward, (f"{_file(name)} (floor {floor(name)}) imports {_file(upward[0])} (floor {floor(upward[0])}): "
                        "move what it needs down to the lowest floor that uses it")


def test_lazy_exports_import_only_inside_getattr():
    for name, dep in LAZY_EXPORTS:
        tree = ast.parse(MODULES[name].read_text())
        getattr_ = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__")
        inside = {id(n) for n in ast.walk(getattr_)}
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   and dep in {n.module, *(f"{n.module}.{a.name}" for a in n.names), *(a.name for a in n.names)}]
        assert imports and all(id(n) in inside for n in imports), f"{_file(name)} imports {dep} outside __getattr__"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, (f"{_file(cycle[0])} and {_file(cycle[1])} are in an import cycle: "
                           + " -> ".join(_file(m) for m in cycle))


def test_the_checks_catch_what_they_look_for():
    # A cycle of two and an upward import are found and named.
    assert find_cycle({"a": {"b"}, "b": {"a"}, "c": set()}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert floor("treerl.learners.grpo") > floor("treerl.rollout.engine") > floor("treerl.envs.core")
    assert "treerl.learners.core" in GRAPH["treerl.learners.grpo"]
    assert "treerl.envs.builtin" in GRAPH["treerl.envs"]  # `from treerl.envs import builtin`
