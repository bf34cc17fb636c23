"""Rules over a trace: what is wrong with a mixed-precision run, which layer, the evidence, and the fix."""

from __future__ import annotations

import contextlib
import os
from typing import Union

from ..severity import SEVERITIES
from ..trace import Trace
from ..trace.run import RankRun
from ..trace.run import load as load_any
from .engine import RuleOptions, Run, diagnose_trace, resolve_rules
from .multirank import diagnose_ranks
from .registry import RULES
from .result import Diagnosis, Rule

# What diagnose reads: a Trace or RankRun, a trace's path, or a directory, glob or list of one run's rank traces.
TraceSource = Union[Trace, RankRun, str, "os.PathLike[str]", list[str], tuple[str, ...]]

__all__ = ["RULES", "SEVERITIES", "Diagnosis", "Rule", "Run", "diagnose"]


def diagnose(
    trace_or_path: TraceSource, reference: TraceSource | None = None, rules: RuleOptions | None = None
) -> list[Diagnosis]:
    """Run every registered rule over a trace; findings worst first.

    ``reference``: an optional second trace (e.g. the same model in FP32) for the rules that compare.
    ``rules``: ``{rule_id: {threshold: value}}`` to re-threshold a rule, ``{rule_id: None}`` to disable it.
    """
    selected = resolve_rules(rules)
    tr = _as_trace(trace_or_path, "trace_or_path")
    ref = _as_trace(reference, "reference") if reference is not None else None
    if isinstance(tr, RankRun) or isinstance(ref, RankRun):  # a directory or glob of one run's ranks
        return diagnose_ranks(tr, ref, selected)
    # One consistent state of each file: a trace being written grows between the reads of different tables.
    with tr.snapshot(), ref.snapshot() if ref is not None else contextlib.nullcontext():
        return diagnose_trace(tr, ref, selected)


def _as_trace(obj: object, what: str) -> Trace | RankRun:
    if isinstance(obj, (Trace, RankRun)):
        return obj
    if isinstance(obj, (str, os.PathLike, list, tuple)):
        return load_any(obj)
    raise TypeError(f"Argument {what} should be of type ampdoctor.Trace or a path (str), but given {type(obj)}")
