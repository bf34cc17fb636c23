"""Compare: loss curves (zoomed together, a run without a finite loss named, never silently missing) and
per-layer statistic differences of this run and a reference (or another run)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from dash import Input, Output, State, dcc, html

from .. import catalog, data, figures, ids, matrix
from .common import graph, link_zoom, run_of, uirevision, write_state, zoom_pairs, zoom_range, zoom_store

if TYPE_CHECKING:
    import dash

    from ..context import Context

PAGE = "/compare"


def _choices(ctx: Context, run: Any) -> list[dict[str, str]]:
    opts = [{"label": catalog.run_label(r), "value": k} for k, r in ctx.runs().items() if k != run]
    if ctx.reference_path and run != "reference":
        opts.insert(0, {"label": "reference: " + os.path.basename(ctx.reference_path), "value": "reference"})
    return opts


def layout(ctx: Context, run: str, query: dict[str, Any]) -> Any:
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
    values = [o["value"] for o in opts]
    other = query.get("other") if query.get("other") in values else values[0]
    stat = query.get("stat") if query.get("stat") in matrix.STATS else "absmax_log2"
    return html.Div(
        [
            html.H2("Compare"),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("compare with"),
                            dcc.Dropdown(id=ids.COMPARE_OTHER, options=opts, value=other, clearable=False),
                        ],
                        className="control wide",
                    ),
                    html.Div(
                        [
                            html.Label("per-layer statistic (output gradients, unscaled)"),
                            dcc.Dropdown(
                                id=ids.COMPARE_STAT,
                                value=stat,
                                clearable=False,
                                options=[{"label": s.label, "value": k} for k, s in matrix.STATS.items()],
                            ),
                        ],
                        className="control wide",
                    ),
                ],
                className="controls",
            ),
            zoom_store(PAGE, query),
            graph(ids.COMPARE_LOSS),
            graph(ids.COMPARE_LAYERS),
        ]
    )


def update(ctx: Context, other: Any, stat: Any, version: Any, search: str | None, zoom: Any = None) -> Any:
    """The callback's work, as a plain function (the tests call it on every kind of trace)."""
    run = run_of(ctx, search)
    a, b = (ctx.trace(run) if run else None), ctx.trace(other)
    ra, rb = ctx.resolve(run), ctx.resolve(other)  # (not None where a trace is)
    if not run or a is None or b is None or ra is None or rb is None or stat not in matrix.STATS:
        return {}, {}
    r = zoom_range(zoom)
    names = (catalog.run_label(ra), catalog.run_label(rb))
    sa, sb = ctx.steps(run, *(r or (None, None))), ctx.steps(other, *(r or (None, None)))
    cmp = ctx.cached(run, ("compare", other, stat), lambda t: data.compare_layers(t, b, stat, "grad_out"))
    return (
        figures.compare_loss_figure([(names[0], sa), (names[1], sb)], x_range=r, uirevision=uirevision(run, PAGE)),
        figures.compare_layers_figure(cmp.index, cmp["a"], cmp["b"], names, matrix.STATS[stat].label),
    )


def register(app: dash.Dash, ctx: Context) -> None:
    @app.callback(
        Output(ids.COMPARE_LOSS, "figure"),
        Output(ids.COMPARE_LAYERS, "figure"),
        Input(ids.COMPARE_OTHER, "value"),
        Input(ids.COMPARE_STAT, "value"),
        Input(ids.VERSION, "data"),
        State(ids.URL, "search"),
        Input(ids.ZOOMS[PAGE], "data"),
    )
    def _update(other: Any, stat: Any, version: Any, search: str | None, zoom: Any) -> Any:
        return update(ctx, other, stat, version, search, zoom)

    link_zoom(app, PAGE)
    write_state(
        app,
        PAGE,
        [Input(ids.COMPARE_OTHER, "value"), Input(ids.COMPARE_STAT, "value"), Input(ids.ZOOMS[PAGE], "data")],
        lambda run, other, stat, zoom: [("other", other), ("stat", stat), *zoom_pairs(zoom)],
    )
