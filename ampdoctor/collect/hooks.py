"""Hook registration with handles: everything attach() changes is undone by one close()."""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable
from typing import Callable

import torch

from ..trace.schema import ROOT


class Handles:
    """Torch hook handles plus restore callables; ``remove()`` undoes all of them, last first, once."""

    def __init__(self):
        self._undo: list[Callable[[], None]] = []

    def add(self, handle) -> None:
        self._undo.append(handle.remove)

    def on_remove(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def remove(self) -> None:
        while self._undo:
            fn = self._undo.pop()
            try:
                fn()
            except Exception:  # a handle whose module is gone: nothing left to undo
                pass

    def __len__(self) -> int:
        return len(self._undo)


def wrap_method(handles: Handles, obj, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``obj.name`` by ``make(original)`` on the instance; restore the instance exactly on remove."""
    had_own = name in vars(obj)
    original = getattr(obj, name)
    setattr(obj, name, make(original))

    def restore():
        if had_own:
            setattr(obj, name, original)
        else:
            try:
                delattr(obj, name)
            except AttributeError:
                pass

    handles.on_remove(restore)


def module_path(name: str) -> str:
    """A module's site path: its name in ``named_modules()``, the root ``(model)``. A submodule that is itself
    named ``(model)`` would share the root's sites: it gets a backslash in front (``\\(model)``)."""
    if not name:
        return ROOT
    return "\\" + name if name == ROOT else name


def select_modules(model: torch.nn.Module, include=None, exclude=None) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) pairs to observe. include/exclude: name prefixes or glob patterns, or a
    ``(path, module) -> bool`` predicate; the root module is always kept (step timing and batch size)."""
    inc = _matcher(include, default=True)
    exc = _matcher(exclude, default=False)
    out = []
    for name, mod in model.named_modules():
        path = module_path(name)
        if name == "" or (inc(path, mod) and not exc(path, mod)):
            out.append((path, mod))
    return out


def _matcher(spec, default: bool) -> Callable[[str, torch.nn.Module], bool]:
    if spec is None:
        return lambda path, mod: default
    if callable(spec):
        return lambda path, mod: bool(spec(path, mod))
    if isinstance(spec, str):
        spec = [spec]
    patterns = list(spec)

    def match(path: str, mod) -> bool:
        for p in patterns:
            if any(ch in p for ch in "*?[") and fnmatch.fnmatchcase(path, p):
                return True
            if path == p or path.startswith(p + "."):
                return True
        return False

    return match


def float_tensors(obj, limit: int = 16) -> list[torch.Tensor]:
    """Floating-point tensors in a (nested) output or argument structure, at most ``limit`` of them."""
    found: list[torch.Tensor] = []

    def visit(o, depth=0):
        if len(found) >= limit or depth > 4:
            return
        if isinstance(o, torch.Tensor):
            if o.is_floating_point() and o.layout == torch.strided:
                found.append(o)
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v, depth + 1)
        elif isinstance(o, dict):
            for v in o.values():
                visit(v, depth + 1)
        elif hasattr(o, "to_tuple") and callable(o.to_tuple):  # transformers ModelOutput
            visit(o.to_tuple(), depth + 1)

    visit(obj)
    return found


def first_tensor(args: Iterable, kwargs: dict | None = None) -> torch.Tensor | None:
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, dict):
            t = first_tensor((), a)
            if t is not None:
                return t
    return None


# -1 while no backward pass runs: a forward seen during one is a checkpoint recomputation. Bound once, because the
# forward hook asks on every call.
graph_task_id = torch._C._current_graph_task_id


def eager(fn):
    """Hooks run eagerly under torch.compile: traced, their id()/weakref bookkeeping would make dynamo guard on
    tensor identities and recompile every step. The disabled copy is only entered while dynamo traces (its
    wrapper costs microseconds per call, which eager training would pay on every hook)."""
    compiler = getattr(torch, "compiler", None)
    if compiler is None or not hasattr(compiler, "disable") or not hasattr(compiler, "is_compiling"):
        return fn
    disabled = compiler.disable(fn)
    is_compiling = compiler.is_compiling

    @functools.wraps(fn)
    def hook(*args, **kwargs):
        if is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return hook
