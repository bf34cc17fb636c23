"""What-if: replay the dynamic loss scaler with other settings; simulated vs recorded scale and skipped steps."""

from __future__ import annotations

import math

import dash
from dash import Input, Output, State, dcc, html

from .. import data, figures, ids
from .common import graph, run_of

_INPUTS = (
    (ids.WHATIF_INIT, "init scale", "init_scale", 1),
    (ids.WHATIF_INTERVAL, "growth interval", "growth_interval", 1),
    (ids.WHATIF_GROWTH, "growth factor", "growth_factor", "any"),
    (ids.WHATIF_BACKOFF, "backoff factor", "backoff_factor", "any"),
)


def layout(ctx, run: str, query: dict):
    cfg = data.scaler_settings(ctx.trace(run))
    return html.Div(
        [
            html.H2("What-if: loss-scale replay"),
            html.P(
                "Recorded gradient peaks replayed through GradScaler's rule: a step whose scaled gradients reach "
                "the FP16 max (65504) is skipped and the scale backs off; growth_interval clean steps in a row "
                "grow it."
            ),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label(label),
                            html.Br(),
                            dcc.Input(
                                id=id_,
                                type="number",
                                value=cfg[key],
                                min=0,
                                step=step,
                                debounce=True,
                                style={"width": "140px"},
                            ),
                        ]
                    )
                    for id_, label, key, step in _INPUTS
                ],
                style={"display": "flex", "gap": "1.5em"},
            ),
            html.P(id=ids.WHATIF_SUMMARY),
            graph(ids.WHATIF_GRAPH),
        ]
    )


# what GradScaler accepts, as (test, words); an emptied box keeps the run's own setting
_VALID = {
    "init_scale": (lambda v: 0 < v < math.inf, "a positive number"),
    "growth_interval": (lambda v: v >= 1 and float(v).is_integer(), "a whole number of steps, at least 1"),
    "growth_factor": (lambda v: 1 < v < math.inf, "a number above 1 (the scale must grow)"),
    "backoff_factor": (lambda v: 0 < v < 1, "a number between 0 and 1 (the scale must shrink)"),
}


def settings(init, interval, growth, backoff) -> tuple[dict, str | None]:
    """The boxes' values as replay arguments (None: the run's own), or an error message for the page."""
    given = {"init_scale": init, "growth_interval": interval, "growth_factor": growth, "backoff_factor": backoff}
    labels = {key: label for _, label, key, _ in _INPUTS}
    out = {}
    for key, v in given.items():
        if v is None:
            out[key] = None
            continue
        test, words = _VALID[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not test(v):
            return {}, f"The {labels[key]} should be {words}, but given {v!r}."
        out[key] = int(v) if key == "growth_interval" else float(v)
    return out, None


def update(ctx, init, interval, growth, backoff, version, search):
    """The callback's work, as a plain function (the tests call it on every kind of trace)."""
    run = run_of(ctx, search)
    tr = ctx.trace(run)
    if tr is None:
        return {}, "unknown run"
    args, error = settings(init, interval, growth, backoff)
    if error:
        return dash.no_update, html.Span(error, id="whatif-error", style={"color": "#d62728"})
    r = data.whatif(tr, **args)
    fig = figures.whatif_figure(
        r["steps"], r["recorded"], r["simulated"], r["recorded_skipped"], r["simulated_skipped"]
    )
    s = r["settings"]
    last = r["simulated"][-1] if len(r["simulated"]) else float("nan")
    text = (
        f"simulated: {int(r['simulated_skipped'].sum())} skipped step(s), final scale {last:g} "
        f"(recorded: {int(r['recorded_skipped'].sum())} skipped) with init {s['init_scale']:g}, "
        f"interval {s['growth_interval']}, growth {s['growth_factor']:g}, backoff {s['backoff_factor']:g}"
        f" [{r['engine']}]"
    )
    return fig, text


def register(app, ctx) -> None:
    @app.callback(
        Output(ids.WHATIF_GRAPH, "figure"),
        Output(ids.WHATIF_SUMMARY, "children"),
        *[Input(i[0], "value") for i in _INPUTS],
        Input(ids.VERSION, "data"),
        State(ids.URL, "search"),
    )
    def _update(*args):
        return update(ctx, *args)
