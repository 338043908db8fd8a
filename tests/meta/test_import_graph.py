"""The package's import graph has no circles: every module imports in a fresh interpreter,
in alphabetical order and in reverse (a circle breaks one of the two with a partially
initialised module), and the graph of ``from . import`` statements, lazy ones included, is
acyclic. Run it alone as the check of the layout: ``pytest tests/meta/test_import_graph.py``."""

import ast
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import trl_ppo_ext

PACKAGE = Path(trl_ppo_ext.__file__).parent
MODULES = sorted(m.name for m in pkgutil.walk_packages([str(PACKAGE)], "trl_ppo_ext."))


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_every_module_imports_in_a_fresh_interpreter(order):
    names = MODULES if order == "forward" else MODULES[::-1]
    code = ("import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
            "print(len(sys.argv) - 1)\n")
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent), "TRL_EXPERIMENTAL_SILENCE": "1"}
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(len(names))


def _package_imports(path: Path, name: str) -> set[str]:
    """The package modules ``name`` imports anywhere in its file (``from .x import``,
    ``from . import x``, ``import trl_ppo_ext.x``)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            elif node.module and node.module.startswith("trl_ppo_ext"):
                target = node.module
            else:
                continue
            for alias in node.names:  # `from . import functional` names a module
                if f"{target}.{alias.name}" in MODULES:
                    found.add(f"{target}.{alias.name}")
            if target in MODULES:
                found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
    found.discard(name)
    return found


def test_the_import_graph_has_no_cycle():
    graph = {}
    for name in MODULES:
        relative = Path(*name.split(".")[1:])
        path = PACKAGE / relative / "__init__.py" if (PACKAGE / relative).is_dir() else PACKAGE / f"{relative}.py"
        graph[name] = _package_imports(path, name)
    assert graph["trl_ppo_ext.trainer"] >= {"trl_ppo_ext.advantages", "trl_ppo_ext.losses", "trl_ppo_ext.metrics",
                                            "trl_ppo_ext.run.checkpointing"}  # the graph was read at all
    # depth-first search with colours; a grey module met again closes a cycle
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "grey"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "grey":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "black"

    for name in MODULES:
        if name not in state:
            visit(name, [name])
    assert cycles == [], f"import cycles: {cycles}"


def _first_level(name: str) -> str:
    """``trl_ppo_ext.rewards.text`` -> ``trl_ppo_ext.rewards``: a folder is one room."""
    return ".".join(name.split(".")[:2])


def _room_graph() -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for name in MODULES:
        relative = Path(*name.split(".")[1:])
        path = PACKAGE / relative / "__init__.py" if (PACKAGE / relative).is_dir() else PACKAGE / f"{relative}.py"
        room = _first_level(name)
        rooms.setdefault(room, set()).update(_first_level(t) for t in _package_imports(path, name))
    for room, targets in rooms.items():
        targets.discard(room)
    return rooms


def test_the_folders_import_one_way():
    """Seen from the top, each folder (``generation``, ``models``, ``rewards``, ``run``) and each flat
    module is one room, and arrows between rooms never make a circle: the families below the
    pipeline never reach back up into it (the trainer, the rollout, the config, the metrics)."""
    rooms = _room_graph()
    assert rooms["trl_ppo_ext.trainer"] >= {"trl_ppo_ext.models", "trl_ppo_ext.rewards", "trl_ppo_ext.run"}
    pipeline = {"trl_ppo_ext.trainer", "trl_ppo_ext.rollout", "trl_ppo_ext.config", "trl_ppo_ext.metrics",
                "trl_ppo_ext.advantages", "trl_ppo_ext.losses"}
    for family in ("generation", "models", "rewards", "run"):
        assert rooms[f"trl_ppo_ext.{family}"] & pipeline == set(), family
    order, seen = [], {}

    def visit(room, stack):
        seen[room] = "grey"
        for nxt in sorted(rooms.get(room, ())):
            assert seen.get(nxt) != "grey", f"rooms import each other: {stack[stack.index(nxt):] + [nxt]}"
            if nxt not in seen:
                visit(nxt, stack + [nxt])
        seen[room] = "black"
        order.append(room)

    for room in sorted(rooms):
        if room not in seen:
            visit(room, [room])
