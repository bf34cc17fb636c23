"""The diagnosis engine: the cached view of a run that rules read (Run), the rule selection, the one place a rule is
run (and its result normalised, or its error reported), and the table of rules run over one trace.

A rule is a function ``check(run, **thresholds) -> Diagnosis | list[Diagnosis] | None``; its keyword-only
arguments are its thresholds (defaults are named constants in the rule's module). The registry (registry.py)
maps stable ids to these functions and declares which rules' findings hide which (``suppressed_by``); a rule body
never asks for another rule's findings. Evidence that several rules read lives on the Run (cached properties).
``ampdoctor.rules.diagnose`` is the entry point (one trace, or the ranks of a run through multirank.py). Offline
side: no torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt
import pandas as pd

from .. import formats
from ..trace import Trace, TraceError
from ..trace.view import View
from . import registry
from .result import Diagnosis, Rule, python_values, rule_error, worst_first
from .runview import Blowup, FloatArray, IntArray, Origins, WeightFault

if TYPE_CHECKING:
    from ..lossscale import GradientPeaks, Suggestion

# What ``diagnose(rules=...)`` takes per rule id: threshold overrides, or None/False to hide the rule (True: as is).
RuleOptions = dict[str, "dict[str, float] | bool | None"]


class Selected(NamedTuple):
    """One registry entry as the user selected it: its threshold overrides, and whether its findings are shown (a
    rule the user disabled is still computed where another rule's findings are suppressed by it)."""

    rule: Rule
    over: dict[str, float]
    shown: bool = True


class Run:
    """What rules read: a trace plus cached views of it (steps, sites, per-site arrays, configuration), read through a
    trace.view.View: bounded samples of the full-statistics and histogram steps, one pass over the peaks."""

    def __init__(
        self, trace: Trace, reference: Run | None = None, rules: RuleOptions | list[Selected] | None = None
    ) -> None:
        self.trace = trace
        self.view = View(trace)
        self.reference = reference  # a second run to compare with (slow-convergence)
        self._records: dict[tuple[str, str], FloatArray] = {}
        self.ranks: dict[int, Run] = {}  # every rank of the run, self included, for the rank rules
        # rules: {id: thresholds or None} as diagnose() takes it, or resolve_rules()'s list
        selected = rules if isinstance(rules, list) else resolve_rules(rules)
        self._selected = {s.rule.id: Selected(*s) for s in selected}
        self._results: dict[str, list[Diagnosis]] = {}
        self.errors: dict[str, Diagnosis] = {}  # rule id -> the notice shown in place of a rule that raised
        self._running: set[str] = set()

    # -- rules over this run ----------------------------------------------------------------------------------------
    def findings_of(self, rule_id: str) -> list[Diagnosis]:
        """The findings one rule computes over this run with the user's thresholds, shown or not (a disabled rule
        is computed too: suppression reads it); [] for an id not in the registry, or a rule that raised."""
        if rule_id in self._results:
            return self._results[rule_id]
        entry = self._selected.get(rule_id)
        if entry is None or rule_id in self._running:
            return []  # not a rule of this registry (or a dependency cycle: no evidence either way)
        self._running.add(rule_id)
        try:
            out, error = run_rule(entry.rule, self, entry.over)
        finally:
            self._running.discard(rule_id)
        if error is not None:
            self.errors[rule_id] = error
        self._results[rule_id] = out
        return out

    def shown_findings(self, rule: Rule) -> list[Diagnosis]:
        """A rule's findings less those a rule it is ``suppressed_by`` explains (that rule computed, shown or not).
        A rule hidden whatever it finds (an unconditional suppressor found something) is not run for display."""
        if any(s.when is None and self.findings_of(s.by) for s in rule.suppressed_by):
            return []
        return [
            d
            for d in self.findings_of(rule.id)
            if not any(s.hides(d, self.findings_of(s.by)) for s in rule.suppressed_by)
        ]

    def threshold(self, rule_id: str, name: str) -> float:
        """A rule's threshold as the user set it (else its default): evidence shared through the Run honours it."""
        entry = self._selected.get(rule_id)
        rule = entry.rule if entry is not None else registry.RULES[rule_id]
        over = entry.over if entry is not None else {}
        value: float = over.get(name, rule.thresholds[name])
        return value

    # -- the gradient evidence the rules share with the replay (one definition) --------------------------------------
    @cached_property
    def gradient_peaks(self) -> GradientPeaks:
        """replay.GradientPeaks of this run: the largest unscaled gradients, as the replay reads them."""
        from ..lossscale import gradient_peaks

        return gradient_peaks(self.view)

    @cached_property
    def suggestion(self) -> Suggestion | None:
        """replay.suggest over this run: the scaler settings every rule that suggests a scale quotes; None when the
        replay cannot start from the scaler settings the trace records (out of range: a rule that needs it then
        has no evidence, and says nothing)."""
        from ..lossscale import suggest

        try:
            return suggest(self.view)
        except (ValueError, OverflowError, TypeError):
            return None

    # -- tables --------------------------------------------------------------------------------------------------
    @property
    def steps(self) -> pd.DataFrame:
        return self.view.steps

    @property
    def meta(self) -> dict[str, Any]:
        return self.view.meta

    @property
    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = self.meta.get("config", {}) or {}
        return config

    @property
    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.meta.get("run", {}) or {}
        return info

    def sites(self, kind: str) -> pd.DataFrame:
        return self.view.sites(kind)

    @property
    def stat_steps(self) -> IntArray:
        """The full-statistics steps the rules read statistics at (all of them, or View.MAX_STEPS evenly spaced)."""
        return self.view.stat_steps

    def stat(self, fld: str, kind: str) -> FloatArray:
        """[stat_steps x sites] of one full statistic (NaN where a site has none at a step)."""
        return self.view.stat(fld, kind)

    def records(self, fld: str, kind: str) -> FloatArray:
        """[steps x sites] of one statistic, aligned with ``steps``: a trace still being written may have grown
        between the two reads, so rows are cut (or NaN-padded) to the steps this view holds. Dense: for short runs
        (the rules read ``stat`` and ``view.scan`` instead)."""
        key = (fld, kind)
        if key not in self._records:
            arr = self.trace.records(fld, kind)
            n = self.n_steps
            if len(arr) > n:
                arr = arr[:n]
            elif len(arr) < n:
                arr = np.vstack([arr, np.full((n - len(arr), arr.shape[1]), np.nan)])
            self._records[key] = arr
        return self._records[key]

    def at(self, fld: str, kind: str, steps: Iterable[int] | npt.ArrayLike) -> FloatArray:
        """[len(steps) x sites] of one statistic at these steps (NaN where none, or beyond the steps this view
        holds): what a rule reads around given steps of a run of any length."""
        rows = np.asarray(steps, dtype=np.int64)
        out: FloatArray = self.trace.records(fld, kind, steps=rows)
        out[rows >= self.n_steps] = np.nan
        return out

    @cached_property
    def events(self) -> pd.DataFrame:
        return self.trace.events("nonfinite")

    @cached_property
    def weight_events(self) -> pd.DataFrame:
        """Steps after whose optimizer update some weights held NaN/Inf (data["params"] names them)."""
        return self.trace.events("nonfinite_weights")

    @cached_property
    def metrics(self) -> pd.DataFrame:
        return self.trace.metrics()

    @property
    def full_steps(self) -> IntArray:
        """Every step with full statistics."""
        return self.view.full_steps

    # -- precision configuration ---------------------------------------------------------------------------------
    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def autocast(self) -> dict[str, Any]:
        autocast: dict[str, Any] = self.config.get("autocast", {}) or {}
        return autocast

    @property
    def scaler(self) -> dict[str, Any]:
        scaler: dict[str, Any] = self.config.get("scaler") or {}
        return scaler

    @property
    def scaler_on(self) -> bool:
        return bool(self.scaler.get("enabled"))

    @cached_property
    def compute_dtype(self) -> str | None:
        """The reduced dtype the model computed in (autocast dtype, else the dominant half activation dtype)."""
        ac = self.autocast
        if ac.get("enabled") and ac.get("dtype") in formats.REDUCED:
            return str(ac["dtype"])
        acts = self.sites("act")
        half = acts[acts["dtype"].isin(formats.REDUCED)]
        if len(half):
            return str(half["dtype"].mode().iloc[0])
        return None

    @property
    def fp16(self) -> bool:
        return self.compute_dtype == "float16"

    @cached_property
    def module_types(self) -> dict[str, str]:
        """module path -> module class name (from the activation sites)."""
        acts = self.sites("act")
        return dict(zip(acts["path"].tolist(), acts["module_type"].tolist()))

    # -- device --------------------------------------------------------------------------------------------------
    @property
    def device(self) -> str:
        return str(self.info.get("device") or "cpu")

    @property
    def bf16_supported(self) -> bool:
        return bool(self.info.get("bf16_supported", self.device == "cpu"))

    @property
    def capability(self) -> tuple[int, ...] | None:
        cap = self.info.get("capability")
        return tuple(cap) if cap else None

    # -- helpers -------------------------------------------------------------------------------------------------
    def step_range(self, steps: Iterable[Any]) -> list[int]:
        ints = [int(s) for s in steps]
        return [min(ints), max(ints)] if ints else []

    # -- evidence several rules read (computed once, with the thresholds of the rule it belongs to) ------------------
    @cached_property
    def weight_faults(self) -> dict[str, WeightFault]:
        """Weight matrices whose RMS is far off 1/sqrt(fan_in) at their first record (grad-range-anomaly's
        ``weight_decades``): parameter path -> {"rms", "fan_in_rms", "ratio", "module"}."""
        from .weights import weight_faults

        return weight_faults(self, self.threshold("grad-range-anomaly", "weight_decades"))

    @cached_property
    def blowup(self) -> Blowup | None:
        """What the updates did to the weights before the first non-finite step (divergence.Blowup; None without
        non-finite steps after a finite start), with divergence's thresholds: divergence decides by it, and
        forward-overflow says when it points that way without deciding."""
        from .divergence import blowup

        names = ("max_update_ratio", "jump_binades", "growth_binades")
        return blowup(self, **{n: self.threshold("divergence", n) for n in names})

    @cached_property
    def overflow_origins(self) -> Origins | None:
        """The forward overflows of this run traced back to the modules that produced the values
        (overflow.origins; None without a forward non-finite event)."""
        from .overflow import origins

        return origins(self)

    @cached_property
    def replays(self) -> list[dict[str, Any]]:
        """The replay events' data, one per replayed step (anomaly.replay_data)."""
        from .anomaly import replay_data

        return replay_data(self.trace)

    @cached_property
    def probes(self) -> pd.DataFrame:
        """The run's probe table (Trace.probes), read once."""
        return self.trace.probes()


def resolve_rules(rules: RuleOptions | None) -> list[Selected]:
    """Every registry entry with its threshold overrides; ``rules={id: None}`` (or False) hides a rule's findings
    (``shown`` False: it is computed only where another rule is suppressed by it)."""
    if rules is not None and not isinstance(rules, dict):
        raise TypeError(f"Argument rules should be of type dict, but given {type(rules)}")
    options = dict(rules or {})
    unknown = [k for k in options if k not in registry.RULES]
    if unknown:
        raise ValueError(f"Unknown rule id {unknown[0]!r}; known: {', '.join(registry.RULES)}")
    out = []
    for rid, rule in registry.RULES.items():
        over = options.get(rid, {})
        if over is None or over is False:
            out.append(Selected(rule, {}, False))
            continue
        if over is True:
            over = {}
        if not isinstance(over, dict):
            raise TypeError(f"Argument rules[{rid!r}] should be a dict of thresholds or None, but given {type(over)}")
        known = rule.thresholds
        bad = [k for k in over if k not in known]
        if bad:
            raise ValueError(f"Rule {rid!r} has no threshold {bad[0]!r}; its thresholds: {', '.join(known) or 'none'}")
        out.append(Selected(rule, over))
    return out


def run_rule(rule: Rule, run: Run, over: dict[str, float]) -> tuple[list[Diagnosis], Diagnosis | None]:
    """The one place a rule runs: (its findings with its id and plain evidence, no evidence no finding; None), or
    for a rule that raised ([], the notice shown in its place): one rule never takes the whole diagnosis down."""
    try:
        result = rule.check(run, **over)
        found = [] if result is None else (result if isinstance(result, list) else [result])
        return [replace(d, rule=rule.id, evidence=python_values(d.evidence)) for d in found if d.evidence], None
    except Exception as exc:  # any error of one rule is reported, and the others run
        return [], rule_error(rule, exc)


def diagnose_trace(tr: Trace, ref: Trace | None, selected: list[Selected]) -> list[Diagnosis]:
    """The shown findings of the per-trace rules over one trace (against an optional reference), worst first."""
    return trace_findings(tr, ref, selected)[0]


def trace_findings(
    tr: Trace, ref: Trace | None, selected: list[Selected], first: Callable[[Run], None] | None = None
) -> tuple[list[Diagnosis], Run]:
    """``diagnose_trace``'s findings and the Run they were read through: its View keeps what the rules read (the
    steps, the sampled statistics and histograms, the pass over the peaks) for a caller that shows them (the
    report). ``first(run)``: called before the rules run (what a caller shows from the same reads, sooner)."""
    selected = [Selected(*s) for s in selected]
    run = Run(tr, Run(ref, rules=selected) if ref is not None else None, rules=selected)
    if run.n_steps == 0:
        raise TraceError(f"{tr.path}: no steps recorded; nothing to diagnose")
    if first is not None:
        first(run)
    out: list[Diagnosis] = []
    for s in selected:
        if s.shown and s.rule.scope == "trace":
            out += run.shown_findings(s.rule)
            if s.rule.id in run.errors:
                out.append(run.errors[s.rule.id])
    return worst_first(out, {s.rule.id: i for i, s in enumerate(selected)}), run
