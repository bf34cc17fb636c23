"""Precision-loss probe: each observed module's forward recomputed in FP32 from the same inputs, compared with the
half-precision output it produced. Runs on probed steps only (``attach(probe_every=N)``) or once (``probe``).

The recomputation must not change training: it runs under ``no_grad`` with autocast disabled, on upcast copies of
the inputs, parameters and buffers (``torch.func.functional_call``: a BatchNorm updates running statistics of a
copy), with the RNG state the module's forward started from (so a dropout draws the same mask) and the state after
it put back. Errors stay on the device until the step's end (one transfer); no tensor is kept after the step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import roundoff
from ..trace.messages import ProbeMsg
from . import hooks
from .recompute import HALF, Recorder, rng_get, rng_set, summarize
from .sites import Sites


class StepProbe:
    """The probe of a Doctor: arms at the first forward of every ``every``-th step, reports at the step's end."""

    def __init__(
        self,
        modules: list[tuple[str, torch.nn.Module]],
        sites: Sites,
        put: Callable,
        on_error: Callable[[BaseException], None],
        every: int,
    ):
        self.modules = modules
        self.sites = sites
        self.put = put
        self.on_error = on_error
        self.every = every
        self._rec: Recorder | None = None

    def begin(self, step: int, args, kwargs) -> None:
        if step % self.every == 0 and self._rec is None:
            self._rec = Recorder(self.modules, on_error=self.on_error)
            self._rec.arm(args, kwargs)

    def end(self, step: int) -> None:
        rec, self._rec = self._rec, None
        if rec is None:
            return
        rows, skipped = summarize(rec.disarm())
        mods = dict(self.modules)
        out = []
        for r in rows:
            sid = self.sites.act.get(r["path"])
            if sid is None:
                sid = self.sites.get(r["path"], "act", mods.get(r["path"]), None, step)
            out.append(
                (
                    step,
                    sid,
                    r["calls"],
                    r["k"],
                    r["numel"],
                    r["dtype"],
                    r["rel_err"],
                    r["max_err"],
                    r["ref_norm"],
                    r["ref_absmax"],
                )
            )
        self.put(ProbeMsg(step, out, {"skipped": skipped}))

    def disarm(self) -> None:
        """Undo the hooks of a probed step in progress (close() or a failure in the middle of a step)."""
        if self._rec is not None:
            self._rec.disarm()
            self._rec = None


# -- the one-off probe -----------------------------------------------------------------------------------------------
@dataclass
class ProbeReport:
    """What ``ampdoctor.probe`` measured: per module, the half-precision output's error against FP32; the loss both
    ways; the modules it could not recompute."""

    dtype: str
    layers: list = field(default_factory=list)  # dicts: path, module_type, dtype, k, numel, rel_err, max_err, ...
    loss_half: float | None = None
    loss_fp32: float | None = None
    skipped: dict = field(default_factory=dict)

    @property
    def flagged(self) -> list[dict]:
        """The layers the ``precision-loss`` rule would name, worst first."""
        return roundoff.judge(self.layers, self.dtype)

    @property
    def fix(self) -> str:
        return roundoff.fix_line([r["path"] for r in self.flagged])

    def __str__(self) -> str:
        lines = [roundoff.format_table(self.layers, self.dtype)]
        if self.loss_half is not None:
            diff = roundoff.relative(abs(self.loss_half - self.loss_fp32), abs(self.loss_fp32))
            lines.append(
                f"loss: {self.loss_half:.6g} in {self.dtype}, {self.loss_fp32:.6g} in float32 "
                f"(relative difference {diff:.2e})"
            )
        for path, why in self.skipped.items():
            lines.append(f"skipped {path}: {why}")
        flagged = self.flagged
        lines.append(
            f"precision loss in {', '.join(r['path'] for r in flagged)}; fix:\n{self.fix}"
            if flagged
            else "no layer loses more precision than its size explains"
        )
        return "\n".join(lines)


def _split(batch, loss_fn):
    if loss_fn is not None and isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1], True
    return batch, None, False


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def probe(model, batch, loss_fn=None, *, dtype=None, include=None, exclude=None) -> ProbeReport:
    """Measure once, without training: run ``model`` on ``batch`` in half precision and every observed module again
    in FP32 from the same inputs. ``batch``: the model input (tensor, tuple of arguments or dict of keyword
    arguments) or, with loss_fn, an ``(inputs, targets)`` pair; ``loss_fn(output, targets)`` (or ``loss_fn(output)``)
    adds the loss both ways. ``dtype``: the autocast dtype (default float16) when the caller has not entered
    autocast and the model holds FP32 weights. Weights, buffers (BatchNorm running statistics), gradients and the
    RNG are left as they were.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"Argument model should be of type torch.nn.Module, but given {type(model)}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"Argument loss_fn should be callable, but given {type(loss_fn)}")
    inputs, targets, paired = _split(batch, loss_fn)
    x = hooks.first_tensor(
        inputs if isinstance(inputs, (tuple, list)) else (inputs,), inputs if isinstance(inputs, dict) else None
    )
    device = x.device.type if x is not None else "cpu"
    params = list(model.parameters())
    half_params = any(p.dtype in HALF for p in params)
    caller_autocast = torch.is_autocast_enabled(device)
    if caller_autocast:
        run_dtype = torch.get_autocast_dtype(device)
    elif half_params:
        run_dtype = next(p.dtype for p in params if p.dtype in HALF)
    else:
        run_dtype = dtype or torch.float16
    rec = Recorder(hooks.select_modules(model, include, exclude), need_grad=False, keep_root=True)
    buffers = [(b, b.clone()) for b in model.buffers()]
    rng = rng_get(x.device if x is not None else None)
    rec.arm()
    try:
        with torch.no_grad():
            with torch.autocast(device, dtype=run_dtype, enabled=not half_params or caller_autocast):
                out = _call(model, inputs)
                loss = (loss_fn(out, targets) if paired else loss_fn(out)) if loss_fn is not None else None
            loss_ref = None
            if loss_fn is not None and rec.root_ref is not None:
                with torch.autocast(device, enabled=False):
                    ref = rec.root_ref
                    loss_ref = loss_fn(ref, targets) if paired else loss_fn(ref)
        calls = rec.disarm()
    finally:
        rec.disarm()
        for b, saved in buffers:  # the half-precision forward's BatchNorm updates undone
            b.copy_(saved)
        rng_set(rng)
    rows, skipped = summarize(calls)
    report = ProbeReport(str(run_dtype).replace("torch.", ""), rows, skipped=skipped)
    if loss is not None and loss_ref is not None:
        report.loss_half, report.loss_fp32 = float(loss.float()), float(loss_ref.float())
    elif loss_fn is not None and rec.root_ref is None:
        warnings.warn(
            "ampdoctor.probe: the model's output could not be recomputed in FP32; no loss comparison",
            RuntimeWarning,
            stacklevel=2,
        )
    return report
