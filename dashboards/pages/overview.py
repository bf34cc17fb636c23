"""Overview: run summary, findings worst first (each linked to the views that prove it), and the step charts (loss,
loss scale, gradient norm, step time, a logged metric) zoomed together. Live: new steps appear as they are written,
the zoom stays."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dash import Input, Output, State, dcc, html

from .. import catalog, data, figures, ids, series
from .common import (
    finding_card,
    graph,
    highlight,
    href,
    link_zoom,
    number,
    parse_search,
    run_of,
    uirevision,
    write_state,
    zoom_pairs,
    zoom_range,
    zoom_store,
)

if TYPE_CHECKING:
    import dash

    from ..context import Context

PAGE = "/"
SMOOTHING = 0.6  # TensorBoard's default


def layout(ctx: Context, run: str, query: dict[str, Any]) -> Any:
    others = _ranks(ctx, run)
    tr = ctx.trace(run)
    metrics = ctx.cached(run, "metric-names", series.metric_names) if tr is not None else []
    metric = query.get("metric") if query.get("metric") in metrics else (metrics[0] if metrics else None)
    smooth = number(query.get("smooth"), SMOOTHING)
    me = ctx.resolve(run)
    assert me is not None  # (app.py shows a page for a served run only)
    return html.Div(
        [
            html.Div(
                [
                    html.H2(catalog.run_label(me), style={"margin": "0.2em 0", "display": "inline"}),
                    html.Span(id=ids.STEP_COUNT, className="muted", style={"marginLeft": "1em"}),
                ]
            ),
            html.P(
                [
                    "Other ranks of this run: ",
                    *[html.Span([dcc.Link(catalog.run_label(r), href=href("/", r.key)), " "]) for r in others],
                ]
            )
            if others
            else None,
            html.Details([html.Summary("Run"), html.Div(id=ids.SUMMARY)], open=True),
            html.H3("Findings"),
            html.Div(id=ids.FINDINGS),
            zoom_store(PAGE, query),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("smoothing"),
                            dcc.Slider(
                                id=ids.SMOOTHING,
                                min=0,
                                max=0.99,
                                step=0.01,
                                value=max(0.0, min(0.99, smooth)),
                                marks={0: "0", 0.6: "0.6", 0.9: "0.9"},
                                tooltip={"placement": "bottom"},
                            ),
                        ],
                        className="control wide",
                    ),
                    dcc.Checklist(
                        id=ids.LOG_Y,
                        options=[{"label": " log-scale loss", "value": "log"}],
                        value=["log"] if query.get("logy") in ("1", "true", "log") else [],
                    ),
                    html.Button("whole run", id=ids.RESET_ZOOM, title="show every step (or double-click a chart)"),
                    html.Span("zoom any chart: the others follow", className="muted"),
                ],
                className="controls",
            ),
            graph(ids.LOSS_GRAPH),
            graph(ids.SCALE_GRAPH),
            graph(ids.NORM_GRAPH),
            graph(ids.TIME_GRAPH),
            html.Div(
                [
                    html.Label("logged metric"),
                    dcc.Dropdown(
                        id=ids.METRIC_PICK,
                        options=[{"label": m, "value": m} for m in metrics],
                        value=metric,
                        clearable=False,
                    ),
                ],
                className="control wide",
                style=None if metrics else {"display": "none"},
            ),
            graph(ids.METRIC_GRAPH, style=None if metrics else {"display": "none"}),
        ]
    )


def _ranks(ctx: Context, run: str) -> list[catalog.Run]:
    me = ctx.resolve(run)
    return [r for r in ctx.runs().values() if me and me.rank is not None and r.group == me.group and r.key != run]


def summary_table(rows: Any) -> Any:
    return html.Table([html.Tr([html.Th(k), html.Td(v)]) for k, v in rows], id="summary-table", className="summary")


def update(ctx: Context, version: Any, search: str | None) -> Any:
    """Step count, run summary and the findings (the callback's work, as a plain function for the tests)."""
    run = run_of(ctx, search)
    tr = ctx.trace(run)
    if run is None or tr is None:
        return "", "unknown run", None
    n = series.n_steps(tr)
    st = ctx.diagnosis_state(run, wait=1.5)
    if st is None or (st.value is None and st.running):
        cards: Any = html.P(
            "Diagnosing this run in the background; the findings appear here when the rules are done "
            "(the charts below are already complete).",
            id="diagnosing",
        )
    elif st.error and not st.current and not st.value:
        cards = html.P(
            f"The diagnosis failed on this snapshot of the trace ({st.error}); it runs again as the trace grows.",
            id="diagnosis-error",
        )
    elif not st.value:
        cards = html.P("No findings: nothing in this trace trips a rule.", id="no-findings")
    else:
        cards = [finding_card(d, run, ctx) for d in st.value]
    return (
        f"{n:,} steps" if n >= 10_000 else f"{n} steps",
        summary_table(ctx.cached(run, "summary", data.run_summary)),
        cards,
    )


def charts(ctx: Context, version: Any, zoom: Any, smoothing: Any, log_y: Any, metric: Any, search: str | None) -> Any:
    """The step charts for the zoomed range (the callback's work, as a plain function for the tests)."""
    run = run_of(ctx, search)
    tr = ctx.trace(run)
    if run is None or tr is None:
        return {}, {}, {}, {}, {}
    r = zoom_range(zoom)
    s = ctx.steps(run, *(r or (None, None)))
    assert s is not None  # (the trace is open)
    r = r or ((s.x0, s.x1) if s.n else None)  # the same step axis on every chart, zoomed or not
    hl = highlight(parse_search(search))
    smoothing = max(0.0, min(0.99, number(smoothing, SMOOTHING)))
    rev = uirevision(run, PAGE)
    out = [
        figures.loss_figure(s, smoothing, "log" in (log_y or []), hl, r, rev),
        figures.loss_scale_figure(s, highlight=hl, x_range=r, uirevision=rev),
        figures.grad_norm_figure(s, smoothing, hl, r, rev),
        figures.step_time_figure(s, hl, r, rev),
    ]
    if metric:
        x, y = series.metric(tr, metric, *(r or (None, None)))
        out.append(figures.metric_figure(metric, x, y, smoothing, hl, r, rev))
    else:
        out.append({})
    return tuple(out)


def register(app: dash.Dash, ctx: Context) -> None:
    @app.callback(
        Output(ids.STEP_COUNT, "children"),
        Output(ids.SUMMARY, "children"),
        Output(ids.FINDINGS, "children"),
        Input(ids.VERSION, "data"),
        State(ids.URL, "search"),
    )
    def _update(*args: Any) -> Any:
        return update(ctx, *args)

    @app.callback(
        Output(ids.LOSS_GRAPH, "figure"),
        Output(ids.SCALE_GRAPH, "figure"),
        Output(ids.NORM_GRAPH, "figure"),
        Output(ids.TIME_GRAPH, "figure"),
        Output(ids.METRIC_GRAPH, "figure"),
        Input(ids.VERSION, "data"),
        Input(ids.ZOOMS[PAGE], "data"),
        Input(ids.SMOOTHING, "value"),
        Input(ids.LOG_Y, "value"),
        Input(ids.METRIC_PICK, "value"),
        State(ids.URL, "search"),
    )
    def _charts(*args: Any) -> Any:
        return charts(ctx, *args)

    link_zoom(app, PAGE, ids.RESET_ZOOM)

    def pairs(run: Any, zoom: Any, smoothing: Any, log_y: Any, metric: Any) -> Any:
        out = zoom_pairs(zoom)
        if smoothing is not None and abs(float(smoothing) - SMOOTHING) > 1e-9:
            out.append(("smooth", f"{float(smoothing):g}"))
        if "log" in (log_y or []):
            out.append(("logy", 1))
        if metric:
            out.append(("metric", metric))
        return out

    write_state(
        app,
        PAGE,
        [
            Input(ids.ZOOMS[PAGE], "data"),
            Input(ids.SMOOTHING, "value"),
            Input(ids.LOG_Y, "value"),
            Input(ids.METRIC_PICK, "value"),
        ],
        pairs,
    )
