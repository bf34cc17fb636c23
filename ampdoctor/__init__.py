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
    "keep_fp32": "ampdoctor.islands",
    "replay": "ampdoctor.lossscale",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ampdoctor' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def diagnose(trace_or_path, reference=None, rules: dict | None = None) -> list:
    """Run every registered rule over a trace (a Trace, a file, or a directory / glob of one run's ranks); findings
    worst first, as a list that a notebook shows as finding cards.

    ``reference``: an optional second trace (e.g. the same model in FP32) for the rules that compare.
    ``rules``: ``{rule_id: {threshold: value}}`` to re-threshold a rule, ``{rule_id: None}`` to disable it.
    """
    from .notebook import Findings
    from .rules import diagnose as _diagnose

    return Findings(_diagnose(trace_or_path, reference=reference, rules=rules))


def attach(model, optimizer=None, scaler=None, trace: str = "runs/ampdoctor.db", **options):
    """Observe ``model`` during training and stream its mixed-precision numerics to the SQLite trace ``trace``.

    Options: mode ("default": a sentinel every step, sampled sites, the first steps and the steps after an anomaly
    in full; "debug": every site in full every step), every (full statistics cadence, default 100), peak_every
    (per-site peaks, 10), calibration (first steps in full, 10), hist_every (histograms, 200), weight_every (weights
    and updates, 200), include / exclude (module name prefixes, globs or a ``(path, module) -> bool`` predicate),
    live (run the rules while training, default True), on_finding (callback per new finding), halt_on
    ("info" | "warning" | "critical": raise TrainingHalted at the next step boundary), log_every (one-line health
    summary every N steps), rules (rule overrides for the live diagnosis, as for ``diagnose``), probe_every
    (recompute every observed module in FP32 every N steps and record its half-precision error; off by default),
    export ("tensorboard:DIR", "wandb", "mlflow", "csv:DIR", "parquet:DIR", comma-joined, or sinks from
    ampdoctor.export: the health figures and findings, live; see docs/integrations.md), on_halt (a callable given the
    finding instead of raising TrainingHalted: the framework callbacks stop their Trainer with it).
    """
    from .collect.session import attach as _attach

    return _attach(model, optimizer=optimizer, scaler=scaler, trace=trace, **options)


def auto(model, optimizer=None, scaler=None, **options):
    """The no-code switch: ``attach(model, ...)`` when the environment says ``AMPDOCTOR=1`` (the AMPDOCTOR_TRACE,
    _MODE, _EVERY, _HALT_ON, _LOG_EVERY, _LIVE, _EXPORT, _EXPORT_EVERY variables over ``options``), else a stand-in
    with the Doctor's public methods that does nothing. One line in a script:
    ``doctor = ampdoctor.auto(model, optimizer=opt, scaler=scaler)``."""
    from .integrations.env import auto as _auto

    return _auto(model, optimizer=optimizer, scaler=scaler, **options)


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
    "auto",
    "diagnose",
    "keep_fp32",
    "load",
    "load_run",
    "probe",
    "replay",
]
