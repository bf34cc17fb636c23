"""What-if: replay the dynamic loss scaler with other settings; simulated vs recorded scale and skipped steps.

The settings are in the URL (a finding's "try the suggested scaler" is a link), the init scale and the growth
interval step by doubling and halving, and a run whose non-finite values come from the forward pass is told that
no loss scale can help it."""

from __future__ import annotations

import math
import re
import time
from typing import TYPE_CHECKING, Any, Callable

import dash
from dash import Input, Output, State, dcc, html

from .. import data, evidence, figures, ids
from .common import graph, link_href, link_zoom, run_of, uirevision, write_state, zoom_range, zoom_store

if TYPE_CHECKING:
    from ampdoctor.rules.result import Diagnosis

    from ..context import Context

PAGE = "/whatif"
# (component id, label, replay argument, URL parameter, whether it doubles and halves)
_INPUTS = (
    (ids.WHATIF_INIT, "init scale", "init_scale", "init", True),
    (ids.WHATIF_INTERVAL, "growth interval (steps)", "growth_interval", "interval", True),
    (ids.WHATIF_GROWTH, "growth factor", "growth_factor", "growth", False),
    (ids.WHATIF_BACKOFF, "backoff factor", "backoff_factor", "backoff", False),
)
# a run this short is replayed within the page's wait, its evidence read included (~0.3 s at 2 x 10^4 steps; a
# longer run's first replay reads ~5 s at 10^6 steps: its recorded scale is drawn at once instead)
QUICK_STEPS = 50_000
# forward-pass causes: the loss scale multiplies the loss after the forward pass, so it cannot prevent these
FORWARD_RULES = ("forward-overflow", "divergence", "weights-nonfinite", "rank-nonfinite")


def _shown(v: Any) -> str:
    """A setting as its box shows it: whole numbers without a decimal point, others to 6 digits."""
    if v is None:
        return ""
    f = float(v)
    return f"{int(f)}" if f.is_integer() and abs(f) < 1e15 else f"{f:.6g}"


def parse(v: Any) -> Any:
    """A box's text as a number: 65536, 6.5e4, 2^16 or 2**16; None for an empty box; the text itself when it is
    not a number (the page then says so)."""
    if v is None or (isinstance(v, str) and not v.strip()):
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    text = str(v).strip().replace(" ", "")
    m = re.fullmatch(r"2(?:\^|\*\*)(-?\d{1,4})", text)
    if m:
        return 2.0 ** int(m.group(1))
    try:
        return float(text)
    except ValueError:
        return text


def layout(ctx: Context, run: str, query: dict[str, Any]) -> Any:
    cfg = data.scaler_settings(ctx.trace(run))
    boxes = []
    for id_, label, key, param, steps in _INPUTS:
        value = query.get(param) or _shown(cfg[key])
        kids: list[Any] = [
            dcc.Input(
                id=id_,
                type="text",
                inputMode="decimal",  # type: ignore[arg-type]  # valid HTML (a keypad with a point); dash's Literal omits it
                value=value,
                debounce=True,
                spellCheck=False,
            )
        ]
        if steps:
            kids = [
                html.Button("÷2", id=id_ + "-halve", title=f"halve the {label}"),
                *kids,
                html.Button("×2", id=id_ + "-double", title=f"double the {label}"),
            ]
        boxes.append(html.Div([html.Label(label), html.Div(kids, className="stepper")], className="control"))
    return html.Div(
        [
            html.H2("What-if: loss-scale replay"),
            html.P(
                "Recorded gradient peaks replayed through GradScaler's rule: a step whose scaled gradients reach "
                "the FP16 max (65504) is skipped and the scale backs off; growth_interval clean steps in a row "
                "grow it. Numbers as 65536, 6.5e4 or 2^16.",
                className="muted",
            ),
            html.Div(id=ids.WHATIF_NOTE),
            html.Div(id=ids.WHATIF_SUGGESTIONS, className="suggestions"),
            html.Div(boxes, className="controls"),
            html.P(id=ids.WHATIF_SUMMARY),
            zoom_store(PAGE, query),
            graph(ids.WHATIF_GRAPH),
        ]
    )


