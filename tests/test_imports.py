"""The import graph reads one way: no cycle between the package's modules, and the offline side (trace, diagnose,
commands, views) never reaches torch. Read from the source with ast, so that every module is covered, including
the ones no test imports."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("ampdoctor", "dashboards")
# What runs inside training (torch) and what a user calls with a model in hand; everything else is the offline side.
TRAINING_SIDE = ("ampdoctor.collect", "ampdoctor.islands", "ampdoctor.integrations")
TORCH = ("torch", "lightning", "pytorch_lightning", "transformers", "accelerate")


def _modules() -> dict:
    """module name -> (path, is_package) for every .py file under the packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
                is_pkg = rel[-1] == "__init__"
                name = ".".join(rel[:-1] if is_pkg else rel)
                out[name] = (os.path.join(dirpath, f), is_pkg)
    return out


MODULES = _modules()


def _imports(name: str, top_level_only: bool) -> set:
    """Absolute names a module imports (``from pkg import mod`` counts as pkg.mod when that is a module)."""
    path, is_pkg = MODULES[name]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    here = name if is_pkg else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
    return out


def _graph(top_level_only: bool) -> dict:
    """Edges between the package's own modules; importing a.b.c also runs a and a.b (their __init__)."""
    g = {}
    for name in MODULES:
        targets = set()
        for imp in _imports(name, top_level_only):
            parts = imp.split(".")
            for i in range(1, len(parts) + 1):
                parent = ".".join(parts[:i])
                if parent in MODULES and parent != name and not name.startswith(parent + "."):
                    targets.add(parent)
        g[name] = targets
    return g


def _cycles(g: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_the_package():
    """The walk itself: it finds the modules and the edges the test below relies on."""
    g = _graph(top_level_only=True)
    assert len(MODULES) > 60
    assert "ampdoctor.trace.vectors" in g["ampdoctor.trace.writer"]
    assert "ampdoctor.trace" in g["ampdoctor.collect.buffers"]  # the parent package runs too
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module-level", "with-function-level"])
def test_no_import_cycle(top_level_only):
    """No cycle at import time, and none dodged by importing inside a function either."""
    assert _cycles(_graph(top_level_only)) == []


def test_offline_side_never_reaches_torch():
    """Everything that reads a trace (trace, diagnose, commands, cli, views) imports no torch, directly or
    through another module of the package, at module level: `ampdoctor diagnose` runs where torch is absent."""
    g = _graph(top_level_only=True)
    offline = [m for m in MODULES if not m.startswith(TRAINING_SIDE) and m != "ampdoctor"]
    assert "ampdoctor.trace.writer" in offline and "dashboards.app" in offline
    bad = {}
    for start in offline:
        seen, todo = {start}, [start]
        while todo:
            m = todo.pop()
            third = {i.split(".")[0] for i in _imports(m, top_level_only=True)} & set(TORCH)
            if third:
                bad[start] = f"{m} imports {sorted(third)}"
                break
            for n in g[m] - seen:
                seen.add(n)
                todo.append(n)
    assert bad == {}
