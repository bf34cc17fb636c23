"""Compare: loss curves and per-layer statistic differences of this run and a reference (or another run)."""

from __future__ import annotations

import os

from dash import Input, Output, State, dcc, html

from .. import catalog, data, figures, ids
from .common import graph, run_of


def _choices(ctx, run):
    opts = [{"label": catalog.run_label(r), "value": k} for k, r in ctx.runs().items() if k != run]
    if ctx.reference_path and run != "reference":
        opts.insert(0, {"label": "reference: " + os.path.basename(ctx.reference_path), "value": "reference"})
    return opts


def layout(ctx, run: str, query: dict):
    opts = _choices(ctx, run)
    if not opts:
        return html.Div(
            [
                html.H2("Compare"),
                html.P(
                    "Nothing to compare with: serve a directory with several traces or pass --reference TRACE.",
                    id="compare-none",
                ),
            ]
        )
    return html.Div(
        [
            html.H2("Compare"),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("compare with"),
                            dcc.Dropdown(id=ids.COMPARE_OTHER, options=opts, value=opts[0]["value"], clearable=False),
                        ],
                        style={"width": "360px"},
                    ),
                    html.Div(
                        [
                            html.Label("statistic (grad_out, unscaled)"),
                            dcc.Dropdown(
                                id=ids.COMPARE_STAT,
                                value="absmax_log2",
                                clearable=False,
                                options=[{"label": v, "value": k} for k, v in data.STATS.items()],
                            ),
                        ],
                        style={"width": "260px"},
                    ),
                ],
                style={"display": "flex", "gap": "1.5em"},
            ),
            graph(ids.COMPARE_LOSS),
            graph(ids.COMPARE_LAYERS),
        ]
    )


def update(ctx, other, stat, version, search):
    """The callback's work, as a plain function (the tests call it on every kind of trace)."""
    run = run_of(ctx, search)
    a, b = ctx.trace(run), ctx.trace(other)
    if a is None or b is None or stat not in data.STATS:
        return {}, {}
    sa, sb = a.steps(), b.steps()
    names = (catalog.run_label(ctx.resolve(run)), catalog.run_label(ctx.resolve(other)))
    cmp = data.compare_layers(a, b, stat, "grad_out")
    return (
        figures.compare_loss_figure([(names[0], sa["step"], sa["loss"]), (names[1], sb["step"], sb["loss"])]),
        figures.compare_layers_figure(cmp.index, cmp["a"], cmp["b"], names, data.STATS[stat]),
    )


def register(app, ctx) -> None:
    @app.callback(
        Output(ids.COMPARE_LOSS, "figure"),
        Output(ids.COMPARE_LAYERS, "figure"),
        Input(ids.COMPARE_OTHER, "value"),
        Input(ids.COMPARE_STAT, "value"),
        Input(ids.VERSION, "data"),
        State(ids.URL, "search"),
    )
    def _update(*args):
        return update(ctx, *args)
