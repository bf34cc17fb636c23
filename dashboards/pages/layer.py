"""Layer detail: one site's statistic over the steps (its NaN/Inf steps as bands, the FP16 limit drawn), its exponent
histogram against the FP16/BF16 ranges on the same step axis, the other kinds of the same module, and the findings
that name it. Opened by a site id, or by a layer path and kind (what a finding's link names)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from dash import Input, Output, State, dcc, html

from ampdoctor import formats

from .. import data, diagnosis, figures, ids, matrix, series
from .common import (
    address,
    finding_card,
    graph,
    highlight,
    href,
    link_zoom,
    parse_search,
    run_of,
    state_search,
    uirevision,
    zoom_pairs,
    zoom_range,
    zoom_store,
)

if TYPE_CHECKING:
    import dash

    from ..context import Context

PAGE = "/layer"


def _site(ctx: Context, run: Any, search: str | None) -> Any:
    """(trace, site info) for the URL's site (an id, or a path and kind), or (trace, None)."""
    tr = ctx.trace(run) if run else None
    q = parse_search(search)
    raw = q.get("site", "")
    if tr is None:
        return tr, None
    if re.fullmatch(r"[0-9]{1,15}", raw):  # not str.isdigit: that takes "²", int() does not
        return tr, data.site_info(tr, int(raw))
    if q.get("path"):
        kind = q.get("kind") if q.get("kind") in matrix.KINDS else None
        return tr, data.find_site(tr, q["path"], kind)
    return tr, None


def layout(ctx: Context, run: str, query: dict[str, Any]) -> Any:
    stat = query.get("stat") if query.get("stat") in matrix.STATS else "absmax_log2"
    return html.Div(
        [
            html.Div(id=ids.LAYER_TITLE),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("statistic"),
                            dcc.Dropdown(
                                id=ids.LAYER_STAT,
                                value=stat,
                                clearable=False,
                                options=[{"label": s.label, "value": k} for k, s in matrix.STATS.items()],
                            ),
                        ],
                        className="control wide",
                    ),
                    html.Button("whole run", id=ids.RESET_ZOOM + "-layer", title="show every step"),
                ],
                className="controls",
            ),
            zoom_store(PAGE, query),
            graph(ids.LAYER_SERIES),
            graph(ids.LAYER_HIST),
            html.H3("Findings that name this layer"),
            html.Div(id=ids.LAYER_FINDINGS),
        ]
    )


def update(ctx: Context, version: Any, search: str | None, stat: Any = "absmax_log2", zoom: Any = None) -> Any:
    """(title, histogram, series, findings): the callback's work, as a plain function (the tests call it)."""
    run = run_of(ctx, search)
    tr, site = _site(ctx, run, search)
    if site is None or run is None:  # (no site without a run)
        return (
            html.Div([html.H3("No such layer"), dcc.Link("Layers", href=href("/layers", run))], id="no-such-layer"),
            {},
            {},
            None,
        )
    stat = stat if stat in matrix.STATS else "absmax_log2"
    sid, kind = int(site["id"]), site["kind"]
    r = zoom_range(zoom)
    n = series.n_steps(tr)
    shown = r or ((0, n - 1) if n else None)
    hl = highlight(parse_search(search))
    zp = zoom_pairs(zoom)
    same = tr.sites()
    same = same[same["module"] == site["module"]]
    siblings = [
        dcc.Link(
            f"{matrix.KIND_LABELS.get(s.kind, s.kind)}: {s.path}",
            href=href(PAGE, run, [("site", int(s.id)), ("stat", stat), *zp]),
            className="sibling",
        )
        for s in same.itertuples()
        if int(s.id) != sid
    ]
    title = html.Div(
        [
            html.H2(f"{site['path']} · {matrix.KIND_LABELS.get(kind, kind)}", id="layer-name"),
            html.P(
                f"{site.get('module_type') or 'parameter'} · dtype {site.get('dtype')} · shape {site.get('shape')}"
                + (" · values scaled by the loss scale" if kind == "grad_out" else ""),
                className="muted",
            ),
            html.P(["Same module: ", *[html.Span([c, "  "]) for c in siblings]]) if siblings else None,
        ]
    )
    x, y, bad = matrix.site_series(tr, sid, stat, *(r or (None, None)))
    spec = matrix.STATS[stat]
    limits = []
    dtype = str(site.get("dtype") or "")
    if stat == "absmax_log2" and kind in ("act", "grad_out"):
        fmt = formats.BF16 if dtype == "bfloat16" else formats.FP16
        limits.append((f"{'BF16' if fmt is formats.BF16 else 'FP16'} max {fmt.max:g}", math.log2(fmt.max)))
    rev = uirevision(run, PAGE, sid)
    fig = figures.site_stat_figure(
        spec.label,
        x,
        y,
        log2=spec.log2,
        nonfinite=bad,
        limits=limits,
        title=f"{spec.label} of {site['path']} ({matrix.KIND_LABELS.get(kind, kind)})",
        highlight=hl,
        x_range=shown,
        uirevision=rev,
        share=spec.share,
    )
    hs, counts = matrix.site_hist(tr, sid, *(r or (None, None)))
    scales = None
    if kind == "grad_out" and len(hs):  # the loss scale at the histogram steps only (a seek each, not every step)
        scales = series.values_at(tr, "loss_scale", hs).tolist()
    hist = figures.exponent_hist_figure(
        hs, counts, scales, kind=matrix.KIND_LABELS.get(kind, kind), x_range=shown, highlight=hl, uirevision=rev
    )
    st = ctx.diagnosis_state(run)
    found = [
        d
        for d in (st.value or [] if st is not None else [])
        if diagnosis.finding_mentions(d, str(site["path"])) or diagnosis.finding_mentions(d, str(site["module"]))
    ]
    if st is None or (st.value is None and st.running):
        cards: Any = html.P("Diagnosing…", className="muted")
    else:
        cards = [finding_card(d, run, ctx) for d in found] or html.P("No finding names this layer.")
    return title, hist, fig, cards


def register(app: dash.Dash, ctx: Context) -> None:
    @app.callback(
        Output(ids.LAYER_TITLE, "children"),
        Output(ids.LAYER_HIST, "figure"),
        Output(ids.LAYER_SERIES, "figure"),
        Output(ids.LAYER_FINDINGS, "children"),
        Input(ids.VERSION, "data"),
        Input(ids.LAYER_STAT, "value"),
        Input(ids.ZOOMS[PAGE], "data"),
        State(ids.URL, "search"),
    )
    def _update(version: Any, stat: Any, zoom: Any, search: str | None) -> Any:
        return update(ctx, version, search, stat, zoom)

    link_zoom(app, PAGE, ids.RESET_ZOOM + "-layer")

    @app.callback(
        Output(ids.URL_WANT, "data", allow_duplicate=True),
        Input(ids.LAYER_STAT, "value"),
        Input(ids.ZOOMS[PAGE], "data"),
        State(ids.URL, "search"),
        prevent_initial_call=True,
    )
    def _state(stat: Any, zoom: Any, search: str | None) -> Any:
        q = parse_qs((search or "").lstrip("?"))
        run = next(iter(q.get("run") or []), None)
        keep = [(k, q[k][0]) for k in ("site", "path", "kind") if k in q]
        kept = [(k, v) for k in ("hl",) for v in q.get(k, [])]
        return address(PAGE, search, state_search(run, keep + [("stat", stat)] + zoom_pairs(zoom) + kept))
