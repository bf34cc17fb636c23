"""What-if: replay the dynamic loss scaler with other settings; simulated vs recorded scale and skipped steps."""
from __future__ import annotations

from dash import Input, Output, State, dcc, html

from .. import data, figures, ids
from .common import graph, run_of

_INPUTS = ((ids.WHATIF_INIT, "init scale", "init_scale", 1),
           (ids.WHATIF_INTERVAL, "growth interval", "growth_interval", 1),
           (ids.WHATIF_GROWTH, "growth factor", "growth_factor", "any"),
           (ids.WHATIF_BACKOFF, "backoff factor", "backoff_factor", "any"))


def layout(ctx, run: str, query: dict):
    cfg = data.scaler_settings(ctx.trace(run))
    return html.Div([
        html.H2("What-if: loss-scale replay"),
        html.P("Recorded gradient peaks replayed through GradScaler's rule: a step whose scaled gradients reach "
               "the FP16 max (65504) is skipped and the scale backs off; growth_interval clean steps in a row "
               "grow it."),
        html.Div([html.Div([html.Label(label), html.Br(),
                            dcc.Input(id=id_, type="number", value=cfg[key], min=0, step=step, debounce=True,
                                      style={"width": "140px"})])
                  for id_, label, key, step in _INPUTS], style={"display": "flex", "gap": "1.5em"}),
        html.P(id=ids.WHATIF_SUMMARY),
        graph(ids.WHATIF_GRAPH),
    ])


def _positive(v):
    return v if isinstance(v, (int, float)) and v > 0 else None


def update(ctx, init, interval, growth, backoff, version, search):
    """The callback's work, as a plain function (the tests call it on every kind of trace)."""
    run = run_of(ctx, search)
    tr = ctx.trace(run)
    if tr is None:
        return {}, "unknown run"
    r = data.whatif(tr, init_scale=_positive(init), growth_interval=_positive(interval),
                    growth_factor=_positive(growth), backoff_factor=_positive(backoff))
    fig = figures.whatif_figure(r["steps"], r["recorded"], r["simulated"], r["recorded_skipped"],
                                r["simulated_skipped"])
    s = r["settings"]
    last = r["simulated"][-1] if len(r["simulated"]) else float("nan")
    text = (f"simulated: {int(r['simulated_skipped'].sum())} skipped step(s), final scale {last:g} "
            f"(recorded: {int(r['recorded_skipped'].sum())} skipped) with init {s['init_scale']:g}, "
            f"interval {s['growth_interval']}, growth {s['growth_factor']:g}, backoff {s['backoff_factor']:g}"
            f" [{r['engine']}]")
    return fig, text


def register(app, ctx) -> None:
    @app.callback(Output(ids.WHATIF_GRAPH, "figure"), Output(ids.WHATIF_SUMMARY, "children"),
                  *[Input(i[0], "value") for i in _INPUTS], Input(ids.VERSION, "data"), State(ids.URL, "search"))
    def _update(*args):
        return update(ctx, *args)
