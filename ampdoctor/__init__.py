"""ampdoctor: diagnose mixed-precision (FP16/BF16) training in PyTorch.

The offline side (load, Trace, diagnose) never imports torch; ``attach`` imports it on first use.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .trace import Trace, TraceError, load


def attach(model, optimizer=None, scaler=None, trace: str = "runs/ampdoctor.db", **options):
    """Observe ``model`` during training and stream its mixed-precision numerics to the SQLite trace ``trace``.

    Options: every (full statistics cadence, default 100), hist_every (histograms, 200), weight_every (weights and
    updates, 200), include / exclude (module name prefixes, globs or a ``(path, module) -> bool`` predicate).
    """
    from .collect.session import attach as _attach
    return _attach(model, optimizer=optimizer, scaler=scaler, trace=trace, **options)


def diagnose(trace_or_path, reference=None, rules=None):
    """Run the diagnosis rules over a trace; list of ``Diagnosis``, worst first (see ampdoctor.diagnose)."""
    from .diagnose.engine import diagnose as _diagnose
    return _diagnose(trace_or_path, reference=reference, rules=rules)


def __getattr__(name):
    if name == "Diagnosis":
        from .diagnose.engine import Diagnosis
        return Diagnosis
    raise AttributeError(f"module 'ampdoctor' has no attribute {name!r}")


__all__ = ["attach", "load", "diagnose", "Trace", "TraceError", "Diagnosis", "__version__"]
