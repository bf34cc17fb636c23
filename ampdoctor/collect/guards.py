"""Never break training, and say what is wrong: the one guard around every entry from the training loop into
ampdoctor; what attach() refuses or warns about (wrapped optimizers, unwrapped; a second Doctor on the same
objects; values that are not numbers; runs whose step boundary or root forward never comes, with the fix)."""

from __future__ import annotations

import functools
import math
import numbers
import time
import warnings
import weakref
from collections.abc import Callable

import torch


class Guard:
    """Collection's on/off switch and ampdoctor's own clock, shared by the parts that run inside training: an
    internal error anywhere turns collection off once (``fail``), and the time the guarded entries spend on the
    training thread adds up in ``observer_time`` until the step end takes it."""

    def __init__(self, on_fail: Callable[[BaseException], None]):
        self.off = False
        self.observer_time = 0.0  # host seconds inside ampdoctor on the training thread, this step
        self._on_fail = on_fail
        self._said: set[str] = set()

    def fail(self, exc: BaseException) -> None:
        """Never break training: stop collecting (the Doctor warns once and removes its hooks)."""
        if not self.off:
            self.off = True
            self._on_fail(exc)

    def take_time(self) -> float:
        """This step's observer time so far; the clock restarts at zero."""
        t, self.observer_time = self.observer_time, 0.0
        return t

    def warn_once(self, key: str, message: str, stacklevel: int = 4) -> None:
        if key not in self._said:
            self._said.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def guarded(method: Callable | None = None, *, timed: bool = True) -> Callable:
    """The guard of every entry from training into ampdoctor (hooks, wrapped methods, the step end, public calls),
    for methods of objects that hold the run's ``guard``: it does nothing once collection is off; an internal error
    stops collection (``Guard.fail``) instead of reaching the training loop; and, ``timed``, the time spent counts as
    ampdoctor's own (the step's observer_time). The method's result is passed on (a forward hook's None keeps the
    output)."""
    if method is None:
        return functools.partial(guarded, timed=timed)
    now = time.perf_counter

    if not timed:

        @functools.wraps(method)
        def guard(self, *args, **kwargs):
            g = self.guard
            if g.off:
                return None
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                g.fail(exc)
                return None

        return guard

    @functools.wraps(method)
    def timed_guard(self, *args, **kwargs):
        g = self.guard
        if g.off:
            return None
        t0 = now()
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            g.fail(exc)
            return None
        finally:
            g.observer_time += now() - t0

    return timed_guard


def is_scaler(obj) -> bool:
    return callable(getattr(obj, "scale", None)) and callable(getattr(obj, "update", None))


def as_number(value) -> float | None:
    """A metric value as a float (NaN and Inf included: they are data), or None when it is not one number. Whatever
    the conversion raises (a meta tensor, an object whose ``__float__`` fails) means "not a number": nothing a
    value does reaches the training loop."""
    try:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or value.is_complex() or value.is_meta:
                return None
            value = value.item()
        if isinstance(value, (bool, str, bytes, complex)):
            return None
        return float(value)
    except Exception:
        return None


# SQLite stores integers of 64 bits: a step number beyond is not a step of any run.
MAX_STEP = 2**63 - 1


def as_step(value) -> int | None:
    """A step number given by the user (``log_metric(..., step=)``) as an int, or None when it is not one."""
    try:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            return None
        step = int(value)
    except Exception:
        return None
    return step if 0 <= step <= MAX_STEP else None


def text(value: str) -> str:
    """A name as text SQLite can store: lone surrogates (a path or metric name built from undecodable bytes) are
    written as their escape, ``\\ud800``, instead of failing the trace's UTF-8 encoding."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")


def finite_or_none(v: float | None) -> bool:
    return v is None or math.isfinite(v)


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
