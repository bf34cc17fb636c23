"""How ampdoctor's objects show in a notebook (``_repr_html_``): a Trace as the ``ampdoctor info`` summary, a finding
(or a list of them) as the report's finding card, a RankRun as its ranks side by side, a loss-scale Replay as its
settings and outcome. Offline side: no torch, no plotly; objects are read by their public fields, every name and
value escaped (a site path is user data)."""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable
from typing import Any

from . import cards
from .severity import WORST_FIRST

# The objects shown (a Trace, a Diagnosis, a RankRun, a loss-scale Replay) are typed Any: their modules import this
# one to show themselves, so naming their classes here, even for the type checker only, would close an import cycle.

_CSS = (
    "<style>.ampd{font-family:system-ui,sans-serif;font-size:13px;max-width:1000px}"
    ".ampd table{border-collapse:collapse;margin:.3em 0}.ampd td,.ampd th{border:1px solid #ddd;padding:.2em .6em;"
    "text-align:left;vertical-align:top}.ampd th{background:#f4f4f4;white-space:nowrap}"
    ".ampd .finding{border:1px solid #ddd;border-left:6px solid #888;border-radius:4px;padding:.5em 1em;"
    "margin:.6em 0}.ampd .finding.critical{border-left-color:#d62728}.ampd .finding.warning{border-left-color:#ff7f0e}"
    ".ampd .finding.info{border-left-color:#1f77b4}.ampd .sev{font-weight:bold;text-transform:uppercase;"
    "font-size:.85em;margin-right:.6em}.ampd .rule{font-family:monospace;color:#555}.ampd h3{margin:.3em 0}"
    ".ampd pre{background:#f6f8fa;padding:.5em;overflow-x:auto}</style>"
)


def _e(v: object) -> str:
    return html.escape(str(v))


def _box(body: str) -> str:
    return f'{_CSS}<div class="ampd">{body}</div>'


def _rows(pairs: Iterable[tuple[object, object]]) -> str:
    return "<table>" + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in pairs) + "</table>"


# -- findings ------------------------------------------------------------------------------------------------------
def _short(v: object) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        items = list(v.items())
        return ", ".join(f"{a}: {_short(b)}" for a, b in items[:8]) + (
            f", ... ({len(items)} in all)" if len(items) > 8 else ""
        )
    if isinstance(v, (list, tuple)):
        return ", ".join(_short(x) for x in list(v)[:8]) + (f", ... ({len(v)} in all)" if len(v) > 8 else "")
    return str(v)


def _fix(d: Any) -> str:
    out = []
    parts = list(getattr(d, "fix", None) or [])
    recommendation: str = getattr(d, "recommendation", "")
    if not parts and recommendation:
        out.append(f"<p>{_e(recommendation)}</p>")
    for part in parts:
        if part.kind == "code":
            out.append(f"<pre><code>{_e(part.text)}</code></pre>")
            continue
        for para in re.split(r"\n\s*\n", part.text):
            p = re.sub(r"`([^`]+)`", r"<code>\1</code>", _e(para.strip()))
            if p:
                out.append(f"<p>{p}</p>")
    return "".join(out)


def finding_card(d: Any) -> str:
    """One finding as the report shows it: severity, rule, ranks, title, summary, layers and steps, evidence, fix."""
    sev = _e(d.severity)
    ranks = cards.ranks_label(d)
    rank = f" · {_e(ranks)}" if ranks else ""
    layers = ", ".join(map(str, d.layers or [])) or "-"
    span = cards.steps_label(d)
    ev = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in cards.evidence_items(d))
    return (
        f'<div class="finding {sev}"><div><span class="sev">{sev}</span><span class="rule">{_e(d.rule)}</span>'
        f"{rank}</div><h3>{_e(d.title)}</h3><p>{_e(d.summary)}</p>"
        f"<p><b>Layers:</b> {_e(layers)} {_e(span)}</p>"
        + (f"<table>{ev}</table>" if ev else "")
        + f"<h4>Recommendation</h4>{_fix(d)}</div>"
    )


