"""A run's findings as the views show them: worst first, their evidence as short rows, their fix as text and code
parts, the layers and ranks they name. No plotly, no dash: the dashboard pages and the HTML report share them."""

from __future__ import annotations

import numpy as np

from ampdoctor.rules import diagnose as _diagnose
from ampdoctor.rules import fix as F
from ampdoctor.severity import WORST_FIRST

SEVERITY_ORDER = WORST_FIRST


def findings(tr, reference=None) -> list:
    """The diagnosis of a trace, worst first; [] when the rules are not installed or no step is recorded yet."""
    if tr.n_steps == 0:
        return []
    out = list(_diagnose(tr, reference=reference) if reference is not None else _diagnose(tr))
    return sorted(out, key=lambda d: SEVERITY_ORDER.get(getattr(d, "severity", "info"), 3))


def finding_mentions(d, path: str) -> bool:
    """Does finding ``d`` name layer ``path`` (a module path, or a parameter of that module)?"""
    for layer in getattr(d, "layers", None) or ():
        layer = str(layer)
        if layer == path or layer.startswith(path + ".") or path.startswith(layer + "."):
            return True
    return False


def fix_parts(d) -> list[tuple[str, str]]:
    """A finding's fix as ("text" | "code", text) parts, as the rule wrote them (code runs as printed)."""
    return [(p.kind, p.text) for p in F.of(getattr(d, "fix", None) or getattr(d, "recommendation", "") or "")]


def _short(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.4g}"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    return str(v)


def evidence_items(d) -> list[tuple[str, str]]:
    """A finding's evidence as (name, short text) rows: numbers to 4 digits, long lists cut at 8 items."""
    out = []
    for k, v in (getattr(d, "evidence", None) or {}).items():
        if isinstance(v, dict):
            items = list(v.items())
            v = ", ".join(f"{a}: {_short(b)}" for a, b in items[:8]) + (
                f", ... ({len(items)} in all)" if len(items) > 8 else ""
            )
        elif isinstance(v, (list, tuple, np.ndarray)):
            v = ", ".join(_short(x) for x in list(v)[:8]) + (f", ... ({len(v)} in all)" if len(v) > 8 else "")
        else:
            v = _short(v)
        out.append((str(k), v))
    return out


def ranks_label(d) -> str:
    """ "rank 1" / "ranks 0, 1" for a finding of a multi-rank run, "" for one trace."""
    ranks = list(getattr(d, "ranks", None) or [])
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
