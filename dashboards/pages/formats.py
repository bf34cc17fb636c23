"""Formats: per layer, what FP16 / BF16 / FP8 (E4M3, E5M2 with delayed scaling) would lose, ranked by the format
the run computes in (or the one a finding asks about), and the precision-loss probe's measured error against FP32.
The probe results are read in the background; the formats table comes with the diagnosis (from the rules' own reads of
the trace, cached on disk with the findings); the page says what it waits for meanwhile."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from dash import Input, Output, State, dcc, html

from .. import data, figures, ids
from .common import graph, pager, pager_options, parse_all, run_of, table, write_state
from .layers import matches

if TYPE_CHECKING:
    import dash

    from ..context import Context

PAGE = "/formats"
PER_PAGE = 100


def layout(ctx: Context, run: str, query: dict[str, Any]) -> Any:
    by = query.get("fmt") if query.get("fmt") in data.FORMAT_NAMES else data.default_format(ctx.trace(run))
    return html.Div(
        [
            html.H2("Formats"),
            html.P(
                "Recomputed in FP32 from the same inputs on probed steps, each layer's half-precision output has the "
                "relative error below; the dotted line is sqrt(k)*u, what rounding explains for a layer summing k "
                "terms. A layer far above it loses precision to cancellation (rule precision-loss).",
                className="muted",
            ),
            html.P(id=ids.FORMATS_VERDICT),
            graph(ids.FORMATS_PROBE),
            html.P(
                "From the exponent histograms: the share of each site's non-zero values that would saturate or "
                "flush to zero in FP16 / BF16 (as recorded: output gradients at the recorded loss scale) and in FP8 "
                "with per-tensor delayed scaling (amax over the last 1024 steps, margin 0; E4M3 448 .. 2^-9, E5M2 "
                "57344 .. 2^-16). Headroom: binades between the largest value and the format's overflow; span: "
                "binades from the smallest to the largest non-zero value (E4M3 holds 17.8, E5M2 31.8).",
                className="muted",
            ),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("rank the layers by what they lose in"),
                            dcc.Dropdown(
                                id=ids.FORMATS_BY,
                                value=by,
                                clearable=False,
                                options=[{"label": v, "value": k} for k, v in data.FORMAT_NAMES.items()],
                            ),
                        ],
                        className="control",
                    ),
                    html.Div(
                        [
                            html.Label("search layers (text, or /regex/)"),
                            dcc.Input(
                                id=ids.FORMATS_SEARCH,
                                type="search",
                                value=query.get("q", ""),
                                debounce=True,
                                style={"width": "100%"},
                            ),
                        ],
                        className="control wide",
                    ),
                    pager(ids.FORMATS_BY + "-page", 1),
                ],
                className="controls",
            ),
            graph(ids.FORMATS_SHARES),
            html.Div(id=ids.FORMATS_TABLE + "-wrap"),
        ]
    )


def update(ctx: Context, by: Any, q: Any, page: Any, version: Any, search: str | None) -> Any:
    """(verdict, probe figure, shares figure, table, pager options): the callback's work (the tests call it)."""
    run = run_of(ctx, search)
    tr = ctx.trace(run) if run else None
    if not run or tr is None or by not in data.FORMAT_NAMES:
        return None, {}, {}, None, []
    sel = parse_all(search, "sel")
    # the probe's read starts first and runs while the diagnosis is waited for: the two waits overlap
    until = time.monotonic() + 2.0

    def read_probe(wait: float) -> Any:
        return ctx.background(run, ("probe", tuple(sel)), lambda t: data.probe_series(t, include=sel), wait=wait)

    read_probe(0.0)
    lost_by_site, st, error = ctx.formats_table(run, wait=2.0)
    probe = read_probe(max(0.0, until - time.monotonic()))
    if probe.value is None:
        verdict = f"reading the probe results ({probe.elapsed():.0f} s)" if probe.running else probe.error
        probe_fig = figures.empty("Probe: relative error against FP32", verdict or "")
    else:
        series, bounds, verdicts = probe.value
        named = [v["path"] for v in verdicts if v["named"]]
        verdict = (
            f"Measured precision loss: {', '.join(named)}"
            if named
            else "No layer measured above its bound."
            if verdicts
            else "No probe results in this trace: attach(..., probe_every=N) records them."
        )
        probe_fig = figures.probe_error_figure(series, bounds, highlight=set(sel))
    if lost_by_site is None:
        if st is not None and st.value is None and st.running:
            words = f"diagnosing: {st.elapsed():.0f} s (the formats table comes from the same reads of the trace)"
        elif st is not None and st.error and st.value is None:
            words = f"The diagnosis failed: {st.error}"
        else:
            words = f"The formats table failed: {error}" if error else "waiting for the diagnosis"
        return verdict, probe_fig, figures.empty("Share of non-zero values lost per format", words), None, []
    # FP16 / BF16 come first: the FP8 columns wait for the diagnosis' pass over every step's peaks (their amax history)
    pending = data.fp8_pending(lost_by_site)
    since = f" ({st.elapsed():.0f} s)" if st is not None and st.running else ""
    waiting = f"E4M3 / E5M2 (…): reading the amax of every observed step for their delayed scaling{since}"
    if pending and f"{by}_lost" not in lost_by_site.columns:  # ranked by the run's own format meanwhile
        by = data.default_format(tr)
    name = data.FORMAT_NAMES[by]
    labels, lost = data.formats_shares(lost_by_site, by)
    if sel:
        more_labels, more = data.formats_shares(lost_by_site, by, only=sel)
        for lab, i in zip(more_labels, range(len(more_labels))):
            if lab not in labels:
                labels.append(lab)
                for k in lost:
                    lost[k] = list(lost[k]) + [more[k][i]]
    fig = figures.formats_figure(
        labels, lost, name, highlight={f"{p} ({k})" for p in sel for k in ("activations", "output gradients")}
    )
    rows = data.formats_rows(lost_by_site, by)
    keep = matches([r["layer"] for r in rows], q)
    rows = [r for r, k in zip(rows, keep) if k]
    if sel:
        rows = [r for r in rows if r["layer"] in sel] + [r for r in rows if r["layer"] not in sel]
    options, page, words = pager_options(page, len(rows), PER_PAGE)
    part = rows[(page - 1) * PER_PAGE : page * PER_PAGE]
    listing = [
        html.P(f"sites {words}, worst in {name} first" + (f". {waiting}" if pending else ""), className="muted"),
        table(part, ids.FORMATS_TABLE, bad_col=None, highlight=set(sel), key_col="layer"),
    ]
    return verdict, probe_fig, fig, listing, options


def register(app: dash.Dash, ctx: Context) -> None:
    @app.callback(
        Output(ids.FORMATS_VERDICT, "children"),
        Output(ids.FORMATS_PROBE, "figure"),
        Output(ids.FORMATS_SHARES, "figure"),
        Output(ids.FORMATS_TABLE + "-wrap", "children"),
        Output(ids.FORMATS_BY + "-page", "options"),
        Input(ids.FORMATS_BY, "value"),
        Input(ids.FORMATS_SEARCH, "value"),
        Input(ids.FORMATS_BY + "-page", "value"),
        Input(ids.VERSION, "data"),
        State(ids.URL, "search"),
    )
    def _update(*args: Any) -> Any:
        return update(ctx, *args)

    write_state(
        app,
        PAGE,
        [Input(ids.FORMATS_BY, "value"), Input(ids.FORMATS_SEARCH, "value")],
        lambda run, by, q: [("fmt", by), ("q", q)],
    )
