"""Overview: run summary, findings worst first, loss, loss scale (log2) and step-time split. Live."""

from __future__ import annotations

from dash import Input, Output, State, dcc, html

from .. import catalog, data, figures, ids
from .common import finding_card, graph, href, run_of, site_links


def layout(ctx, run: str, query: dict):
    others = _ranks(ctx, run)
    return html.Div(
        [
            html.Div(
                [
                    html.H2(catalog.run_label(ctx.resolve(run)), style={"margin": "0.2em 0"}),
                    html.Span(id=ids.STEP_COUNT, style={"color": "#555"}),
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
            html.Div(id=ids.SUMMARY),
            html.H3("Findings"),
            html.Div(id=ids.FINDINGS),
            graph(ids.LOSS_GRAPH),
            graph(ids.SCALE_GRAPH),
            graph(ids.TIME_GRAPH),
        ]
    )


def _ranks(ctx, run: str) -> list:
    me = ctx.resolve(run)
    return [r for r in ctx.runs().values() if me and r.group == me.group and r.key != run]


def summary_table(rows):
    return html.Table(
        [html.Tr([html.Th(k, style={"textAlign": "left", "paddingRight": "1.5em"}), html.Td(v)]) for k, v in rows],
        id="summary-table",
    )


def update(ctx, version, search):
    """The callback's work, as a plain function (the tests call it on every kind of trace)."""
    run = run_of(ctx, search)
    tr = ctx.trace(run)
    if tr is None:
        return "", "unknown run", None, {}, {}, {}
    st = tr.steps()
    found, error = ctx.findings_and_error(run)
    if error:
        cards = html.P(
            f"The diagnosis failed on this snapshot of the trace ({error}); it runs again as the trace grows.",
            id="diagnosis-error",
        )
    elif not found:
        cards = html.P("No findings: nothing in this trace trips a rule.", id="no-findings")
    else:
        links = ctx.cached(run, "links", site_links)
        cards = [finding_card(d, run, links) for d in found]
    return (
        f"{len(st)} steps",
        summary_table(data.run_summary(tr)),
        cards,
        figures.loss_figure(st["step"], st["loss"], st["skipped"], st["nonfinite"]),
        figures.loss_scale_figure(st["step"], st["loss_scale"], st["skipped"]),
        figures.step_time_figure(st["step"], st["step_time"], st["data_time"]),
    )


def register(app, ctx) -> None:
    @app.callback(
        Output(ids.STEP_COUNT, "children"),
        Output(ids.SUMMARY, "children"),
        Output(ids.FINDINGS, "children"),
        Output(ids.LOSS_GRAPH, "figure"),
        Output(ids.SCALE_GRAPH, "figure"),
        Output(ids.TIME_GRAPH, "figure"),
        Input(ids.VERSION, "data"),
        State(ids.URL, "search"),
    )
    def _update(*args):
        return update(ctx, *args)
