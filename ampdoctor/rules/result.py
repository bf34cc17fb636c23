"""What a rule returns and how it is registered: the Diagnosis (one finding), ``finding()`` that rules call, the Rule
entry of the registry with the rules whose findings hide its own (``suppressed_by``), and the one worst-first order
of findings. Rule modules import this and nothing of the engine, so that the engine can import the registry: the
import graph reads one way (result <- rules <- registry <- engine <- ampdoctor.diagnose)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from ..severity import RANK, SEVERITIES
from . import fix as F

# A finding's evidence (and the partial evidence rules build it from): named figures as measured (numbers, strings,
# step lists, nested dicts of them), made plain Python (JSON-safe on export) by python_values.
Evidence = dict[str, Any]


@dataclass
class Diagnosis:
    """One finding: what is wrong, where (layers, culprit first), on which steps, the figures it rests on, the fix."""

    rule: str
    severity: str
    title: str
    summary: str
    layers: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # [first, last] step concerned ([] when not step-bound)
    evidence: Evidence = field(default_factory=dict)
    recommendation: str = ""  # the fix as plain text (fix's parts, one after the other)
    ranks: list[int] = field(default_factory=list)  # the ranks concerned, in a multi-rank run ([]: one trace)
    fix: list[F.Part] = field(default_factory=list)  # the fix as fix.Part items: text and code runnable as printed

    def to_dict(self) -> dict[str, Any]:
        plain: dict[str, Any] = _plain(asdict(self))
        return plain

    def _repr_html_(self) -> str:  # notebooks: the report's finding card (ampdoctor/notebook.py)
        from ..notebook import diagnosis_html

        return diagnosis_html(self)


def python_values(v: Any, json_safe: bool = False) -> Any:
    """Copy with numpy scalars as Python numbers; ``json_safe`` also writes non-finite floats as strings."""
    if isinstance(v, dict):
        return {str(k): python_values(x, json_safe) for k, x in v.items()}
    if isinstance(v, (list, tuple, np.ndarray)):
        return [python_values(x, json_safe) for x in v]
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return f if math.isfinite(f) or not json_safe else str(f)
    return v


def _plain(v: Any) -> Any:
    return python_values(v, json_safe=True)


@dataclass(frozen=True)
class Suppression:
    """A finding of this rule is not shown when rule ``by`` found something over the same run (and, with ``when``,
    ``when(own finding, theirs)`` holds for one of theirs): the other finding names the cause this one is a symptom
    of. ``by`` is computed for this even when the user disabled it (disabled means not shown, not not computed)."""

    by: str
    when: Callable[[Diagnosis, Diagnosis], bool] | None = None

    def hides(self, own: Diagnosis, theirs: list[Diagnosis]) -> bool:
        return any(self.when is None or self.when(own, d) for d in theirs)


def suppressed_by(*ids: str, when: Callable[[Diagnosis, Diagnosis], bool] | None = None) -> tuple[Suppression, ...]:
    """``suppressed_by("divergence")`` for a registry entry: one Suppression per rule id, all with the same ``when``."""
    return tuple(Suppression(i, when) for i in ids)


@dataclass(frozen=True)
class Rule:
    """A registry entry: stable id, the check function, what the rule is about (one line), and the rules whose
    findings hide this one's (declared here, not asked for inside the check)."""

    id: str
    check: Callable[..., Diagnosis | list[Diagnosis] | None]
    about: str
    scope: str = "trace"  # "ranks": runs once over all the ranks of a run (Run.ranks), see multirank.py
    suppressed_by: tuple[Suppression, ...] = ()

    @property
    def thresholds(self) -> dict[str, Any]:
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
    layers: Iterable[str] = (),
    steps: Iterable[int] = (),
    evidence: Mapping[str, Any] | None = None,
    fix: Iterable[F.Part] = (),
    recommendation: str = "",
    ranks: Iterable[int] = (),
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


def worst_first(findings: list[Diagnosis], order: dict[str, int] | None = None) -> list[Diagnosis]:
    """The one order of findings everywhere: severity (critical first), then the rule's place in ``order`` (the
    registry's, as the engine passes it), then the ranks concerned. Stable: findings of one rule keep the order the
    rule gave them."""
    order = order or {}
    return sorted(findings, key=lambda d: (-RANK.get(d.severity, -1), order.get(d.rule, len(order)), d.ranks))


def rule_error(rule: Rule, exc: BaseException) -> Diagnosis:
    """What the engine shows in place of a rule that raised: the rest of the diagnosis goes on without it."""
    msg = f"{type(exc).__name__}: {exc}"[:300]
    return Diagnosis(
        rule=rule.id,
        severity="info",
        title=f"Rule {rule.id} could not judge this trace",
        summary=f"The rule {rule.id} stopped with an error ({msg}); the other rules ran. Its finding, if any, is "
        "missing from this diagnosis.",
        evidence={"rule_error": msg},
        recommendation=F.plain(
            [F.text(f"Report this trace to the ampdoctor maintainers; `--disable {rule.id}` hides this notice.")]
        ),
        fix=[F.text(f"Report this trace to the ampdoctor maintainers; `--disable {rule.id}` hides this notice.")],
    )