# what GradScaler accepts, as (test, words); an emptied box keeps the run's own setting
_VALID: dict[str, tuple[Callable[[float], bool], str]] = {
    "init_scale": (lambda v: 0 < v < math.inf, "a positive number"),
    "growth_interval": (lambda v: v >= 1 and float(v).is_integer(), "a whole number of steps, at least 1"),
    "growth_factor": (lambda v: 1 < v < math.inf, "a number above 1 (the scale must grow)"),
    "backoff_factor": (lambda v: 0 < v < 1, "a number between 0 and 1 (the scale must shrink)"),
}


def settings(init: Any, interval: Any, growth: Any, backoff: Any) -> tuple[dict[str, int | float | None], str | None]:
    """The boxes' values as replay arguments (None: the run's own), or an error message for the page."""
    given = {"init_scale": init, "growth_interval": interval, "growth_factor": growth, "backoff_factor": backoff}
    labels = {key: label for _, label, key, _, _ in _INPUTS}
    out: dict[str, int | float | None] = {}
    for key, raw in given.items():
        v = parse(raw)
        if v is None:
            out[key] = None
            continue
        test, words = _VALID[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not test(v):
            return {}, f"The {labels[key].split(' (')[0]} should be {words}, but given {raw!r}."
        out[key] = int(v) if key == "growth_interval" else float(v)
    return out, None


def step(value: Any, factor: float, whole: bool) -> Any:
    """A box's value doubled or halved (a whole number stays whole and at least 1); unchanged when not a number."""
    v = parse(value)
    if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return dash.no_update
    out = v * factor
    if whole:
        out = max(1, round(out))
    return _shown(out)


def forward_note(ctx: Context, run: str, found: list[Diagnosis]) -> Any:
    """The callout for a run whose NaN/Inf come from the forward pass: changing the scale cannot help."""
    causes = [d for d in found if d.rule in FORWARD_RULES]
    for d in found:
        origins = (d.evidence or {}).get("origins") if d.rule == "loss-scale-collapse" else None
        if isinstance(origins, dict) and (origins.get("forward") or origins.get("input_batch") or origins.get("loss")):
            causes.append(d)
    if not causes:
        return None
    d = causes[0]
    where = f" in {d.layers[0]}" if d.layers else ""
    return html.Div(
        [
            html.B("Changing the loss scale cannot help this run. "),
            f"Its NaN/Inf values come from the forward pass{where} ({d.rule}: {d.title}): the loss scale only "
            "multiplies the loss after the forward pass, so every setting below still skips those steps. ",
            dcc.Link("The evidence", href=link_href(ctx, run, evidence.links(d)[0])) if evidence.links(d) else None,
            ".",
        ],
        className="callout",
        id="whatif-cannot-help",
    )


def suggestions(ctx: Context, run: str, found: list[Diagnosis]) -> list[Any]:
    """One link per scaler setting a finding suggests: the page with those values filled in."""
    out = []
    for d in found:
        for link in evidence.links(d):
            if link.page == PAGE and link.params:
                words = ", ".join(f"{k} {v}" for k, v in link.params)
                out.append(
                    dcc.Link(
                        f"Try {d.rule}'s suggestion: {words}", href=link_href(ctx, run, link), className="suggestion"
                    )
                )
    return out


def update(
    ctx: Context,
    init: Any,
    interval: Any,
    growth: Any,
    backoff: Any,
    version: Any,
    search: str | None,
    zoom: Any = None,
) -> Any:
    """(figure, summary, note, suggestions): the callback's work, as a plain function (the tests call it)."""
    run = run_of(ctx, search)
    tr = ctx.trace(run) if run else None
    if not run or tr is None:
        return {}, "unknown run", None, None
    # the replay starts first and runs while the diagnosis is waited for: the two waits overlap, each its own length
    until = time.monotonic() + 2.0
    args, error = settings(init, interval, growth, backoff)

    def job(t: Any) -> Any:
        with t.snapshot():  # the evidence and the recorded scale of one content
            ev, recorded = ctx.replay_inputs(run, t)
            return data.whatif(t, evidence=ev, recorded=recorded, **args)

    def replay(wait: float) -> Any:
        """The replay's state; None while the diagnosis reads the evidence (its pass over the peaks is the one the
        replay needs: the page redraws when it is handed over). Waited for when its inputs are in memory (then it
        steps the scaler only) or the run is short; else the recorded scale is drawn at once and the replay when
        done (a long run's first replay reads the recorded scale of every step, ~2 s at 10^6 steps)."""
        if ctx.evidence_coming(run):
            return None
        quick = wait > 0 and (ctx.n_steps(run) <= QUICK_STEPS or ctx.replay_ready(run))
        return ctx.background(run, ("whatif", tuple(sorted(args.items()))), job, wait=wait if quick else 0.0)

    ctx.diagnosis_state(run)  # started (or read from the cache) first: the replay's evidence may come with it
    if not error:
        replay(0.0)
    # the findings (the notes, the suggested settings) are waited for as long as a short run's diagnosis takes; a long
    # run's takes seconds (a diagnosis kept on disk, a fraction of one): its notes come with the page's redraw
    st = ctx.diagnosis_state(run, wait=1.0 if ctx.n_steps(run) <= QUICK_STEPS else 0.25)
    found = list(st.value or []) if st is not None else []
    note, sug = forward_note(ctx, run, found), suggestions(ctx, run, found)
    if error:
        return dash.no_update, html.Span(error, id="whatif-error", className="bad"), note, sug
    state = replay(max(0.0, until - time.monotonic()))
    if state is None or state.value is None or not state.current:  # the recorded scale at once, then the replay
        r = data.recorded_scale(tr, ctx.steps(run, *(zoom_range(zoom) or (None, None))))
        fig = figures.whatif_figure(r, x_range=zoom_range(zoom), uirevision=uirevision(run, PAGE))
        if state is None:
            words = f"replaying GradScaler over {r['n']:,} steps: reading the trace with the diagnosis"
            return fig, words, note, sug
        if state.error and not state.running:
            return fig, html.Span(f"The replay failed: {state.error}", id="whatif-error", className="bad"), note, sug
        return fig, f"replaying GradScaler over {r['n']:,} steps: {state.elapsed():.0f} s", note, sug
    r = state.value
    fig = figures.whatif_figure(r, x_range=zoom_range(zoom), uirevision=uirevision(run, PAGE))
    s = r["settings"]
    last = r["simulated"][-1] if len(r["simulated"]) else float("nan")
    text = (
        f"simulated: {int(r['simulated_skipped'].sum())} skipped step(s), final scale {last:g} "
        f"(recorded: {int(r['recorded_skipped'].sum())} skipped) with init {s['init_scale']:g}, "
        f"interval {s['growth_interval']}, growth {s['growth_factor']:g}, backoff {s['backoff_factor']:g}"
        f" [{r['engine']}]"
    )
    return fig, text, note, sug


def register(app: dash.Dash, ctx: Context) -> None:
    @app.callback(
        Output(ids.WHATIF_GRAPH, "figure"),
        Output(ids.WHATIF_SUMMARY, "children"),
        Output(ids.WHATIF_NOTE, "children"),
        Output(ids.WHATIF_SUGGESTIONS, "children"),
        *[Input(i[0], "value") for i in _INPUTS],
        Input(ids.VERSION, "data"),
        State(ids.URL, "search"),
        Input(ids.ZOOMS[PAGE], "data"),
    )
    def _update(
        init: Any, interval: Any, growth: Any, backoff: Any, version: Any, search: str | None, zoom: Any
    ) -> Any:
        return update(ctx, init, interval, growth, backoff, version, search, zoom)

    for id_, _, key, _, steps in _INPUTS:
        if not steps:
            continue
        whole = key == "growth_interval"

        @app.callback(
            Output(id_, "value", allow_duplicate=True),
            Input(id_ + "-double", "n_clicks"),
            Input(id_ + "-halve", "n_clicks"),
            State(id_, "value"),
            prevent_initial_call=True,
        )
        def _step(_d: Any, _h: Any, value: Any, _whole: bool = whole, _id: str = id_) -> Any:
            up = dash.ctx.triggered_id == _id + "-double"
            return step(value, 2.0 if up else 0.5, _whole)

    link_zoom(app, PAGE)

    write_state(
        app,
        PAGE,
        [Input(i[0], "value") for i in _INPUTS],
        lambda run, *values: [(p, v) for (_, _, _, p, _), v in zip(_INPUTS, values)],
    )
