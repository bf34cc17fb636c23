"""The import graph reads one way: no cycle between the package's modules, the training side (collect) never imports
the rules or the views, and the offline side (trace, rules, commands, views) never reaches torch. Read from the source
with ast, so that every module is covered, including the ones no test imports. The top-level dashboards/ folder is
the package ampdoctor.dashboards (setup.cfg's package_dir), and is walked under that name."""

import ast
import os

import pytest
from source import parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# folder -> the package name it installs as
PACKAGES = {"ampdoctor": "ampdoctor", "dashboards": "ampdoctor.dashboards"}
# What runs inside training (torch) and what a user calls with a model in hand; everything else is the offline side.
TRAINING_SIDE = ("ampdoctor.collect", "ampdoctor.islands", "ampdoctor.integrations")
TORCH = ("torch", "lightning", "pytorch_lightning", "transformers", "accelerate")


def _modules() -> dict:
    """module name -> (path, is_package) for every .py file under the packages."""
    out = {}
    for folder, package in PACKAGES.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, folder))[:-3].split(os.sep)
                is_pkg = rel[-1] == "__init__"
                parts = package.split(".") + (rel[:-1] if is_pkg else rel)
                out[".".join(parts)] = (os.path.join(dirpath, f), is_pkg)
    return out


MODULES = _modules()


def _imports(name: str, top_level_only: bool) -> set:
    """Absolute names a module imports (``from pkg import mod`` counts as pkg.mod when that is a module)."""
    path, is_pkg = MODULES[name]
    tree = parse(path)
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
    assert "ampdoctor.rules" in g["ampdoctor.dashboards.diagnosis"]  # dashboards/ is walked as ampdoctor.dashboards
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
    assert "ampdoctor.trace.writer" in offline and "ampdoctor.dashboards.app" in offline
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


# The one-way flow, collect -> trace -> rules -> views: the modules of each layer import only from the layers before
# it (and from the neutral modules every layer may use: number formats, severities, the precision bound, the FP32
# islands' code line). The whole graph counts, function-level imports included.
NEUTRAL = (
    "ampdoctor.formats",
    "ampdoctor.severity",
    "ampdoctor.roundoff",
    "ampdoctor.islands",
    "ampdoctor.autocast_ops",
    "ampdoctor.cards",
)
# A Trace, a Diagnosis or a Replay shown in a notebook hands its display to the notebook views (_repr_html_, imported
# when a notebook asks): the one way up the flow, for display only.
DISPLAY = ("ampdoctor.notebook",)
LAYERS = {
    "ampdoctor.collect": ("ampdoctor.trace",),
    "ampdoctor.trace": (),
    "ampdoctor.rules": ("ampdoctor.trace", "ampdoctor.lossscale", "ampdoctor.whatif", "ampdoctor.precision_label"),
    "ampdoctor.lossscale": ("ampdoctor.trace",),
}


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_each_layer_imports_only_the_layers_before_it(layer):
    g = _graph(top_level_only=False)
    allowed = (layer, "ampdoctor.collect.") if layer == "ampdoctor.collect" else (layer,)
    allowed = (*allowed, *LAYERS[layer], *NEUTRAL, *(DISPLAY if layer != "ampdoctor.collect" else ()))
    bad = {
        m: sorted(t for t in targets if t != "ampdoctor" and not t.startswith(allowed))
        for m, targets in g.items()
        if m == layer or m.startswith(layer + ".")
    }
    assert {m: t for m, t in bad.items() if t} == {}


def test_the_training_side_never_imports_the_rules():
    """collect/ runs inside training: the live rules are handed to it by ampdoctor.attach, never imported."""
    g = _graph(top_level_only=False)
    seen, todo = set(), [m for m in MODULES if m.startswith("ampdoctor.collect")]
    while todo:
        m = todo.pop()
        for n in g[m] - seen:
            seen.add(n)
            todo.append(n)
    assert not [m for m in seen if m.startswith(("ampdoctor.rules", "ampdoctor.dashboards", "ampdoctor.commands"))]
