"""Hook registration with handles: everything attach() changes is undone by one close()."""

from __future__ import annotations

import fnmatch
import functools
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # (typing.ParamSpec is Python 3.10+)
    from typing import ParamSpec, TypeVar

    from torch.utils.hooks import RemovableHandle

    _P = ParamSpec("_P")
    _R = TypeVar("_R")

import torch

from ..trace.schema import ROOT
from . import compiled


class Handles:
    """Torch hook handles plus restore callables; ``remove()`` undoes all of them, last first, once."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def add(self, handle: RemovableHandle) -> None:
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


def wrap_method(
    handles: Handles, obj: object, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Replace ``obj.name`` by ``make(original)`` on the instance; restore the instance exactly on remove."""
    had_own = name in vars(obj)
    original = getattr(obj, name)
    setattr(obj, name, make(original))

    def restore() -> None:
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


def select_modules(
    model: torch.nn.Module, include: Any = None, exclude: Any = None
) -> list[tuple[str, torch.nn.Module]]:
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


def _matcher(spec: Any, default: bool) -> Callable[[str, torch.nn.Module], bool]:
    if spec is None:
        return lambda path, mod: default
    if callable(spec):
        return lambda path, mod: bool(spec(path, mod))
    if isinstance(spec, str):
        spec = [spec]
    patterns = list(spec)

    def match(path: str, mod: torch.nn.Module) -> bool:
        for p in patterns:
            if any(ch in p for ch in "*?[") and fnmatch.fnmatchcase(path, p):
                return True
            if path == p or path.startswith(p + "."):
                return True
        return False

    return match


def float_tensors(obj: object, limit: int = 16) -> list[torch.Tensor]:
    """Floating-point tensors in a (nested) output or argument structure, at most ``limit`` of them."""
    found: list[torch.Tensor] = []

    def visit(o: object, depth: int = 0) -> None:
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


def first_tensor(args: Iterable[Any], kwargs: dict[str, Any] | None = None) -> torch.Tensor | None:
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


def eager(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Hooks run eagerly under torch.compile: traced, their id()/weakref bookkeeping would make dynamo guard on
    tensor identities and recompile every step. The disabled copy is only entered while dynamo traces (its
    wrapper costs microseconds per call, which eager training would pay on every hook). Where the C++ extension is
    loaded the test is its EagerHook (csrc/step_record.cpp): one C call instead of this wrapper's three Python frames,
    on every hook call of every step."""
    compiler = getattr(torch, "compiler", None)
    if compiler is None or not hasattr(compiler, "disable") or not hasattr(compiler, "is_compiling"):
        return fn
    disabled: Callable[_P, _R] = compiler.disable(fn)
    ext, flags = compiled.get(), vars(compiler)
    callback = _eval_frame_callback()
    if ext is not None and hasattr(ext, "EagerHook") and type(flags.get("_is_compiling_flag")) is bool and callback:
        hook_c: Callable[_P, _R] = ext.EagerHook(fn, disabled, flags, callback)
        return hook_c
    is_compiling = compiler.is_compiling

    @functools.wraps(fn)
    def hook(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return hook


def _eval_frame_callback() -> Callable[[], Any] | None:
    """dynamo's getter of its frame callback (None in eager code, set inside a compiled region), where this torch
    has it (a private name: without it the Python wrapper serves)."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:
        return None
    return get_eval_frame_callback


_OUR_HOOK = -1  # the key of ampdoctor's hook in a tensor's hook dict (torch's handles count up from 0)


def grad_hook(t: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> None:
    """``t.register_hook(fn)`` for as long as t's graph lives, done the way torch's ``Tensor.register_hook`` does it
    but without the removable handle it makes (a Python object and an import per call, ~4x the time of the rest
    inside a training loop: 16-20 us against 5 measured on the CPU, per step on the root's output). A tensor that
    has hooks already, a subclass (its own __torch_function__) or a torch without these internals gets the public
    call."""
    if type(t) is torch.Tensor and t._backward_hooks is None:
        try:
            t._backward_hooks = OrderedDict(((_OUR_HOOK, fn),))
            node = t.grad_fn
            if node is not None:
                node._register_hook_dict(t)
            return
        except (AttributeError, RuntimeError):  # (internals renamed in some torch: the public way below)
            t._backward_hooks = None
    t.register_hook(fn)  # type: ignore[no-untyped-call]  # (unannotated in torch)
