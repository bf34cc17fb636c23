"""ampdoctor: diagnose mixed-precision (FP16/BF16) training in PyTorch.

The offline side (load, Trace, diagnose) never imports torch; ``attach`` imports it on first use.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .live import TrainingHalted
from .trace import Trace, TraceError
from .trace.run import RankRun, load, load_run   # load: a file gives a Trace, a directory or glob of ranks a RankRun


def attach(model, optimizer=None, scaler=None, trace: str = "runs/ampdoctor.db", **options):
    """Observe ``model`` during training and stream its mixed-precision numerics to the SQLite trace ``trace``.

    Options: mode ("default": a sentinel every step, sampled sites, the first steps and the steps after an anomaly
    in full; "debug": every site in full every step), every (full statistics cadence, default 100), peak_every
    (per-site peaks, 10), calibration (first steps in full, 10), hist_every (histograms, 200), weight_every (weights
    and updates, 200), include / exclude (module name prefixes, globs or a ``(path, module) -> bool`` predicate),
    live (run the rules while training, default True), on_finding (callback per new finding), halt_on
    ("info" | "warning" | "critical": raise TrainingHalted at the next step boundary), log_every (one-line health
    summary every N steps), rules (rule overrides for the live diagnosis, as for ``diagnose``).
    """
    from .collect.session import attach as _attach
    return _attach(model, optimizer=optimizer, scaler=scaler, trace=trace, **options)


# Imported eagerly (numpy/pandas only, as the trace reader): a lazy wrapper named like the subpackage would be
# replaced by the module object as soon as anything imports ampdoctor.diagnose.*.
from .diagnose import Diagnosis, diagnose  # noqa: E402
# Same reason for replay and keep_fp32 (functions named like their modules); keep_fp32 imports torch when called.
from .keep_fp32 import keep_fp32  # noqa: E402
from .replay import replay  # noqa: E402


__all__ = ["attach", "load", "load_run", "RankRun", "diagnose", "replay", "keep_fp32", "Trace", "TraceError", "Diagnosis",
           "TrainingHalted", "__version__"]
