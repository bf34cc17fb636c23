"""Never break training, and say what is wrong: the one guard around every entry from the training loop into
ampdoctor; what attach() refuses or warns about (wrapped optimizers, unwrapped; a second Doctor on the same
objects; values that are not numbers; runs whose step boundary or root forward never comes, with the fix)."""

from __future__ import annotations

import functools
import time
import weakref

import torch


def guarded(method=None, *, timed: bool = True):
    """The guard of every entry from training into a Doctor (hooks, wrapped methods, the step end, public calls):
    it does nothing once collection is off; an internal error stops collection (``Doctor._fail``: one warning, the
    hooks removed) instead of reaching the training loop; and, ``timed``, the time spent counts as ampdoctor's own
    (the step's observer_time). The method's result is passed on (a forward hook's None keeps the output)."""
    if method is None:
        return functools.partial(guarded, timed=timed)
    now = time.perf_counter

    if not timed:

        @functools.wraps(method)
        def guard(self, *args, **kwargs):
            if self._off:
                return None
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                self._fail(exc)
                return None

        return guard

    @functools.wraps(method)
    def timed_guard(self, *args, **kwargs):
        if self._off:
            return None
        t0 = now()
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            self._fail(exc)
            return None
        finally:
            self._obs += now() - t0

    return timed_guard


def is_scaler(obj) -> bool:
    return callable(getattr(obj, "scale", None)) and callable(getattr(obj, "update", None))


def as_number(value) -> float | None:
    """A metric value as a float (NaN and Inf included: they are data), or None when it is not one number."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        value = value.item()
    if isinstance(value, (bool, str, bytes, complex)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None


def no_boundary(boundary: str, what: str) -> str:
    """The warning for steps that went by without a step boundary, with the fix for this ``boundary``."""
    if boundary == "manual":
        fix = (
            "pass the optimizer that updates this model (attach(model, optimizer=opt)), or call doctor.step() "
            "after each optimizer step"
        )
    else:
        fix = (
            f"the {boundary} given to attach() never ended a step: pass the one that updates this model, "
            "or call doctor.step() after each optimizer step"
        )
    return f"ampdoctor: {what} went by without a step boundary, so no step was recorded; {fix}"


def no_forward(model_name: str, steps: int) -> str:
    """The warning for a run whose attached module's forward never runs."""
    return (
        f"ampdoctor: {steps} steps ended but {model_name}.forward was never called (e.g. a LightningModule "
        "whose training_step calls an inner model): step timing, batch sizes and the autocast state are not "
        "recorded. Attach the module whose forward runs (attach(lit.model, ...)), or use "
        "ampdoctor.integrations.lightning.AmpDoctorCallback"
    )


def unwrap_optimizer(optimizer):
    """The torch optimizer inside framework wrappers (accelerate's AcceleratedOptimizer keeps it in ``.optimizer``,
    Lightning's LightningOptimizer in ``._optimizer``): its step hooks are the ones that run. Returns (optimizer,
    the wrapper's GradScaler or None); TypeError when no torch optimizer is found."""
    scaler, seen, given = None, set(), optimizer
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if scaler is None:
            scaler = getattr(optimizer, "scaler", None)
        own = vars(optimizer) if hasattr(optimizer, "__dict__") else {}
        inner = next((own[k] for k in ("optimizer", "_optimizer") if hasattr(own.get(k), "param_groups")), None)
        if inner is not None:  # a wrapper, even one that subclasses the optimizer (LightningOptimizer)
            optimizer = inner
        elif isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks"):
            return optimizer, scaler
        else:
            break
    raise TypeError(
        f"Argument optimizer should be of type torch.optim.Optimizer (or a framework's wrapper of one), "
        f"but given {type(given)}"
    )


class Registry:
    """Which live Doctor observes which model, module, optimizer and scaler: a second Doctor on the same objects
    would record half the steps and, closed first, restore the other's wrappers. Weak keys: nothing kept alive."""

    def __init__(self):
        self._owner = weakref.WeakKeyDictionary()

    def claim(self, doctor, objects: list) -> None:
        """Refuse (RuntimeError) when one of ``objects`` belongs to another open Doctor; else claim them all."""
        for obj in objects:
            ref = self._owner.get(obj)
            other = ref() if ref is not None else None
            if other is not None and other is not doctor and other.active:
                raise RuntimeError(
                    f"ampdoctor: this {type(obj).__name__} is already observed by the Doctor writing {other.path}; "
                    "close() that one first (one Doctor per model, optimizer and scaler)"
                )
        me = weakref.ref(doctor)
        for obj in objects:
            self._owner[obj] = me

    def release(self, doctor) -> None:
        for obj, ref in list(self._owner.items()):
            if ref() is doctor or ref() is None:
                self._owner.pop(obj, None)


ATTACHED = Registry()
