"""Layers: a layer x step heat map of one statistic for one kind; layers sortable worst first; click -> detail."""

from __future__ import annotations

import math

import dash
from dash import Input, Output, State, dcc, html

from .. import data, figures, ids
from .common import graph, href, run_of


def layout(ctx, run: str, query: dict):
    kind = query.get("kind") if query.get("kind") in data.KINDS else "grad_out"
    stat = query.get("stat") if query.get("stat") in data.STATS else "fp16_under"
    return html.Div(
        [
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("kind"),
                            dcc.Dropdown(
                                id=ids.LAYERS_KIND,
                                value=kind,
                                clearable=False,
                                options=[{"label": k, "value": k} for k in data.KINDS],
                            ),
                        ],
                        style={"width": "180px"},
                    ),
                    html.Div(
                        [
                            html.Label("statistic"),
                            dcc.Dropdown(
                                id=ids.LAYERS_STAT,
                                value=stat,
                                clearable=False,
                                options=[{"label": v, "value": k} for k, v in data.STATS.items()],
                            ),
                        ],
                        style={"width": "260px"},
                    ),
                    html.Div(
                        [
                            html.Label("order"),
                            dcc.RadioItems(
                                id=ids.LAYERS_SORT,
                                value="worst",
                                inline=True,
                                options=[
                                    {"label": " worst first", "value": "worst"},
                                    {"label": " model order", "value": "order"},
                                ],
                            ),
                        ]
                    ),
                ],
                style={"display": "flex", "gap": "1.5em", "alignItems": "end"},
            ),
            html.Div(
                [
                    graph(ids.LAYERS_HEATMAP, style={"flex": "3"}),
                    html.Div(id=ids.LAYERS_LIST, style={"flex": "1", "maxHeight": "900px", "overflowY": "auto"}),
                ],
                style={"display": "flex", "gap": "1em"},
            ),
        ]
    )


def _fmt(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"


def update(ctx, kind, stat, sort, version, search):
    """The callback's work, as a plain function (the tests call it on every kind of trace)."""
    run = run_of(ctx, search)
    if run is None or kind not in data.KINDS or stat not in data.STATS:
        return {}, None
    lm = ctx.cached(run, ("layers", stat, kind), lambda tr: data.layer_matrix(tr, stat, kind))
    order = lm.order(sort)
    items = [
        html.Li(
            [
                dcc.Link(
                    lm.labels[i],
                    href=href("/layer", run, site=int(lm.site_ids[i])),
                    className="layer-link",
                    id=f"layer-link-{int(lm.site_ids[i])}",
                ),
                html.Span(f" {lm.types[i]} · worst {_fmt(lm.worst[i])}", style={"color": "#666"}),
            ]
        )
        for i in order[:200]
    ]
    return (
        figures.layer_heatmap(lm, order),
        [
            html.B(f"{len(order)} layers, {'worst first' if sort == 'worst' else 'model order'}"),
            html.Ol(items, style={"paddingLeft": "1.5em"}),
        ],
    )


def open_clicked(ctx, click, kind, search):
    """(pathname, search) of the layer a heat map click names (a row's label is its path, as figures.text shows
    it), else no_update."""
    run = run_of(ctx, search)
    tr = ctx.trace(run)
    try:
        label = str(click["points"][0]["y"])
        sites = tr.sites(kind)
        site = int(sites.loc[[figures.text(p) == label for p in sites["path"]], "id"].iloc[0])
    except (TypeError, KeyError, IndexError, ValueError, AttributeError):
        return dash.no_update, dash.no_update
    return "/layer", href("", run, site=site)


def register(app, ctx) -> None:
    @app.callback(
        Output(ids.LAYERS_HEATMAP, "figure"),
        Output(ids.LAYERS_LIST, "children"),
        Input(ids.LAYERS_KIND, "value"),
        Input(ids.LAYERS_STAT, "value"),
        Input(ids.LAYERS_SORT, "value"),
        Input(ids.VERSION, "data"),
        State(ids.URL, "search"),
    )
    def _update(*args):
        return update(ctx, *args)

    @app.callback(
        Output(ids.URL, "pathname", allow_duplicate=True),
        Output(ids.URL, "search", allow_duplicate=True),
        Input(ids.LAYERS_HEATMAP, "clickData"),
        State(ids.LAYERS_KIND, "value"),
        State(ids.URL, "search"),
        prevent_initial_call=True,
    )
    def _click(click, kind, search):
        return open_clicked(ctx, click, kind, search)
