"""ampdoctor: diagnose mixed-precision (FP16/BF16) training in PyTorch.

The offline side (load, Trace, diagnose) never imports torch; ``attach`` imports it on first use.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .trace import Trace, TraceError, load


def attach(model, optimizer=None, scaler=None, trace: str = "runs/ampdoctor.db", **options):
    """Observe ``model`` during training and stream its mixed-precision numerics to the SQLite trace ``trace``.

    Options: every (full statistics cadence, default 10), hist_every (histograms, 50), weight_every (weights and
    updates, 100), include / exclude (module name prefixes, globs or a ``(path, module) -> bool`` predicate).
    """
    from .collect.session import attach as _attach
    return _attach(model, optimizer=optimizer, scaler=scaler, trace=trace, **options)


__all__ = ["attach", "load", "Trace", "TraceError", "__version__"]
