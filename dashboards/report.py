"""One self-contained HTML report, built from the same figure functions as the dashboard: a table of contents, the
findings with links to the figures that prove them, the figures (downsampled with their extremes, the finding's
layers and steps outlined), the precision map (the diagnosis' verdicts) and the formats.

Small at any run length: plotly.js is embedded once, its partial bundle of the trace types the figures draw
(plotlyjs.py), gzip-compressed (0.66 MB; the full bundle as text was 4.6 MB; the browser unpacks it
with DecompressionStream, nothing is fetched), and each figure is compact JSON (numbers as base64 typed arrays, a
few thousand points per line).
"""

from __future__ import annotations

import base64
import functools
import gzip
import html
import json
import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import plotly.io as pio

from ampdoctor import __version__

from . import data, diagnosis, evidence, figures, matrix, plotlyjs, series

if TYPE_CHECKING:
    from ampdoctor.rules.result import Diagnosis
    from ampdoctor.trace import Trace

_ASSETS = os.path.join(os.path.dirname(__file__), "assets")
_CSS_EXTRA = """
.toc{columns:2;font-size:.92em} .toc ul{margin:.2em 0}
.fig{margin:1em 0} .fig h3{margin:.2em 0;font-size:1em}
.noscript{color:var(--bad)}
"""
MAX_ROWS = 60  # heat map rows in the report (the dashboard pages through every layer)
MAX_LAYER_FIGURES = 8


def _plotly_gz() -> str:
    """plotly.js (plotlyjs.source(): the partial bundle of the figures' trace types), gzip-compressed and
    base64-encoded: unpacked in the browser."""
    return _packed(plotlyjs.bundle())


@functools.lru_cache(maxsize=2)
def _packed(bundle: str | None) -> str:  # (``bundle``: the cache's key, None for the full bundle)
    return base64.b64encode(gzip.compress(plotlyjs.source().encode(), 9, mtime=0)).decode()


def _css() -> str:
    with open(os.path.join(_ASSETS, "ampdoctor.css"), encoding="utf-8") as f:
        return f.read() + _CSS_EXTRA


def _loader() -> str:
    """Unpack plotly.js and draw every figure (a script per figure holds its JSON)."""
    config = json.dumps({k: v for k, v in figures.GRAPH_CONFIG.items()} | {"responsive": True})
    return """<script>
(function () {
  function draw() {
    document.querySelectorAll("script.figure").forEach(function (el) {
      var f = JSON.parse(el.textContent);
      Plotly.newPlot(el.getAttribute("data-target"), f.data, f.layout, CONFIG);
    });
  }
  if (typeof DecompressionStream === "undefined") {
    document.querySelectorAll(".fig .plot").forEach(function (d) {
      d.textContent = "This browser cannot unpack the embedded charts (it lacks DecompressionStream).";
    });
    return;
  }
  var b64 = document.getElementById("plotly-gz").textContent;
  var bin = atob(b64), bytes = new Uint8Array(bin.length);
  for (var i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  var stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  new Response(stream).text().then(function (js) {
    var s = document.createElement("script");
    s.textContent = js;
    document.head.appendChild(s);
    draw();
    document.body.setAttribute("data-drawn", "1");
  });
})();
</script>""".replace("CONFIG", config)


def fix_html(d: Diagnosis) -> str:
    """A finding's fix: code parts in <pre>, text parts as paragraphs with `code` spans; everything escaped."""
    out = []
    for kind, chunk in diagnosis.fix_parts(d):
        if kind == "code":
            out.append(f"<pre><code>{html.escape(chunk)}</code></pre>")
        else:
            for para in re.split(r"\n\s*\n", chunk):
                p = html.escape(para.strip())
                p = re.sub(r"`([^`]+)`", r"<code>\1</code>", p)
                if p:
                    out.append(f"<p>{p}</p>")
    return "\n".join(out)


