"""A run's findings as the views show them: worst first, their evidence as labelled rows, their fix as text and code
parts, the layers and ranks they name. No plotly, no dash: the dashboard pages and the HTML report share them."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

# (the views read these here: re-exported)
from ampdoctor.cards import LABELS as LABELS
from ampdoctor.cards import evidence_items as evidence_items
from ampdoctor.cards import label as label
from ampdoctor.cards import ranks_label as ranks_label
from ampdoctor.cards import steps_label as steps_label
from ampdoctor.rules import diagnose as _diagnose
from ampdoctor.rules import fix as F
from ampdoctor.rules.engine import Run, resolve_rules, trace_findings
from ampdoctor.rules.result import Diagnosis

if TYPE_CHECKING:
    from collections.abc import Callable

    from ampdoctor.trace import Trace


def findings(tr: Trace, reference: Trace | None = None) -> list[Diagnosis]:
    """The diagnosis of a trace, worst first; [] when no step is recorded yet."""
    if tr.n_steps == 0:
        return []
    out = list(_diagnose(tr, reference=reference) if reference is not None else _diagnose(tr))
    return worst_first(out)


def diagnose_run(
    tr: Trace, reference: Trace | None = None, first: Callable[[Run], None] | None = None
) -> tuple[list[Diagnosis], Run]:
    """The diagnosis of a trace, worst first, and the rules' Run it was read through: its View holds the steps table,
    the sampled statistics and histograms and the one pass over the peaks, which the report's formats, probe and step
    charts read again without going back to the file (at 10^6 steps that pass is most of the diagnosis' time). The
    findings are ``ampdoctor.diagnose(tr)``'s (tests/dashboards/test_dash_report.py compares the two). ``first(run)``:
    called with the Run before the rules run."""
    selected = resolve_rules(None)
    if tr.n_steps == 0:
        return [], Run(tr, Run(reference, rules=selected) if reference is not None else None, rules=selected)
    with tr.snapshot(), reference.snapshot() if reference is not None else contextlib.nullcontext():
        return trace_findings(tr, reference, selected, first)


def worst_first(found: list[Diagnosis]) -> list[Diagnosis]:
    """Findings in the rules package's one order (result.worst_first: severity, then the registry's order of the
    rules, then the ranks): a rank's own findings and the rank rules' sort together as ``ampdoctor diagnose``
    sorts them."""
    from ampdoctor.rules.engine import resolve_rules
    from ampdoctor.rules.result import worst_first as rules_worst_first

    return rules_worst_first(found, {s.rule.id: i for i, s in enumerate(resolve_rules(None))})


def from_dict(d: dict[str, Any]) -> Diagnosis:
    """A finding back from its JSON form (Diagnosis.to_dict(); non-finite numbers came back as text)."""
    fields = {k: d.get(k) for k in ("rule", "severity", "title", "summary", "recommendation")}
    return Diagnosis(
        **{k: v if v is not None else "" for k, v in fields.items()},
        layers=list(d.get("layers") or []),
        steps=[int(s) for s in d.get("steps") or []],
        evidence=dict(d.get("evidence") or {}),
        ranks=[int(r) for r in d.get("ranks") or []],
        fix=F.of(d.get("fix") or d.get("recommendation") or ""),
    )


def finding_mentions(d: Diagnosis, path: str) -> bool:
    """Does finding ``d`` name layer ``path`` (a module path, or a parameter of that module)?"""
    for layer in getattr(d, "layers", None) or ():
        layer = str(layer)
        if layer == path or layer.startswith(path + ".") or path.startswith(layer + "."):
            return True
    return False


def fix_parts(d: Diagnosis) -> list[tuple[str, str]]:
    """A finding's fix as ("text" | "code", text) parts, as the rule wrote them (code runs as printed)."""
    return [(p.kind, p.text) for p in F.of(getattr(d, "fix", None) or getattr(d, "recommendation", "") or "")]
