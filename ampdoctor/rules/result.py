"""What a rule returns and how it is registered: the Diagnosis (one finding), ``finding()`` that rules call, and
the Rule entry of the registry. Rule modules import this and nothing of the engine, so that the engine can import
the registry: the import graph reads one way (result <- rules <- registry <- engine <- ampdoctor.diagnose)."""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from ..severity import SEVERITIES
from . import fix as F


@dataclass
class Diagnosis:
    """One finding: what is wrong, where (layers, culprit first), on which steps, the figures it rests on, the fix."""

    rule: str
    severity: str
    title: str
    summary: str
    layers: list = field(default_factory=list)
    steps: list = field(default_factory=list)  # [first, last] step concerned ([] when not step-bound)
    evidence: dict = field(default_factory=dict)
    recommendation: str = ""  # the fix as plain text (fix's parts, one after the other)
    ranks: list = field(default_factory=list)  # the ranks concerned, in a multi-rank run ([]: one trace)
    fix: list = field(default_factory=list)  # the fix as fix.Part items: text and code runnable as printed

    def to_dict(self) -> dict:
        return _plain(asdict(self))

    def _repr_html_(self) -> str:  # notebooks: the report's finding card (ampdoctor/notebook.py)
        from ..notebook import diagnosis_html

        return diagnosis_html(self)


def _py(v, json_safe: bool = False):
    """Copy with numpy scalars as Python numbers; ``json_safe`` also writes non-finite floats as strings."""
    if isinstance(v, dict):
        return {str(k): _py(x, json_safe) for k, x in v.items()}
    if isinstance(v, (list, tuple, np.ndarray)):
        return [_py(x, json_safe) for x in v]
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return f if math.isfinite(f) or not json_safe else str(f)
    return v


def _plain(v):
    return _py(v, json_safe=True)


@dataclass(frozen=True)
class Rule:
    """A registry entry: stable id, the check function and what the rule is about (one line)."""

    id: str
    check: Callable
    about: str
    scope: str = "trace"  # "ranks": runs once over all the ranks of a run (Run.ranks), see multirank.py

    @property
    def thresholds(self) -> dict:
        """The rule's thresholds and their defaults (the check's keyword-only arguments)."""
        return {
            p.name: p.default
            for p in inspect.signature(self.check).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }


def finding(
    severity: str,
    title: str,
    summary: str,
    *,
    layers=(),
    steps=(),
    evidence=None,
    fix=(),
    recommendation: str = "",
    ranks=(),
) -> Diagnosis:
    """A Diagnosis whose rule id the engine fills in; ``fix``: fix.Part items (a plain ``recommendation`` is one
    text part)."""
    parts = F.of(fix) or F.of(recommendation)
    if severity not in SEVERITIES:
        raise ValueError(f"Argument severity should be one of {', '.join(SEVERITIES)}, but given {severity!r}")
    return Diagnosis(
        rule="",
        severity=severity,
        title=title,
        summary=summary,
        layers=list(layers),
        steps=[int(s) for s in steps],
        evidence=dict(evidence or {}),
        recommendation=F.plain(parts),
        ranks=[int(r) for r in ranks],
        fix=parts,
    )