def finding_html(d: Diagnosis, anchor: str = "", links: list[tuple[str, str]] | None = None) -> str:
    """A finding as HTML: severity, rule, title, summary, layers and steps, evidence rows, the figures of this
    report that show it (``links``: (label, figure id)), the fix."""
    sev = html.escape(str(getattr(d, "severity", "info")))
    layers = ", ".join(map(str, getattr(d, "layers", None) or [])) or "-"
    span = diagnosis.steps_label(d)
    ev = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in diagnosis.evidence_items(d))
    shown = "".join(
        f'<a class="evidence-link" href="#{html.escape(fid)}">{html.escape(lab)}</a>' for lab, fid in links or []
    )
    aid = f' id="{html.escape(anchor)}"' if anchor else ""
    return (
        f'<div class="finding {sev}"{aid}><div><span class="sev">{sev}</span>'
        f'<span class="rule">{html.escape(str(d.rule))}</span>{_ranks(d)}</div><h3>{html.escape(str(d.title))}</h3>'
        f"<p>{html.escape(str(getattr(d, 'summary', '') or ''))}</p>"
        f"<p><b>Layers:</b> {html.escape(layers)} {html.escape(span)}</p>"
        + (f'<div class="evidence-links"><b>Evidence:</b> {shown}</div>' if shown else "")
        + (f'<table class="evidence">{ev}</table>' if ev else "")
        + f"<h4>Recommendation</h4>{fix_html(d)}</div>"
    )


def _ranks(d: Diagnosis) -> str:
    """ " · rank 1" for a finding of a multi-rank run."""
    label = diagnosis.ranks_label(d)
    return f" · {html.escape(label)}" if label else ""


def data_table(rows: list[dict[str, Any]], bad_col: str | None = "verdict") -> str:
    """Rows of dicts as an HTML table (a cell of ``bad_col`` other than "ok" or a dash marked bad)."""
    if not rows:
        return "<p>nothing recorded</p>"
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join(
        "<tr>"
        + "".join(
            f"<td{' class=bad' if k == bad_col and v not in ('ok', '–') else ''}>{html.escape(str(v))}</td>"
            for k, v in r.items()
        )
        + "</tr>"
        for r in rows
    )
    return f'<table class="data-table"><tr>{head}</tr>{body}</table>'


