"""The diagnosis engine: the cached view of a run that rules read (Run), the rule selection, and the table of
rules run over one trace.

A rule is a function ``check(run, **thresholds) -> Diagnosis | list[Diagnosis] | None``; its keyword-only
arguments are its thresholds (defaults are named constants in the rule's module). The registry (registry.py)
maps stable ids to these functions; ``ampdoctor.rules.diagnose`` is the entry point (one trace, or the ranks of
a run through multirank.py). Offline side: no torch import.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property

import numpy as np
import pandas as pd

from .. import formats
from ..severity import RANK as _RANK
from ..trace import Trace, TraceError
from ..trace.view import View
from . import registry
from .result import Diagnosis, Rule, _py


class Run:
    """What rules read: a trace plus cached views of it (steps, sites, per-site arrays, configuration), read through a
    trace.view.View: bounded samples of the full-statistics and histogram steps, one pass over the peaks."""

    def __init__(self, trace: Trace, reference: Run | None = None, rules: dict | None = None):
        self.trace = trace
        self.view = View(trace)
        self.reference = reference  # a second run to compare with (slow-convergence)
        self._records: dict = {}
        self.ranks: dict[int, Run] = {}  # every rank of the run, self included, for the rank rules
        # rules: {id: thresholds or None} as diagnose() takes it, or resolve_rules()'s list
        selected = rules if isinstance(rules, list) else resolve_rules(rules)
        self._selected = {rule.id: (rule, over) for rule, over in selected}
        self._results: dict = {}
        self._running: set = set()

    # -- rules over this run: a rule that depends on another asks here, so the user's thresholds reach it ------------
    def findings_of(self, rule_id: str) -> list:
        """The findings of one rule over this run (with the user's thresholds); [] when the user disabled it."""
        if rule_id in self._results:
            return self._results[rule_id]
        if rule_id not in self._selected or rule_id in self._running:
            return []  # disabled (or a dependency cycle: no evidence either way)
        rule, over = self._selected[rule_id]
        self._running.add(rule_id)
        try:
            result = rule.check(self, **over)
        finally:
            self._running.discard(rule_id)
        found = [] if result is None else (result if isinstance(result, list) else [result])
        out = [replace(d, rule=rule.id, evidence=_py(d.evidence)) for d in found if d.evidence]
        self._results[rule_id] = out  # DESIGN principle 4: no evidence, no finding
        return out

    # -- the gradient evidence the rules share with the replay (one definition) --------------------------------------
    @cached_property
    def gradient_peaks(self):
        """replay.GradientPeaks of this run: the largest unscaled gradients, as the replay reads them."""
        from ..lossscale import gradient_peaks

        return gradient_peaks(self.view)

    @cached_property
    def suggestion(self):
        """replay.suggest over this run: the scaler settings every rule that suggests a scale quotes."""
        from ..lossscale import suggest

        return suggest(self.view)

    # -- tables --------------------------------------------------------------------------------------------------
    @property
    def steps(self) -> pd.DataFrame:
        return self.view.steps

    @property
    def meta(self) -> dict:
        return self.view.meta

    @property
    def config(self) -> dict:
        return self.meta.get("config", {}) or {}

    @property
    def info(self) -> dict:
        return self.meta.get("run", {}) or {}

    def sites(self, kind: str) -> pd.DataFrame:
        return self.view.sites(kind)

    @property
    def stat_steps(self) -> np.ndarray:
        """The full-statistics steps the rules read statistics at (all of them, or View.MAX_STEPS evenly spaced)."""
        return self.view.stat_steps

    def stat(self, fld: str, kind: str) -> np.ndarray:
        """[stat_steps x sites] of one full statistic (NaN where a site has none at a step)."""
        return self.view.stat(fld, kind)

    def records(self, fld: str, kind: str) -> np.ndarray:
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
    def full_steps(self) -> np.ndarray:
        """Every step with full statistics."""
        return self.view.full_steps

    # -- precision configuration ---------------------------------------------------------------------------------
    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def autocast(self) -> dict:
        return self.config.get("autocast", {}) or {}

    @property
    def scaler(self) -> dict:
        return self.config.get("scaler") or {}

    @property
    def scaler_on(self) -> bool:
        return bool(self.scaler.get("enabled"))

    @cached_property
    def compute_dtype(self) -> str | None:
        """The reduced dtype the model computed in (autocast dtype, else the dominant half activation dtype)."""
        ac = self.autocast
        if ac.get("enabled") and ac.get("dtype") in formats.REDUCED:
            return ac["dtype"]
        acts = self.sites("act")
        half = acts[acts["dtype"].isin(formats.REDUCED)]
        if len(half):
            return str(half["dtype"].mode().iloc[0])
        return None

    @property
    def fp16(self) -> bool:
        return self.compute_dtype == "float16"

    @cached_property
    def module_types(self) -> dict:
        """module path -> module class name (from the activation sites)."""
        acts = self.sites("act")
        return dict(zip(acts["path"], acts["module_type"]))

    # -- device --------------------------------------------------------------------------------------------------
    @property
    def device(self) -> str:
        return str(self.info.get("device") or "cpu")

    @property
    def bf16_supported(self) -> bool:
        return bool(self.info.get("bf16_supported", self.device == "cpu"))

    @property
    def capability(self) -> tuple | None:
        cap = self.info.get("capability")
        return tuple(cap) if cap else None

    # -- helpers -------------------------------------------------------------------------------------------------
    def step_range(self, steps) -> list:
        steps = [int(s) for s in steps]
        return [min(steps), max(steps)] if steps else []


def resolve_rules(rules: dict | None) -> list[tuple[Rule, dict]]:
    """Registry entries to run with their threshold overrides; ``rules={id: None}`` disables a rule."""
    if rules is not None and not isinstance(rules, dict):
        raise TypeError(f"Argument rules should be of type dict, but given {type(rules)}")
    rules = dict(rules or {})
    unknown = [k for k in rules if k not in registry.RULES]
    if unknown:
        raise ValueError(f"Unknown rule id {unknown[0]!r}; known: {', '.join(registry.RULES)}")
    out = []
    for rid, rule in registry.RULES.items():
        over = rules.get(rid, {})
        if over is None or over is False:
            continue
        if over is True:
            over = {}
        if not isinstance(over, dict):
            raise TypeError(f"Argument rules[{rid!r}] should be a dict of thresholds or None, but given {type(over)}")
        known = rule.thresholds
        bad = [k for k in over if k not in known]
        if bad:
            raise ValueError(f"Rule {rid!r} has no threshold {bad[0]!r}; its thresholds: {', '.join(known) or 'none'}")
        out.append((rule, over))
    return out


def diagnose_trace(tr: Trace, ref: Trace | None, selected) -> list[Diagnosis]:
    run = Run(tr, Run(ref, rules=selected) if ref is not None else None, rules=selected)
    if run.n_steps == 0:
        raise TraceError(f"{tr.path}: no steps recorded; nothing to diagnose")
    out: list = []
    for order, (rule, _) in enumerate(selected):
        out += [(order, d) for d in run.findings_of(rule.id)]
    out.sort(key=lambda od: (-_RANK[od[1].severity], od[0]))
    return [d for _, d in out]
