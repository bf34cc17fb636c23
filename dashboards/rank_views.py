"""The ranks of one distributed run side by side: a table, per-rank line figures (pure plotly) and the HTML report
of the whole run (its findings name the ranks). Used by ``ampdoctor report DIR_OR_GLOB`` and the dashboard."""

from __future__ import annotations

import html
import os
from typing import TYPE_CHECKING, Any

from ampdoctor.rules import diagnose
from ampdoctor.trace.run import run_pattern

from . import catalog, figures, series
from .report import Figures, data_table, finding_html, page

if TYPE_CHECKING:
    from ampdoctor.trace import Trace

MAX_RANK_LINES = 16  # more lines than this are unreadable; the table still lists every rank


def rank_rows(rr: Any) -> list[dict[str, Any]]:
    """One row per rank: steps, skipped, non-finite steps, last loss scale, median step time and data wait."""
    rows = []
    for rank, tr in rr.items():
        st = tr.steps()
        scale = st["loss_scale_next"].dropna()
        rows.append(
            {
                "rank": rank,
                "steps": len(st),
                "skipped": int(st["skipped"].sum()),
                "non-finite": int(st["nonfinite"].sum()),
                "loss scale last": f"{scale.iloc[-1]:g}" if len(scale) else "-",
                "step time (median)": f"{st['step_time'].median():.3g} s" if len(st) else "-",
                "data wait (median)": f"{st['data_time'].median():.3g} s" if len(st) else "-",
                "host": str((tr.meta.get("run", {}) or {}).get("host", "?")),
                "trace": os.path.basename(tr.path),
            }
        )
    return rows


def rank_figures(rr: Any) -> list[Any]:
    """Loss, loss scale (log2), step time and data wait of every rank (the first MAX_RANK_LINES), one figure each,
    from each rank's downsampled steps (extremes kept)."""
    per = [(rank, series.read(tr, summary=_summary(tr))) for rank, tr in list(rr.items())[:MAX_RANK_LINES]]

    def lines(col: str) -> Any:
        return [(rank, *s.envelope(col)) for rank, s in per]

    return [
        figures.ranks_figure(lines("loss"), "Loss per rank", "loss"),
        figures.ranks_figure(lines("loss_scale"), "Loss scale per rank", "loss scale", log2=True),
        figures.ranks_figure(lines("step_time"), "Step time per rank", "seconds"),
        figures.ranks_figure(lines("data_time"), "Data wait per rank", "seconds"),
    ]


def _summary(tr: Trace) -> Any:
    sm = series.StepSummary()
    sm.update(tr)
    return sm


def build_rank_report(rr: Any, reference: Trace | None = None) -> str:
    """The report of a multi-rank run as one HTML string: ranks, findings (naming their ranks), figures."""
    found = diagnose(rr, reference=reference) if any(tr.n_steps for tr in rr) else []
    fhtml = "\n".join(finding_html(d) for d in found) or "<p>No findings: nothing in these traces trips a rule.</p>"
    missing = f"<p class=bad>No trace for rank(s) {', '.join(map(str, rr.missing))}.</p>" if rr.missing else ""
    figs = Figures()
    for i, f in enumerate(rank_figures(rr)):
        figs.add(f"fig-ranks-{i}", f.layout.title.text, f)
    name = os.path.basename(run_pattern(rr[rr.ranks[0]].path))
    body = f"""<h2>Ranks</h2>{data_table(rank_rows(rr), bad_col=None)}{missing}
<h2>Findings</h2>{fhtml}
<h2>Figures</h2>{figs.html()}
<p>Each rank's own report: <code>ampdoctor report {html.escape(rr[rr.ranks[0]].path)}</code>.</p>"""
    return page(
        f"ampdoctor report — {len(rr)} ranks of {html.escape(name)}",
        found,
        body,
        facts=f"world size {rr.world_size} · ",
    )


def default_output(rr: Any) -> str:
    """``runs/exp-0.db, runs/exp-1.db`` -> ``runs/exp-ranks.html``."""
    stem = os.path.splitext(rr[rr.ranks[0]].path)[0]
    base = catalog.RANK_SUFFIX.sub("", stem)
    base = base.rstrip("0123456789").rstrip("._-") if base == stem else base
    return (base or stem) + "-ranks.html"


def write_rank_report(rr: Any, out: str, reference: Trace | None = None) -> str:
    text = build_rank_report(rr, reference)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return out