def diagnosis_html(d: Any) -> str:
    return _box(finding_card(d))


def findings_html(found: Iterable[Any]) -> str:
    """A list of findings, worst first, with a line of counts; an empty list says so."""
    found = sorted(found, key=lambda d: WORST_FIRST.get(d.severity, len(WORST_FIRST)))
    if not found:
        return _box("<p>No findings.</p>")
    counts = ", ".join(
        f"{n} {s}" for s in ("critical", "warning", "info") if (n := sum(d.severity == s for d in found))
    )
    return _box(f"<p><b>{len(found)} finding(s)</b>: {_e(counts)}</p>" + "".join(finding_card(d) for d in found))


# -- traces and runs -----------------------------------------------------------------------------------------------
# Built from the Trace's public reads (a method of Trace calls this module: importing the commands or the trace
# package from here would close an import cycle); the same facts, in the same words, as ``ampdoctor info``.
def _g(v: Any) -> str:
    """A number to 4 significant digits ('-' when missing or not finite)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return "-"
    return f"{f:.4g}" if math.isfinite(f) else "-"


def _ranges(steps: list[Any]) -> str:
    out: list[Any] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out[:12])
    return text + (" ..." if len(out) > 12 else "")


def trace_summary(tr: Any) -> list[tuple[str, str]]:
    """(label, text) rows: run, steps, ampdoctor's cost, precision, optimizer, scaler, loss scale, skipped steps,
    loss and the first non-finite value."""
    from .precision_label import describe_precision

    meta, cfg = tr.meta, tr.config
    run = meta.get("run", {}) or {}
    st = tr.steps()
    rows = [
        (
            "run",
            f"{run.get('model', '?')} ({run.get('params', 0):,} parameters) on {run.get('device', '?')}; "
            f"torch {run.get('torch', '?')}, ampdoctor {run.get('ampdoctor', '?')}",
        ),
        (
            "steps",
            f"{len(st)} recorded, full statistics at {len(tr.full_steps())}"
            + ("" if "closed" in meta else " (run still open or ended without close())"),
        ),
    ]
    ok = st["observer_time"].notna() & st["step_time"].notna() if len(st) else None
    if ok is not None and ok.any() and st.loc[ok, "step_time"].sum() > 0:
        obs, total = st.loc[ok, "observer_time"].sum(), st.loc[ok, "step_time"].sum()
        rows.append(("overhead", f"ampdoctor cost {100 * obs / total:.1f}% of this run ({obs:.3g} s of {total:.3g} s)"))
    rows.append(("precision", describe_precision(cfg)))
    if cfg.get("optimizer"):
        rows.append(("optimizer", f"{cfg['optimizer'].get('class')}, lr {_g(st['lr'].iloc[-1]) if len(st) else '-'}"))
    sc = cfg.get("scaler")
    if sc:
        rows.append(("scaler", f"{sc.get('class')} ({'enabled' if sc.get('enabled') else 'disabled'})"))
        scales = st["loss_scale"].dropna()
        if len(scales):
            rows.append(
                (
                    "loss scale",
                    f"{scales.iloc[0]:g} first, {scales.iloc[-1]:g} last, range {scales.min():g} .. {scales.max():g}",
                )
            )
    skipped = st["step"][st["skipped"]].astype(int).tolist() if len(st) else []
    rows.append(("skipped", f"{len(skipped)} step(s)" + (f": {_ranges(skipped)}" if skipped else "")))
    if len(st):
        loss = st["loss"]
        finite = loss[loss.map(lambda v: math.isfinite(v))]
        bad = st["step"][loss.map(lambda v: not math.isfinite(v)) & loss.notna()].astype(int).tolist()
        if len(finite):
            rows.append(
                (
                    "loss",
                    f"{_g(finite.iloc[0])} at step {int(st['step'][finite.index[0]])} -> {_g(finite.iloc[-1])} "
                    f"at step {int(st['step'][finite.index[-1]])}" + (f"; not finite at {_ranges(bad)}" if bad else ""),
                )
            )
    ev = tr.events("nonfinite")
    if len(ev):
        first = ev.iloc[0]
        where = f"{first['path']} ({first['site_kind']})" if first["path"] else "the loss"
        rows.append(
            (
                "non-finite",
                f"{len(ev)} step(s); first at step {int(first['step'])}: {where}, {first['phase']} "
                f"phase — {first['message']}",
            )
        )
    else:
        rows.append(("non-finite", "none"))
    return rows


def trace_html(tr: Any) -> str:
    return _box(f"<p><b>ampdoctor trace</b> {_e(tr.path)}</p>" + _rows(trace_summary(tr)))


def rankrun_html(rr: Any) -> str:
    """The ranks side by side: steps, skipped and non-finite steps, last loss scale, median step time and data
    wait, last loss, host and file (as ``ampdoctor info`` prints a run)."""
    cols = [
        "rank",
        "steps",
        "skipped",
        "non-finite",
        "scale last",
        "step time",
        "data wait",
        "loss last",
        "host",
        "trace",
    ]
    body = ""
    for rank, tr in rr.items():
        st = tr.steps()
        scale = st["loss_scale_next"].dropna()
        loss = st["loss"][st["loss"].map(lambda v: math.isfinite(v))]
        cells = [
            rank,
            len(st),
            int(st["skipped"].sum()),
            int(st["nonfinite"].sum()),
            _g(scale.iloc[-1]) if len(scale) else "-",
            _g(st["step_time"].median()) + " s" if len(st) else "-",
            _g(st["data_time"].median()) + " s" if len(st) else "-",
            _g(loss.iloc[-1]) if len(loss) else "-",
            (tr.meta.get("run", {}) or {}).get("host", "?"),
            tr.path,
        ]
        body += "<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>"
    missing = f"<p>No trace for rank(s) {_e(', '.join(map(str, rr.missing)))}.</p>" if rr.missing else ""
    head = f"<p><b>ampdoctor run</b> {_e(rr.source)}: {len(rr)} rank(s) of world size {rr.world_size}</p>"
    table = "<table><tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>" + body + "</table>"
    return _box(head + missing + table)


def replay_html(rp: Any) -> str:
    """A loss-scale replay: its settings and outcome (skipped steps, scale range, underflow, information lost)."""
    s = rp.summary()

    def num(v: Any, fmt: str = "{:.4g}") -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    rows = [(k, v) for k, v in rp.settings.items()]
    rows += [
        ("steps", s["steps"]),
        ("skipped", f"{s['skipped']} ({num(s['skipped_share'] * 100 if s['steps'] else None, '{:.2f}%')})"),
        ("scale", f"{num(s['min_scale'])} .. {num(s['max_scale'])}, final {num(s['final_scale'])}"),
        ("FP16 underflow", num(s["mean_underflow"] * 100, "{:.3g}%") if not math.isnan(s["mean_underflow"]) else "-"),
        ("flushed to zero", num(s["mean_flushed"] * 100, "{:.3g}%") if not math.isnan(s["mean_flushed"]) else "-"),
        ("gradient information lost", num(s["lost"] * 100, "{:.3g}%") if not math.isnan(s["lost"]) else "-"),
        ("estimated steps", s["estimated"]),
    ]
    note = "<p>Every gradient was treated as FP16 (the run computed none in FP16).</p>" if rp.assumed_fp16 else ""
    return _box("<p><b>loss-scale replay</b></p>" + _rows(rows) + note)


class Findings(list[Any]):
    """What ``ampdoctor.diagnose`` returns: a plain list of findings (equal to one, used as one) that a notebook
    shows as the report's finding cards."""

    def _repr_html_(self) -> str:
        return findings_html(self)
