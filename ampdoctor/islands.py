"""``ampdoctor.keep_fp32``: run chosen modules in FP32 inside an autocast region (the medicine for a forward overflow
or an FP32-only operation computed in half precision).

torch is imported inside the functions, so ``import ampdoctor`` stays free of torch.
"""

from __future__ import annotations

import difflib
import types

from .trace.schema import ROOT  # how the root module is named in site paths

_HALF = ("float16", "bfloat16")


def code_line(paths) -> str:
    """The line a fix prints to keep ``paths`` in FP32 (the rules and the probe's report print this one)."""
    quoted = ", ".join(f'"{p}"' for p in paths)
    return f"handle = ampdoctor.keep_fp32(model, {quoted})  # these modules compute in FP32 inside autocast"


class KeptFP32:
    """Handle returned by ``keep_fp32``: a context manager; ``remove()`` restores every wrapped forward exactly."""

    def __init__(self, model, paths: tuple):
        self.model = model
        self.paths = paths
        self._wrapped: list = []  # (module, state of its wrapper)

    def _wrap(self, module) -> None:
        state = {"active": True}
        had = "forward" in module.__dict__
        previous = module.__dict__.get("forward")
        inner = previous if had else type(module).forward
        fn = _fp32_forward(inner, had, state)
        fn._ampdoctor_undo = (had, previous, state)
        # A method bound to the module (not a closure over it): copy.deepcopy(model), e.g. for an EMA copy, rebinds
        # the wrapper to the copy instead of running the original module's weights.
        module.__dict__["forward"] = types.MethodType(fn, module)
        self._wrapped.append((module, state))

    @property
    def active(self) -> bool:
        return bool(self._wrapped)

    def remove(self) -> None:
        """Undo: every wrapped module's forward is again what it was. Idempotent. When another wrapper was put on
        top since, that one is kept and ours below it only passes calls through."""
        while self._wrapped:
            module, state = self._wrapped.pop()
            state["active"] = False
            _unwind(module)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def __repr__(self) -> str:
        return f"KeptFP32({', '.join(self.paths)}{'' if self.active else '; removed'})"


def _unwind(module) -> None:
    """Pop every inactive keep_fp32 wrapper off the top of ``module.forward``, restoring what each replaced."""
    while True:
        undo = getattr(getattr(module.__dict__.get("forward"), "__func__", None), "_ampdoctor_undo", None)
        if undo is None or undo[2]["active"]:
            return
        had, previous, _ = undo
        if had:
            module.__dict__["forward"] = previous
        else:
            del module.__dict__["forward"]


def _fp32_forward(inner, bound: bool, state: dict):
    def forward(self, *args, **kwargs):
        import torch

        call = (lambda *a, **k: inner(*a, **k)) if bound else (lambda *a, **k: inner(self, *a, **k))
        if not state["active"]:
            return call(*args, **kwargs)
        device_type = _device_type(args, kwargs, self)
        if not _autocast_enabled(torch, device_type):
            return call(*args, **kwargs)  # outside autocast nothing is changed
        args, kwargs = _to_float32(torch, args), _to_float32(torch, kwargs)
        with torch.autocast(device_type, enabled=False):
            return call(*args, **kwargs)

    return forward


def _device_type(args, kwargs, module) -> str:
    """The device type of the first floating input tensor (else the module's first parameter, else cpu)."""
    import torch

    stack = [args, kwargs]
    while stack:
        x = stack.pop(0)
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():
                return x.device.type
        elif isinstance(x, (list, tuple)):
            stack[:0] = list(x)
        elif isinstance(x, dict):
            stack[:0] = list(x.values())
    for p in module.parameters():
        return p.device.type
    return "cpu"


def _autocast_enabled(torch, device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no device_type argument
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def _to_float32(torch, x):
    """FP16/BF16 tensors (nested in tuples, lists, dicts) cast to float32; anything else as it is."""
    if isinstance(x, torch.Tensor):
        return x.float() if str(x.dtype).replace("torch.", "") in _HALF else x
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(_to_float32(torch, v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_to_float32(torch, v) for v in x)
    if isinstance(x, dict):
        return type(x)((k, _to_float32(torch, v)) for k, v in x.items())
    return x


def keep_fp32(model, *module_paths: str) -> KeptFP32:
    """Run the modules at ``module_paths`` (as in ``model.named_modules()``; "(model)" is the root) in FP32 inside
    an autocast region: their floating inputs are cast to float32, autocast is disabled inside, and their outputs
    stay FP32. Outside autocast they run unchanged. Returns a handle (a context manager); ``remove()`` undoes it.

    Parameters stored in half precision (``model.half()``) are not converted: call ``.float()`` on those modules too.
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"Argument model should be of type torch.nn.Module, but given {type(model)}")
    if not module_paths:
        raise ValueError('keep_fp32 needs at least one module path, e.g. keep_fp32(model, "blocks.1.attn")')
    names = dict(model.named_modules())
    names[ROOT] = model
    paths, modules = [], {}
    for path in module_paths:
        if not isinstance(path, str):
            raise TypeError(
                f"Argument module_paths should be module paths (str) as in model.named_modules(), "
                f"but given {type(path)}"
            )
        if path not in names:
            close = difflib.get_close_matches(path, [n for n in names if n], n=3, cutoff=0.5)
            hint = (
                f"; did you mean {', '.join(repr(c) for c in close)}?"
                if close
                else "; see model.named_modules() for the paths"
            )
            raise ValueError(f"no module {path!r} in {type(model).__name__}{hint}")
        if path not in paths:
            paths.append(path)
            modules.setdefault(id(names[path]), names[path])  # a module shared under two names: wrapped once
    handle = KeptFP32(model, tuple(paths))
    for module in modules.values():
        handle._wrap(module)
    return handle
