"""Layer detail: exponent histogram against the FP16/BF16 ranges, abs max / RMS / grad norm, its findings."""

from __future__ import annotations

import re

from dash import Input, Output, State, dcc, html

from .. import data, diagnosis, figures, ids
from .common import finding_card, graph, href, parse_search, run_of, site_links


def _site(ctx, run, search):
    """(trace, site info) for the URL's site parameter, or (trace, None) when it names no site of the run."""
    tr = ctx.trace(run)
    raw = parse_search(search).get("site", "")
    if tr is None or not re.fullmatch(r"[0-9]{1,15}", raw):  # not str.isdigit: that takes "²", int() does not
        return tr, None
    return tr, data.site_info(tr, int(raw))


def layout(ctx, run: str, query: dict):
    return html.Div(
        [
            html.Div(id=ids.LAYER_TITLE),
            graph(ids.LAYER_HIST),
            graph(ids.LAYER_SERIES),
            html.H3("Findings that name this layer"),
            html.Div(id=ids.LAYER_FINDINGS),
        ]
    )


def update(ctx, version, search):
    """The callback's work, as a plain function (the tests call it on every kind of trace)."""
    run = run_of(ctx, search)
    tr, site = _site(ctx, run, search)
    if site is None:
        return (
            html.Div([html.H3("No such layer"), dcc.Link("Layers", href=href("/layers", run))], id="no-such-layer"),
            {},
            {},
            None,
        )
    sid, kind = int(site["id"]), site["kind"]
    same = tr.sites()
    same = same[same["module"] == site["module"]]
    siblings = [
        dcc.Link(f"{r.kind}: {r.path}", href=href("/layer", run, site=int(r.id)), style={"marginRight": "1em"})
        for r in same.itertuples()
        if int(r.id) != sid
    ]
    title = html.Div(
        [
            html.H2(f"{site['path']} · {kind}", id="layer-name", style={"margin": "0.2em 0"}),
            html.P(
                f"{site.get('module_type') or 'parameter'} · dtype {site.get('dtype')} · shape {site.get('shape')}"
                + (" · values scaled by the loss scale" if kind == "grad_out" else "")
            ),
            html.P(["Same module: ", *siblings]) if siblings else None,
        ]
    )
    steps, counts = tr.hist(sid)
    st = tr.steps()
    scales = st["loss_scale"].to_numpy()[steps] if kind == "grad_out" and len(steps) else None
    hist = figures.exponent_hist_figure(steps, counts, scales, kind=kind)
    series = data.layer_series(tr, sid, kind)
    names = {"absmax": "abs max", "rms": "RMS", "grad_norm": "gradient norm (whole model)"}
    fig = figures.layer_series_figure({names[k]: v for k, v in series.items()})
    found = [
        d
        for d in ctx.findings(run)
        if diagnosis.finding_mentions(d, str(site["path"])) or diagnosis.finding_mentions(d, str(site["module"]))
    ]
    links = ctx.cached(run, "links", site_links)
    cards = [finding_card(d, run, links) for d in found] or html.P("No finding names this layer.")
    return title, hist, fig, cards


def register(app, ctx) -> None:
    @app.callback(
        Output(ids.LAYER_TITLE, "children"),
        Output(ids.LAYER_HIST, "figure"),
        Output(ids.LAYER_SERIES, "figure"),
        Output(ids.LAYER_FINDINGS, "children"),
        Input(ids.VERSION, "data"),
        State(ids.URL, "search"),
    )
    def _update(*args):
        return update(ctx, *args)