class Figures:
    """The report's figures in order, each with an anchor, a title and its JSON."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, str]] = []  # (id, title, JSON)

    def add(self, fid: str, title: str, fig: Any) -> str:
        if any(f == fid for f, _, _ in self.items):
            return fid
        j = pio.to_json(fig, validate=False, engine="json")
        self.items.append((fid, title, j))
        return fid

    def html(self, ids_: Any = None) -> str:
        out = []
        for fid, _title, j in self.items:
            if ids_ is not None and fid not in ids_:
                continue
            safe = j.replace("</", "<\\/")
            out.append(
                f'<div class="fig" id="{html.escape(fid)}"><div class="plot" id="{html.escape(fid)}-plot"></div>'
                f'<script type="application/json" class="figure" data-target="{html.escape(fid)}-plot">{safe}'
                "</script></div>"
            )
        return "\n".join(out)


def _fid(*parts: Any) -> str:
    return "fig-" + re.sub(r"[^A-Za-z0-9_-]+", "-", "-".join(str(p) for p in parts)).strip("-")[:80]


def _step_figures(tr: Trace, figs: Figures, s: Any) -> dict[str, str]:
    """Loss, loss scale, gradient norm, step time: page "/" of the dashboard."""
    return {
        "loss": figs.add("fig-loss", "Loss", figures.loss_figure(s)),
        "scale": figs.add("fig-scale", "Loss scale", figures.loss_scale_figure(s)),
        "norm": figs.add("fig-norm", "Gradient norm", figures.grad_norm_figure(s)),
        "time": figs.add("fig-time", "Step time", figures.step_time_figure(s)),
    }


def _report_rows(m: matrix.LayerMatrix, named: set[str], paths: list[str] | None) -> tuple[list[int], list[str]]:
    """The rows a report heat map shows: the same layers, in model order, in every heat map (``paths``, chosen by
    the first one: the layers the findings name, then the worst)."""
    index = {p: i for i, p in enumerate(m.labels)}
    if paths is None:
        worst = [m.labels[i] for i in m.order("worst")]
        keep = [p for p in m.labels if p in named] + [p for p in worst if p not in named]
        paths = sorted(keep[:MAX_ROWS], key=lambda p: index[p])
    return [index[p] for p in paths if p in index], paths


def key_figures(
    tr: Trace, found: list[Diagnosis], figs: Figures, run: Any = None, max_points: int = series.MAX_POINTS
) -> dict[tuple[Any, ...], str]:
    """Every figure the findings point to, plus the run's own: {(page, key): figure id}. ``run``: the rules' Run the
    findings were read through (its steps table is not read again); ``max_points``: points per line of a step chart
    past which it is downsampled (each bucket's minimum and maximum kept)."""
    s = series.read(tr, max_points=max_points, summary=_summary(tr, run, max_points))
    where: dict[tuple[Any, ...], str] = {("/", k): v for k, v in _step_figures(tr, figs, s).items()}
    named = {str(p) for d in found for p in d.layers or []}
    views: list[tuple[Any, Any]] = [
        data.default_view(tr, found, run),
        ("grad_out", "absmax_log2"),
        ("act", "absmax_log2"),
    ]
    for d in found:
        for link in evidence.links(d):
            p = dict(link.params)
            if link.page == "/layers" and (p.get("kind"), p.get("stat")) not in views:
                views.append((p.get("kind"), p.get("stat")))
    have = set(tr.sites()["kind"].tolist())
    paths: list[str] | None = None
    memo: dict[Any, Any] = {}  # the peaks read once for every heat map
    for kind, stat in views:
        if kind not in have or stat not in matrix.STATS or ("/layers", kind, stat) in where:
            continue
        m = matrix.layer_matrix(tr, kind, stat, memo=memo)
        rows, chosen = _report_rows(m, named, paths)
        paths = paths or chosen
        title = f"{m.label}: {m.kind_label}" + (
            f" ({len(rows)} of {len(m.labels)} layers)" if len(rows) < len(m.labels) else ""
        )
        where[("/layers", kind, stat)] = figs.add(
            _fid("heat", kind, stat), title, figures.layer_heatmap(m, rows, title=title, highlight=named)
        )
    for d in found:
        for link in evidence.culprit_links(d)[:1]:
            if link.page != "/layer" or len([k for k in where if k[0] == "/layer"]) >= MAX_LAYER_FIGURES:
                continue
            p = dict(link.params)
            site = data.find_site(tr, p["path"], p.get("kind"))
            if site is None:
                continue
            stat = p.get("stat", "absmax_log2")
            x, y, bad = matrix.site_series(tr, int(site["id"]), stat, max_points=max_points)
            spec = matrix.STATS[stat]
            label = f"{spec.label} of {site['path']} ({matrix.KIND_LABELS.get(site['kind'], site['kind'])})"
            limits = []
            if stat == "absmax_log2" and site["kind"] in ("act", "grad_out"):
                limits = [("FP16 max 65504", float(np.log2(65504.0)))]
            fig = figures.site_stat_figure(
                spec.label, x, y, spec.log2, bad, limits, label, evidence.span(d), share=spec.share
            )
            where[("/layer", p["path"], p.get("kind"), stat)] = figs.add(
                _fid("layer", site["path"], site["kind"], stat), label, fig
            )
    return where


def _summary(tr: Trace, run: Any = None, max_points: int = series.MAX_POINTS) -> series.StepSummary | None:
    """The step summary a run longer than ``max_points`` steps is drawn from: from the steps the rules' Run already
    holds when given, else read from the file (in chunks)."""
    if series.n_steps(tr) <= max_points:
        return None
    if run is not None:
        return series.StepSummary.of_steps(tr, run.view.steps)
    sm = series.StepSummary()
    sm.update(tr)
    return sm


def _link_targets(d: Diagnosis, where: dict[tuple[Any, ...], str]) -> list[tuple[str, str]]:
    """(label, figure id) of the report's figures that show finding ``d``'s evidence."""
    out = []
    for link in evidence.links(d) + evidence.culprit_links(d)[:1]:
        p = dict(link.params)
        if link.page == "/":
            key = (
                "loss"
                if p.get("logy") or d.rule in ("divergence", "late-degradation", "weights-nonfinite")
                else "scale"
            )
            if d.rule == "input-pipeline-bound":
                key = "time"
            fid = where.get(("/", key))
        elif link.page == "/layers":
            fid = where.get(("/layers", p.get("kind"), p.get("stat")))
        elif link.page == "/layer":
            fid = where.get(("/layer", p.get("path"), p.get("kind"), p.get("stat")))
        elif link.page == "/precision":
            fid = "precision"
        elif link.page == "/formats":
            fid = "formats"
        elif link.page == "/compare":
            fid = "compare" if ("compare",) in where else None
        else:
            fid = None
        if fid and (link.label, fid) not in out:
            out.append((link.label, fid))
    return out


def formats_section(tr: Trace, found: list[Diagnosis], run: Any = None) -> str:
    """Formats: the probe's error against FP32 over the steps, and what each format would lose per site. ``run``:
    the rules' Run the findings were read through (its histograms, statistics and peaks pass are not read again)."""
    sel = [str(p) for d in found if d.rule in ("precision-loss", "fp8-readiness", "fp16-readiness") for p in d.layers]
    series_, bounds, verdicts = data.probe_series(tr, include=sel, run=run)
    named = [v["path"] for v in verdicts if v["named"]]
    probe = (
        f"<p>Measured precision loss (against FP32): {html.escape(', '.join(named))}</p>"
        if named
        else "<p>No layer measured above sqrt(k)*u.</p>"
        if verdicts
        else "<p>No probe results (attach(..., probe_every=N) records them).</p>"
    )
    figs = Figures()
    if verdicts:
        figs.add("fig-probe", "probe", figures.probe_error_figure(series_, bounds, highlight=set(sel)))
    table = data.format_table(run if run is not None else tr)
    by = data.default_format(tr, run)
    labels, lost = data.formats_shares(table, by)
    figs.add("fig-formats", "formats", figures.formats_figure(labels, lost, data.FORMAT_NAMES[by]))
    rows = data.formats_rows(table, by, limit=200)
    cut = f"<p>The {len(table):,} sites worst first; the first 200 here.</p>" if len(table) > 200 else ""
    return (
        '<h2 id="formats">Formats</h2>'
        + probe
        + "<p>Share of non-zero values lost (saturated or flushed) per format; FP8 with per-tensor delayed "
        "scaling (amax over 1024 steps, margin 0).</p>" + figs.html() + cut + data_table(rows, bad_col=None)
    )


def precision_section(tr: Trace, found: list[Diagnosis], run: Any = None) -> str:
    """The precision map: the diagnosis' verdict on every module (``run``: the rules' Run, for its compute dtype)."""
    rows = data.precision_rows(tr, found, run)
    flagged = [r for r in rows if r["verdict"] != "ok"]
    return (
        '<h2 id="precision">Precision map</h2><p>Recommended: matrix multiplies and convolutions compute in FP16/BF16; '
        "normalisation keeps its parameters and statistics in FP32; softmax in FP32 when its outputs underflow; the "
        "loss and the weight update in FP32. The verdict is the diagnosis (the findings that name the module).</p>"
        + f"<p>{len(flagged)} of {len(rows)} rows named by a finding.</p>"
        + (data_table(flagged) if flagged else "")
        + f"<details><summary>every module ({len(rows):,})</summary>{data_table(rows)}</details>"
    )


# what build_report does, in order (a progress display learns each stage as it starts)
STAGES = ("diagnosis", "figures", "precision map", "formats", "comparison")


def build_report(
    tr: Trace, reference: Trace | None = None, progress: Any = None, max_points: int = series.MAX_POINTS
) -> str:
    """The report as one HTML string; ``progress(stage)``, when given, is called as each of STAGES starts.
    ``max_points``: points per line past which a series is downsampled, each bucket's minimum and maximum kept."""
    stage = progress or (lambda name: None)
    stage("diagnosis")
    found, run = diagnosis.diagnose_run(tr, reference)
    summary = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in data.run_summary(tr, run)
    )
    stage("figures")
    figs = Figures()
    where = key_figures(tr, found, figs, run, max_points)
    stage("precision map")
    precision = precision_section(tr, found, run)
    stage("formats")
    formats_html = formats_section(tr, found, run)
    stage("comparison")
    compare = ""
    if reference is not None:
        cmp = data.compare_layers(tr, reference, "absmax_log2", "grad_out")
        cf = Figures()
        cf.add(
            "fig-compare-loss",
            "loss",
            figures.compare_loss_figure(
                [
                    (os.path.basename(tr.path), series.read(tr, summary=_summary(tr, run, max_points))),
                    (
                        os.path.basename(reference.path),
                        series.read(reference, summary=_summary(reference, run.reference, max_points)),
                    ),
                ]
            ),
        )
        cf.add(
            "fig-compare-layers",
            "layers",
            figures.compare_layers_figure(
                cmp.index, cmp["a"], cmp["b"], stat_label="log2 abs max (grad_out, unscaled)"
            ),
        )
        where[("compare",)] = "compare"
        compare = '<h2 id="compare">Compared with the reference</h2><p>Loss: run vs reference.</p>' + cf.html()
    if not found:
        fhtml = "<p>No findings: nothing in this trace trips a rule.</p>"
    else:
        fhtml = "\n".join(finding_html(d, f"finding-{i}", _link_targets(d, where)) for i, d in enumerate(found))
    toc = (
        '<nav class="toc"><ul><li><a href="#run">Run</a></li><li><a href="#findings">Findings</a><ul>'
        + "".join(
            f'<li><a href="#finding-{i}">{html.escape(d.severity)}: {html.escape(d.title)}</a></li>'
            for i, d in enumerate(found)
        )
        + '</ul></li><li><a href="#figures">Figures</a><ul>'
        + "".join(f'<li><a href="#{html.escape(fid)}">{html.escape(title)}</a></li>' for fid, title, _ in figs.items)
        + '</ul></li><li><a href="#precision">Precision map</a></li><li><a href="#formats">Formats</a></li>'
        + ('<li><a href="#compare">Compared with the reference</a></li>' if compare else "")
        + "</ul></nav>"
    )
    body = f"""{toc}
<h2 id="run">Run</h2><table class="summary">{summary}</table>
<h2 id="findings">Findings</h2>{fhtml}
<h2 id="figures">Figures</h2>{figs.html()}
{precision}
{formats_html}
{compare}"""
    return page(f"ampdoctor report — {html.escape(os.path.basename(tr.path))}", found, body)


def page(title: str, found: list[Diagnosis], body: str, facts: str = "") -> str:
    """A self-contained report page: styles, plotly.js packed, the title, a line of counts (``facts`` first)."""
    n_crit = sum(1 for d in found if getattr(d, "severity", "") == "critical")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="color-scheme" content="light dark">
<style>{_css()}</style>
<script type="application/octet-stream" id="plotly-gz">{_plotly_gz()}</script>
</head><body><div class="page">
<h1>{title}</h1>
<p>ampdoctor {__version__} · {facts}{len(found)} finding(s){f", {n_crit} critical" if n_crit else ""}</p>
{body}
</div>
{_loader()}
</body></html>
"""


def write_report(
    tr: Trace, out: str, reference: Trace | None = None, progress: Any = None, max_points: int = series.MAX_POINTS
) -> str:
    """Write the report of ``tr`` (build_report) to ``out``; returns ``out``."""
    text = build_report(tr, reference, progress, max_points)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return out
