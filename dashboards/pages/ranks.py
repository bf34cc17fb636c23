"""Ranks: the ranks of one distributed run side by side (a table, and one step figure per rank), for the rank rules'
evidence (a rank whose loss scale parts ways, a straggler's step time or data wait)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dash import Input, Output, State, dcc, html

from .. import figures, ids, rank_views, series
from .common import (
    graph,
    highlight,
    link_zoom,
    parse_all,
    parse_search,
    run_of,
    table,
    write_state,
    zoom_pairs,
    zoom_range,
    zoom_store,
)

if TYPE_CHECKING:
    import dash

    from ..context import Context

PAGE = "/ranks"
STATS = {
    "loss": ("Loss per rank", "loss", False),
    "loss_scale": ("Loss scale per rank", "loss scale", True),
    "step_time": ("Step time per rank", "seconds", False),
    "data_time": ("Data wait per rank", "seconds", False),
    "grad_norm": ("Gradient norm per rank", "norm", True),
}


def layout(ctx: Context, run: str, query: dict[str, Any]) -> Any:
    stat = query.get("stat") if query.get("stat") in STATS else "loss"
    return html.Div(
        [
            html.H2("Ranks"),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("figure"),
                            dcc.Dropdown(
                                id=ids.RANKS_STAT,
                                value=stat,
                                clearable=False,
                                options=[{"label": v[0], "value": k} for k, v in STATS.items()],
                            ),
                        ],
                        className="control wide",
                    )
                ],
                className="controls",
            ),
            zoom_store(PAGE, query),
            graph(ids.RANKS_GRAPH),
            html.Div(id=ids.RANKS_TABLE + "-wrap"),
        ]
    )


def update(ctx: Context, stat: Any, version: Any, search: str | None, zoom: Any = None) -> Any:
    """(figure, table): the callback's work, as a plain function (the tests call it)."""
    run = run_of(ctx, search)
    peers = ctx.peers(run) if run else {}
    if not peers or stat not in STATS:
        return figures.empty("Ranks", "this run has one trace"), html.P("One rank.")
    r = zoom_range(zoom)
    title, y_title, log2 = STATS[stat]
    lines, traces = [], {}
    for rank, key in sorted(peers.items()):
        s = ctx.steps(key, *(r or (None, None)))
        tr = ctx.trace(key)
        if s is None or tr is None:
            continue
        traces[rank] = tr
        x, y = s.envelope(stat) if stat in series.COLUMNS else (s.x, s.lo["loss"])
        lines.append((rank, x, y))
    ranks = [int(v) for v in parse_all(search, "rank")]
    fig = figures.ranks_figure(
        lines, title, y_title, log2=log2, highlight=highlight(parse_search(search)), x_range=r, ranks=ranks
    )
    return fig, table(rank_views.rank_rows(traces), ids.RANKS_TABLE, bad_col=None)


def register(app: dash.Dash, ctx: Context) -> None:
    @app.callback(
        Output(ids.RANKS_GRAPH, "figure"),
        Output(ids.RANKS_TABLE + "-wrap", "children"),
        Input(ids.RANKS_STAT, "value"),
        Input(ids.VERSION, "data"),
        State(ids.URL, "search"),
        Input(ids.ZOOMS[PAGE], "data"),
    )
    def _update(stat: Any, version: Any, search: str | None, zoom: Any) -> Any:
        return update(ctx, stat, version, search, zoom)

    link_zoom(app, PAGE)
    write_state(
        app,
        PAGE,
        [Input(ids.RANKS_STAT, "value"), Input(ids.ZOOMS[PAGE], "data")],
        lambda run, stat, zoom: [("stat", stat), *zoom_pairs(zoom)],
        keep=("rank", "hl", "sel"),  # the ranks a finding's link shows
    )
