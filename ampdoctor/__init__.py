"""ampdoctor: diagnose mixed-precision (FP16/BF16) training in PyTorch.

The offline side (load, Trace, diagnose) never imports torch; ``attach`` imports it on first use.
"""
from __future__ import annotations

import importlib
import sys
import types

__version__ = "0.1.0"

# The public names, loaded on first use (``ampdoctor --version`` then imports neither pandas nor the rules).
# load: a file gives a Trace, a directory or glob of ranks a RankRun.
_LAZY = {"TrainingHalted": "ampdoctor.collect.live", "Trace": "ampdoctor.trace", "TraceError": "ampdoctor.trace.schema",
         "RankRun": "ampdoctor.trace.run", "load": "ampdoctor.trace.run", "load_run": "ampdoctor.trace.run",
         "Diagnosis": "ampdoctor.diagnose", "diagnose": "ampdoctor.diagnose", "keep_fp32": "ampdoctor.keep_fp32",
         "replay": "ampdoctor.replay"}
# functions named like their own modules: importing ampdoctor.diagnose.* must not replace ampdoctor.diagnose (the
# function) by the subpackage, as the import system does when it binds a loaded submodule to its parent
_FUNCTIONS = ("diagnose", "keep_fp32", "replay")


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ampdoctor' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    object.__setattr__(sys.modules[__name__], name, value)
    return value


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        if name in _FUNCTIONS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def attach(model, optimizer=None, scaler=None, trace: str = "runs/ampdoctor.db", **options):
    """Observe ``model`` during training and stream its mixed-precision numerics to the SQLite trace ``trace``.

    Options: mode ("default": a sentinel every step, sampled sites, the first steps and the steps after an anomaly
    in full; "debug": every site in full every step), every (full statistics cadence, default 100), peak_every
    (per-site peaks, 10), calibration (first steps in full, 10), hist_every (histograms, 200), weight_every (weights
    and updates, 200), include / exclude (module name prefixes, globs or a ``(path, module) -> bool`` predicate),
    live (run the rules while training, default True), on_finding (callback per new finding), halt_on
    ("info" | "warning" | "critical": raise TrainingHalted at the next step boundary), log_every (one-line health
    summary every N steps), rules (rule overrides for the live diagnosis, as for ``diagnose``), probe_every
    (recompute every observed module in FP32 every N steps and record its half-precision error; off by default).
    """
    from .collect.session import attach as _attach
    return _attach(model, optimizer=optimizer, scaler=scaler, trace=trace, **options)


def probe(model, batch, loss_fn=None, **options):
    """One-off precision-loss check: every module's half-precision output against its FP32 recomputation, and the
    loss both ways; nothing in the model changes. Returns a ProbeReport (print it). See collect/probe.py."""
    from .collect.probe import probe as _probe
    return _probe(model, batch, loss_fn, **options)


__all__ = ["attach", "load", "load_run", "RankRun", "diagnose", "replay", "keep_fp32", "probe", "Trace", "TraceError",
           "Diagnosis", "TrainingHalted", "__version__"]
