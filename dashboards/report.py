"""One self-contained HTML report (plotly.js embedded, nothing fetched from the network), built from the same
figure functions as the dashboard."""

from __future__ import annotations

import html
import os
import re

import plotly.io as pio
from plotly.offline import get_plotlyjs

from ampdoctor import __version__

from . import data, diagnosis, figures

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 auto;max-width:1200px;padding:1em 2em;
color:#222}
h1{font-size:1.6em} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0} td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left;
font-size:.92em} th{background:#f4f4f4}
.finding{border:1px solid #ddd;border-left:6px solid #888;border-radius:4px;padding:.6em 1em;margin:.8em 0}
.finding.critical{border-left-color:#d62728} .finding.warning{border-left-color:#ff7f0e}
.finding.info{border-left-color:#1f77b4}
.sev{font-weight:bold;text-transform:uppercase;font-size:.8em;margin-right:.6em} .rule{font-family:monospace;
color:#555} pre{background:#f6f8fa;padding:.6em;overflow-x:auto} .bad{color:#d62728}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:1em}
"""


def fix_html(d) -> str:
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


def finding_html(d) -> str:
    sev = html.escape(str(getattr(d, "severity", "info")))
    layers = ", ".join(map(str, getattr(d, "layers", None) or [])) or "-"
    steps = getattr(d, "steps", None)
    span = f"steps {steps[0]}–{steps[1]}" if steps and len(steps) == 2 else ""
    ev = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in diagnosis.evidence_items(d))
    return (
        f'<div class="finding {sev}"><div><span class="sev">{sev}</span><span class="rule">'
        f"{html.escape(str(d.rule))}</span>{_ranks(d)}</div><h3>{html.escape(str(d.title))}</h3>"
        f"<p>{html.escape(str(getattr(d, 'summary', '') or ''))}</p>"
        f"<p><b>Layers:</b> {html.escape(layers)} {html.escape(span)}</p>"
        + (f"<table>{ev}</table>" if ev else "")
        + f"<h4>Recommendation</h4>{fix_html(d)}</div>"
    )


def _ranks(d) -> str:
    """ " · rank 1" for a finding of a multi-rank run."""
    label = diagnosis.ranks_label(d)
    return f" · {html.escape(label)}" if label else ""


def _table(rows: list[dict]) -> str:
    if not rows:
        return "<p>nothing recorded</p>"
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join(
        "<tr>"
        + "".join(
            f"<td{' class=bad' if k == 'verdict' and v != 'ok' else ''}>{html.escape(str(v))}</td>"
            for k, v in r.items()
        )
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _fig(fig) -> str:
    return pio.to_html(fig, full_html=False, include_plotlyjs=False, config={"displaylogo": False})


def key_figures(tr) -> list:
    """The report's figures: loss, loss scale, step time, the worst gradient layers and their histogram."""
    st = tr.steps()
    figs = [
        figures.loss_figure(st["step"], st["loss"], st["skipped"], st["nonfinite"]),
        figures.loss_scale_figure(st["step"], st["loss_scale"], st["skipped"]),
        figures.step_time_figure(st["step"], st["step_time"], st["data_time"]),
    ]
    for stat, kind in (("fp16_under", "grad_out"), ("absmax_log2", "grad_out"), ("absmax_log2", "act")):
        lm = data.layer_matrix(tr, stat, kind)
        figs.append(figures.layer_heatmap(lm, lm.order("worst")[:60]))
    lm = data.layer_matrix(tr, "fp16_under", "grad_out")
    if len(lm.labels):
        i = lm.order("worst")[0]
        steps, counts = tr.hist(int(lm.site_ids[i]))
        scales = st["loss_scale"].to_numpy()[steps] if len(steps) else None
        figs.append(
            figures.exponent_hist_figure(
                steps, counts, scales, kind="grad_out", title=f"Exponent histogram — grad_out of {lm.labels[i]}"
            )
        )
    return figs


def formats_section(tr) -> str:
    """Formats: the probe's error against FP32 over the steps, and what each format would lose per site."""
    series, bounds, verdicts = data.probe_series(tr)
    named = [v["path"] for v in verdicts if v["named"]]
    probe = (
        f"<p>Measured precision loss (against FP32): {html.escape(', '.join(named))}</p>"
        if named
        else "<p>No layer measured above sqrt(k)*u.</p>"
        if verdicts
        else "<p>No probe results (attach(..., probe_every=N) records them).</p>"
    )
    labels, lost = data.formats_shares(tr)
    return (
        "<h2>Formats</h2>"
        + probe
        + (_fig(figures.probe_error_figure(series, bounds)) if verdicts else "")
        + "<p>Share of non-zero values lost (saturated or flushed) per format; FP8 with per-tensor delayed "
        "scaling (amax over 1024 steps, margin 0).</p>"
        + _fig(figures.formats_figure(labels, lost))
        + _table(data.formats_rows(tr))
    )


# what build_report does, in order (a progress display learns each stage as it starts)
STAGES = ("diagnosis", "figures", "precision map", "formats", "comparison")


def build_report(tr, reference=None, progress=None) -> str:
    """The report as one HTML string; ``progress(stage)``, when given, is called as each of STAGES starts."""
    stage = progress or (lambda name: None)
    stage("diagnosis")
    found = diagnosis.findings(tr, reference)
    summary = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in data.run_summary(tr))
    if not found:
        fhtml = "<p>No findings: nothing in this trace trips a rule.</p>"
    else:
        fhtml = "\n".join(finding_html(d) for d in found)
    stage("figures")
    figs = "\n".join(f"<div>{_fig(f)}</div>" for f in key_figures(tr))
    stage("precision map")
    precision = _table(data.precision_rows(tr))
    stage("formats")
    formats = formats_section(tr)
    stage("comparison")
    compare = ""
    if reference is not None:
        a, b = tr.steps(), reference.steps()
        cmp = data.compare_layers(tr, reference, "absmax_log2", "grad_out")
        compare = (
            "<h2>Compared with the reference</h2>"
            + _fig(
                figures.compare_loss_figure(
                    [
                        (os.path.basename(tr.path), a["step"], a["loss"]),
                        (os.path.basename(reference.path), b["step"], b["loss"]),
                    ]
                )
            )
            + _fig(
                figures.compare_layers_figure(
                    cmp.index, cmp["a"], cmp["b"], stat_label="log2 abs max (grad_out, unscaled)"
                )
            )
        )
    body = f"""<h2>Run</h2><table>{summary}</table>
<h2>Findings</h2>{fhtml}
<h2>Figures</h2>{figs}
<h2>Precision map</h2><p>Recommended: matrix multiplies and convolutions forward and backward in FP16/BF16;
normalisation, softmax, the loss and the weight update in FP32.</p>{precision}
{formats}
{compare}"""
    return page(f"ampdoctor report — {html.escape(os.path.basename(tr.path))}", found, body)


def page(title: str, found: list, body: str, facts: str = "") -> str:
    """A self-contained report page: plotly.js inlined, the title, a line of counts (``facts`` first), ``body``."""
    n_crit = sum(1 for d in found if getattr(d, "severity", "") == "critical")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{_CSS}</style>
<script type="text/javascript">{get_plotlyjs()}</script>
</head><body>
<h1>{title}</h1>
<p>ampdoctor {__version__} · {facts}{len(found)} finding(s){f", {n_crit} critical" if n_crit else ""}</p>
{body}
</body></html>
"""


def write_report(tr, out: str, reference=None, progress=None) -> str:
    text = build_report(tr, reference, progress)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return out
