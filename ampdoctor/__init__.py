"""ampdoctor: diagnose mixed-precision (FP16/BF16) training in PyTorch.

The offline side (load, Trace, diagnose) never imports torch; ``attach`` imports it on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# The public names, loaded on first use (``ampdoctor --version`` then imports neither pandas nor the rules).
# Each lives in a module of another name (rules/, lossscale/, islands.py), so that importing a subpackage never
# replaces a function of the same name on this package. load: a file gives a Trace, a directory or glob a RankRun.
_LAZY = {
    "TrainingHalted": "ampdoctor.collect.live",
    "Trace": "ampdoctor.trace",
    "TraceError": "ampdoctor.trace.schema",
    "RankRun": "ampdoctor.trace.run",
    "load": "ampdoctor.trace.run",
    "load_run": "ampdoctor.trace.run",
    "Diagnosis": "ampdoctor.rules",
    "diagnose": "ampdoctor.rules",
    "keep_fp32": "ampdoctor.islands",
    "replay": "ampdoctor.lossscale",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ampdoctor' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


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


__all__ = [
    "Diagnosis",
    "RankRun",
    "Trace",
    "TraceError",
    "TrainingHalted",
    "__version__",
    "attach",
    "diagnose",
    "keep_fp32",
    "load",
    "load_run",
    "probe",
    "replay",
]
