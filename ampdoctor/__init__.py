"""ampdoctor: diagnose mixed-precision (FP16/BF16) training in PyTorch.

The offline side (load, Trace, diagnose) never imports torch; ``attach`` imports it on first use.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (types only: importing ampdoctor imports neither torch nor the rules)
    import torch

    from .collect.probe import ProbeReport
    from .collect.session import Doctor
    from .export.exporter import LiveExport
    from .integrations.env import NoDoctor
    from .notebook import Findings
    from .rules.result import Diagnosis
    from .trace import Trace

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


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ampdoctor' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def diagnose(trace_or_path: Any, reference: Any = None, rules: dict[str, Any] | None = None) -> Findings:
    """Run every registered rule over a trace (a Trace, a file, or a directory / glob of one run's ranks); findings
    worst first, as a list that a notebook shows as finding cards.

    ``reference``: an optional second trace (e.g. the same model in FP32) for the rules that compare.
    ``rules``: ``{rule_id: {threshold: value}}`` to re-threshold a rule, ``{rule_id: None}`` to disable it.
    """
    from .notebook import Findings
    from .rules import diagnose as _diagnose

    return Findings(_diagnose(trace_or_path, reference=reference, rules=rules))


def attach(
    model: torch.nn.Module,
    optimizer: Any = None,
    scaler: Any = None,
    trace: str | os.PathLike[str] = "runs/ampdoctor.db",
    *,
    mode: str = "default",
    every: int | None = None,
    peak_every: int | None = None,
    hist_every: int | None = None,
    weight_every: int = 200,
    calibration: int = 10,
    include: Any = None,
    exclude: Any = None,
    live: bool = True,
    on_finding: Callable[..., Any] | None = None,
    halt_on: str | None = None,
    on_halt: Callable[..., Any] | None = None,
    log_every: int | None = None,
    rules: dict[str, Any] | None = None,
    probe_every: int | None = None,
    replay: bool = True,
    heal: bool = False,
    budget: float | None = None,
    export: Any = None,
) -> Doctor:
    """Observe ``model`` during training and stream its mixed-precision numerics to the SQLite trace ``trace``.

    Returns a Doctor: a context manager whose ``close()`` removes every hook and flushes the trace.

    Args:
        model: the module whose ``forward`` the training loop calls.
        optimizer: its optimizer (or a framework's wrapper of one); its ``step()`` ends a step.
        scaler: the ``torch.amp.GradScaler``; with one, ``scaler.update()`` ends a step and the loss is read in
            ``scaler.scale(loss)``.
        trace: the trace file; ``{rank}`` becomes the distributed rank. An existing file is never overwritten.
        mode: ``"default"`` (the tiers: a sentinel every step, sampled sites, the first steps and the steps after an
            anomaly in full) or ``"debug"`` (every site in full every step).
        every: full statistics of every site every N steps (default 100; 1 in debug mode).
        peak_every: per-site peaks every N steps (default 10).
        hist_every: exponent histograms every N steps (default 200).
        weight_every: weights and optimizer updates every N steps.
        calibration: the first N steps observed in full.
        include, exclude: module name prefixes, globs, or a ``(path, module) -> bool`` predicate.
        live: run the rules while training (a background thread re-reading the trace).
        on_finding: called with each new live finding (an ``ampdoctor.Diagnosis``).
        halt_on: "info" | "warning" | "critical": at a live finding this severe, stop at the next step boundary.
        on_halt: called with that finding instead of raising ``TrainingHalted`` (frameworks ask to stop).
        log_every: a one-line health summary every N steps (logger ``ampdoctor``).
        rules: rule overrides for the live diagnosis, as for ``ampdoctor.diagnose``.
        probe_every: every N steps, recompute each observed module in FP32 and record its error (off by default).
        replay: re-run an anomalous step that observed no site in full, observing everything (nothing in training
            changes); see docs/recorded.md.
        heal: after a forward overflow in a module confirmed on two replays, keep that module in FP32 from the next
            step on (off by default; every intervention is recorded).
        budget: ampdoctor's share of the step time to stay under, by stretching the sampled tiers (e.g. 0.03).
        export: where the health figures go as they are written: ``"tensorboard:DIR"``, ``"wandb"``,
            ``"mlflow"``, or an exporter object (see docs/integrations.md).

    Example::

        with ampdoctor.attach(model, optimizer=opt, scaler=scaler, trace="runs/exp.db") as doctor:
            for x, y in loader:
                ...
    """
    from .collect.options import Options, parse_mode
    from .collect.session import Doctor

    options = Options(
        mode=parse_mode(mode),
        every=every,
        peak_every=peak_every,
        hist_every=hist_every,
        weight_every=weight_every,
        calibration=calibration,
        include=include,
        exclude=exclude,
        live=live,
        on_finding=on_finding,
        halt_on=halt_on,
        on_halt=on_halt,
        log_every=log_every,
        rules=rules,
        probe_every=probe_every,
        replay=replay,
        heal=heal,
        budget=budget,
        export=export,
    )
    if rules is not None:
        from .rules.engine import resolve_rules

        resolve_rules(rules)  # unknown ids or thresholds fail here, not in the live thread later
    return Doctor(
        model,
        optimizer,
        scaler,
        trace,
        options,
        diagnose=_live_diagnose,
        load_rules=_load_rules,
        exporter=_start_export,
    )


def _start_export(export: Any, path: str, findings: Any = None, rules: dict[str, Any] | None = None) -> LiveExport:
    """The exporters' thread for attach(export=...): made here, so that the training side never imports them."""
    from .export import start

    return start(export, path, findings=findings, rules=rules)


def _load_rules() -> None:
    """The rules' import, done by the live thread as it starts (see collect/live.py)."""
    from .rules import diagnose  # noqa: F401 (the engine, every rule and pandas come with it)


def _live_diagnose(trace: Trace, rules: dict[str, Any] | None = None) -> list[Diagnosis]:
    """The rules, as the training side's live thread runs them (imported there, not by collect/)."""
    from .rules import diagnose

    return diagnose(trace, rules=rules)


def auto(model: torch.nn.Module, optimizer: Any = None, scaler: Any = None, **options: Any) -> Doctor | NoDoctor:
    """The no-code switch: ``attach(model, ...)`` when the environment says ``AMPDOCTOR=1`` (the AMPDOCTOR_TRACE,
    _MODE, _EVERY, _HALT_ON, _LOG_EVERY, _LIVE, _EXPORT, _EXPORT_EVERY variables over ``options``), else a stand-in
    with the Doctor's public methods that does nothing. One line in a script:
    ``doctor = ampdoctor.auto(model, optimizer=opt, scaler=scaler)``."""
    from .integrations.env import auto as _auto

    return _auto(model, optimizer=optimizer, scaler=scaler, **options)


def probe(model: torch.nn.Module, batch: Any, loss_fn: Any = None, **options: Any) -> ProbeReport:
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
