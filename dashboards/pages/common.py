"""Helpers shared by the pages: URLs, the run of a request, finding cards."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlencode

from dash import dcc, html

from .. import diagnosis

SEVERITY_COLORS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}
GRAPH_CONFIG = {"displaylogo": False}


def parse_search(search: str | None) -> dict:
    q = parse_qs((search or "").lstrip("?"))
    return {k: v[0] for k, v in q.items() if v}


def href(path: str, run: str | None, **params) -> str:
    q = {"run": run, **params} if run else params
    q = {k: v for k, v in q.items() if v is not None}
    return path + ("?" + urlencode(q) if q else "")


def run_of(ctx, search: str | None) -> str | None:
    """The run key a request is about (the URL's, else the first run); None when it names no served trace."""
    run = parse_search(search).get("run") or ctx.default_key()
    return run if ctx.resolve(run) is not None else None


def graph(id_: str, **kw) -> dcc.Graph:
    return dcc.Graph(id=id_, config=GRAPH_CONFIG, **kw)


def site_links(tr) -> dict:
    """Layer path -> site id of its detail page (grad_out preferred: that is where underflow shows)."""
    out: dict = {}
    sites = tr.sites()
    for kind in ("param_grad", "act", "grad_out"):
        for s in sites[sites["kind"] == kind].itertuples():
            out[str(s.path)] = int(s.id)
    return out


def prose(text: str) -> list:
    """Recommendation prose as plain text, a paragraph a line, with `code` spans. Never Markdown: a layer name in
    the text is user data, and Markdown would turn ``![x](http://host/track)`` into an image the browser fetches."""
    paras = []
    for line in text.splitlines():
        parts = re.split(r"`([^`]+)`", line.strip())
        kids = [html.Code(p) if i % 2 else p for i, p in enumerate(parts) if p]
        if kids:
            paras.append(html.P(kids, className="recommendation-text"))
    return paras


def finding_card(d, run: str, links: dict):
    sev = str(getattr(d, "severity", "info"))
    color = SEVERITY_COLORS.get(sev, "#888")
    layers = [str(p) for p in (getattr(d, "layers", None) or [])]
    layer_els = []
    for i, p in enumerate(layers):
        layer_els.append(
            dcc.Link(p, href=href("/layer", run, site=links[p]), className="culprit")
            if p in links
            else html.Code(p, className="culprit")
        )
        if i < len(layers) - 1:
            layer_els.append(", ")
    steps = getattr(d, "steps", None)
    ev = diagnosis.evidence_items(d)
    rec = []
    for kind, chunk in diagnosis.fix_parts(d):
        if kind == "code":
            rec.append(
                html.Div(
                    [
                        dcc.Clipboard(content=chunk, title="copy", style={"float": "right", "cursor": "pointer"}),
                        html.Pre(html.Code(chunk), style={"background": "#f6f8fa", "padding": "0.5em"}),
                    ]
                )
            )
        else:
            rec.extend(prose(chunk))
    return html.Div(
        [
            html.Div(
                [
                    html.Span(
                        sev.upper(),
                        className="severity",
                        style={"color": color, "fontWeight": "bold", "marginRight": "0.8em"},
                    ),
                    html.Code(str(d.rule), className="rule-id"),
                    html.Span(diagnosis.ranks_label(d), className="ranks", style={"marginLeft": "0.8em"}),
                ]
            ),
            html.H4(str(d.title), style={"margin": "0.3em 0"}),
            html.P(str(getattr(d, "summary", "") or "")),
            html.P(
                [
                    html.B("Layers: "),
                    *(layer_els or ["-"]),
                    f"  (steps {steps[0]}–{steps[1]})" if steps and len(steps) == 2 else "",
                ]
            ),
            html.Table(
                [html.Tr([html.Th(k, style={"textAlign": "left", "paddingRight": "1em"}), html.Td(v)]) for k, v in ev]
            )
            if ev
            else None,
            html.Details([html.Summary("Recommendation"), *rec], open=True),
        ],
        className=f"finding finding-{sev}",
        style={
            "border": "1px solid #ddd",
            "borderLeft": f"6px solid {color}",
            "borderRadius": "4px",
            "padding": "0.5em 1em",
            "margin": "0.6em 0",
        },
    )


def table(rows: list[dict], id_=None):
    if not rows:
        return html.P("nothing recorded", id=id_) if id_ else html.P("nothing recorded")
    cell = {"border": "1px solid #ddd", "padding": "0.2em 0.6em", "textAlign": "left"}
    head = html.Tr([html.Th(k, style=cell) for k in rows[0]])
    body = [
        html.Tr(
            [
                html.Td(str(v), style=dict(cell, color="#d62728") if k == "verdict" and v != "ok" else cell)
                for k, v in r.items()
            ]
        )
        for r in rows
    ]
    kw = {"id": id_} if id_ else {}
    return html.Table([head, *body], style={"borderCollapse": "collapse"}, **kw)
