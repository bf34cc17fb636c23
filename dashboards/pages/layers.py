"""Layers: a layer x step heat map of one statistic for one kind of site, for models of any width: search, filter,
grouping by module prefix, worst-first order, log or clipped colour scale, a page of rows at a time with every row
labelled (never silently cut), the layers a finding names outlined; click a row for the layer's detail."""

from __future__ import annotations

import html as html_lib
import re
from typing import TYPE_CHECKING, Any

import dash
import numpy as np
from dash import Input, Output, State, dcc, html

from .. import data, figures, ids, matrix
from .common import (
    graph,
    href,
    link_zoom,
    number,
    pager,
    pager_options,
    parse_all,
    run_of,
    uirevision,
    write_state,
    zoom_pairs,
    zoom_range,
    zoom_store,
)

if TYPE_CHECKING:
    from ampdoctor.trace import Trace

    from .. import jobs
    from ..context import Context

PAGE = "/layers"
PER_PAGE = 50
MATRIX_WAIT_S = 1.0  # the longest a request waits for a matrix read in the background
SCALES = {"linear": "linear", "log": "log", "clip": "linear, outliers clipped"}


def kinds_of(tr: Trace) -> list[str]:
    have = set(tr.sites()["kind"])
    return [k for k in matrix.KINDS if k in have] or ["act"]


def layout(ctx: Context, run: str, query: dict[str, Any]) -> Any:
    tr = ctx.trace(run)
    st = ctx.diagnosis_state(run)
    d_kind, d_stat = data.default_view(tr, st.value if st is not None and st.value else None)
    kinds = kinds_of(tr)
    kind = query.get("kind") if query.get("kind") in kinds else (d_kind if d_kind in kinds else kinds[0])
    stat = query.get("stat") if query.get("stat") in matrix.STATS else d_stat
    sort = query.get("sort") if query.get("sort") in ("worst", "order") else "worst"
    scale = query.get("scale") if query.get("scale") in SCALES else "linear"
    group = int(number(query.get("group"), 0) or 0)
    return html.Div(
        [
            html.Div(
                [
                    _control(
                        "kind",
                        dcc.Dropdown(
                            id=ids.LAYERS_KIND,
                            value=kind,
                            clearable=False,
                            options=[{"label": matrix.KIND_LABELS[k], "value": k} for k in kinds],
                        ),
                    ),
                    _control(
                        "statistic",
                        dcc.Dropdown(
                            id=ids.LAYERS_STAT,
                            value=stat,
                            clearable=False,
                            options=[{"label": s.label, "value": k} for k, s in matrix.STATS.items()],
                        ),
                        wide=True,
                    ),
                    _control(
                        "search layers (text, or /regex/)",
                        dcc.Input(
                            id=ids.LAYERS_SEARCH,
                            type="search",
                            value=query.get("q", ""),
                            debounce=True,
                            placeholder="e.g. attn or /layers\\.1[0-9]\\./",
                            style={"width": "100%"},
                        ),
                        wide=True,
                    ),
                    _control(
                        "group by module prefix",
                        dcc.Dropdown(
                            id=ids.LAYERS_GROUP,
                            value=group,
                            clearable=False,
                            options=[{"label": "no grouping", "value": 0}]
                            + [
                                {"label": f"first {i} part{'s' if i > 1 else ''} of the path", "value": i}
                                for i in range(1, 6)
                            ],
                        ),
                    ),
                    _control(
                        "order",
                        dcc.RadioItems(
                            id=ids.LAYERS_SORT,
                            value=sort,
                            inline=True,
                            options=[
                                {"label": " worst first ", "value": "worst"},
                                {"label": " model order", "value": "order"},
                            ],
                        ),
                    ),
                    _control(
                        "colour scale",
                        dcc.Dropdown(
                            id=ids.LAYERS_SCALE,
                            value=scale,
                            clearable=False,
                            options=[{"label": v, "value": k} for k, v in SCALES.items()],
                        ),
                    ),
                    dcc.Checklist(
                        id=ids.LAYERS_ONLY,
                        options=[{"label": " only layers with a value above 0", "value": "nonzero"}],
                        value=["nonzero"] if query.get("only") == "nonzero" else [],
                    ),
                ],
                className="controls",
            ),
            html.Div(
                [
                    html.Span(id=ids.LAYERS_COUNT, className="muted"),
                    pager(ids.LAYERS_PAGE, int(number(query.get("page"), 1))),
                ],
                className="pager",
            ),
            zoom_store(PAGE, query),
            html.Div(
                [graph(ids.LAYERS_HEATMAP), html.Div(id=ids.LAYERS_LIST, className="layer-list")], className="layers"
            ),
        ]
    )


def _control(label: Any, component: Any, wide: bool = False) -> Any:
    return html.Div([html.Label(label), component], className="control wide" if wide else "control")


def matches(labels: list[str], q: str) -> np.ndarray:
    """Which labels a search keeps: a case-insensitive substring, or a regular expression written as /.../
    (an invalid one matches nothing)."""
    q = (q or "").strip()
    if not q:
        return np.ones(len(labels), bool)
    if len(q) > 2 and q.startswith("/") and q.endswith("/"):
        try:
            rx = re.compile(q[1:-1], re.IGNORECASE)
        except re.error:
            return np.zeros(len(labels), bool)
        return np.array([bool(rx.search(p)) for p in labels], bool)
    q = q.lower()
    return np.array([q in p.lower() for p in labels], bool)


def selected(label: str, sel: Any, params: bool = False) -> bool:
    """Is a row one of the layers a link outlines: the layer itself, or (rows of parameters) a parameter of that
    module."""
    return label in sel or (params and any(label.rpartition(".")[0] == p for p in sel))


def grouped(m: matrix.LayerMatrix, depth: int) -> matrix.LayerMatrix:
    """Rows merged by the first ``depth`` parts of their path (the worst of each group per column), labelled
    "prefix.* (n layers)"; a group of one keeps its layer."""
    if depth <= 0 or not len(m.labels):
        return m
    keys = [".".join(p.split(".")[:depth]) for p in m.labels]
    order = list(dict.fromkeys(keys))
    members = {k: [i for i, kk in enumerate(keys) if kk == k] for k in order}
    labels, ids_, types, vals, bad = [], [], [], [], []
    for k in order:
        rows = members[k]
        if len(rows) == 1:
            labels.append(m.labels[rows[0]])
            types.append(m.types[rows[0]])
        else:
            labels.append(f"{k}.* ({len(rows)} layers)")
            types.append("group")
        ids_.append(m.site_ids[rows[0]] if len(rows) == 1 else -1)
        with np.errstate(all="ignore"):
            v = m.values[rows]
            vals.append(
                np.where(np.isfinite(v).any(axis=0), np.nanmax(np.where(np.isfinite(v), v, -np.inf), axis=0), np.nan)
            )
        bad.append(m.nonfinite[rows].any(axis=0) if m.nonfinite is not None else np.zeros(len(m.steps), bool))
    g = matrix.LayerMatrix(
        m.stat,
        m.kind,
        m.steps,
        np.array(ids_),
        labels,
        types,
        np.array(vals).reshape(len(labels), len(m.steps)),
        np.array(bad).reshape(len(labels), len(m.steps)),
    )
    g.preview, g.recorded = m.preview, m.recorded
    return g


def get_matrix(ctx: Context, run: str, kind: str, stat: str, r: Any) -> tuple[matrix.LayerMatrix, jobs.State | None]:
    """The matrix of a range: read now when it is small, else a preview now and the whole in the background."""
    tr = ctx.trace(run)
    x0, x1 = r or (None, None)
    rows = matrix.cost(tr, kind, stat, x0, x1)
    if rows <= matrix.EXACT_ROWS:
        return ctx.cached(run, ("matrix", kind, stat, r), lambda t: matrix.layer_matrix(t, kind, stat, x0, x1)), None

    def whole(t: Any) -> matrix.LayerMatrix:
        return matrix.layer_matrix(t, kind, stat, x0, x1)

    state = ctx.background(run, ("matrix", kind, stat, r), whole, 0.0)
    # waited for only when it can end within the wait (it has read for a while): else the preview shows at once
    left = rows / matrix.READ_ROWS_PER_S - state.elapsed()
    if state.value is None and state.running and left <= MATRIX_WAIT_S:
        state = ctx.background(run, ("matrix", kind, stat, r), whole, MATRIX_WAIT_S)
    if state.value is not None:
        return state.value, state
    prev = ctx.cached(
        run, ("matrix-preview", kind, stat, r), lambda t: matrix.layer_matrix(t, kind, stat, x0, x1, preview=True)
    )
    return prev, state


def update(
    ctx: Context,
    kind: Any,
    stat: Any,
    sort: Any,
    q: Any,
    group: Any,
    scale: Any,
    only: Any,
    page: Any,
    version: Any,
    zoom: Any,
    search: str | None,
) -> Any:
    """(heat map, list, count, pager options, page): the callback's work, as a plain function (tests call it)."""
    run = run_of(ctx, search)
    tr = ctx.trace(run) if run else None
    if not run or tr is None or kind not in matrix.KINDS or stat not in matrix.STATS:
        return {}, None, "", [], 1
    r = zoom_range(zoom)
    m, state = get_matrix(ctx, run, kind, stat, r)
    sel = set(parse_all(search, "sel"))
    params = kind in ("param_grad", "weight", "update")
    keep = matches(m.labels, q)
    if "nonzero" in (only or []):
        keep &= np.nan_to_num(m.worst, nan=0.0, posinf=1.0) > 0
    g = grouped(m, int(group or 0))
    if int(group or 0) > 0:  # the search applies to the layers inside a group
        gkeys = [".".join(p.split(".")[: int(group)]) for p in m.labels]
        wanted = {gkeys[i] for i in np.flatnonzero(keep)}
        keep = np.array(
            [lab.split(".* (")[0] in wanted or lab in {m.labels[i] for i in np.flatnonzero(keep)} for lab in g.labels],
            bool,
        )
    order = [i for i in g.order(sort) if keep[i]]
    if sel and sort == "worst":  # the layers a finding names first
        first = [i for i in order if selected(g.labels[i], sel, params)]
        order = first + [i for i in order if i not in set(first)]
    options, page, words = pager_options(page, len(order), PER_PAGE)
    rows = order[(page - 1) * PER_PAGE : page * PER_PAGE]
    share = matrix.STATS[stat].share
    stat_note = ""
    if m.preview:
        since = f" ({state.elapsed():.0f} s)" if state is not None and state.running else ""
        stat_note = f"; preview of {m.values.shape[1]} of {m.recorded:,} recorded steps, the rest is being read{since}"
    elif state is not None and not state.current and state.running:
        stat_note = f"; updating ({state.elapsed():.0f} s)"
    fig = figures.layer_heatmap(
        g,
        rows,
        scale=scale,
        highlight={g.labels[i] for i in rows if selected(g.labels[i], sel, params)},
        x_range=r,
        uirevision=uirevision(run, PAGE, kind, stat, scale),
    )
    if m.preview:
        figures.note(fig, f"preview: {m.values.shape[1]} of {m.recorded:,} recorded steps")
    zp = zoom_pairs(zoom)
    items = []
    for i in rows:
        lab = g.labels[i]
        if g.site_ids[i] >= 0:
            target = href("/layer", run, [("site", int(g.site_ids[i])), ("stat", stat), *zp])
        else:
            target = href(PAGE, run, [("kind", kind), ("stat", stat), ("q", lab.split(".* (")[0] + "."), *zp])
        items.append(
            html.Li(
                [
                    dcc.Link(lab, href=target, className="layer-link", id=f"layer-link-{i}-{int(g.site_ids[i])}"),
                    html.Span(
                        f" {g.types[i]} · worst {matrix.fmt(g.worst[i], share)}"
                        + (" · NaN/Inf recorded" if g.any_nonfinite[i] and np.isfinite(g.worst[i]) else ""),
                        className="num",
                    ),
                ],
                className="highlight" if selected(lab, sel, params) else None,
            )
        )
    total = len(m.labels)
    count = f"{len(order):,} of {total:,} layers" if len(order) != total else f"{total:,} layers"
    count += f" · {words}" + stat_note
    listing = [html.Ol(items, start=(page - 1) * PER_PAGE + 1)] if items else [html.P("No layer matches.")]
    return fig, listing, count, options, page


def open_clicked(ctx: Context, click: Any, kind: Any, stat: Any, search: str | None) -> Any:
    """(pathname, search) of the row a heat map click names (its label, as figures.text shows it): a layer opens
    its detail, a group narrows the list to it."""
    run = run_of(ctx, search)
    tr = ctx.trace(run)
    try:
        label = str(click["points"][0]["y"])
        if label.endswith(" layers)") and ".* (" in label:
            prefix = html_lib.unescape(label.split(".* (")[0])
            return PAGE, href("", run, [("kind", kind), ("stat", stat), ("q", prefix + ".")])
        sites = tr.sites(kind)
        site = int(sites.loc[[figures.text(p) == label for p in sites["path"]], "id"].iloc[0])
    except (TypeError, KeyError, IndexError, ValueError, AttributeError):
        return dash.no_update, dash.no_update
    return "/layer", href("", run, [("site", site), ("stat", stat)])


def register(app: dash.Dash, ctx: Context) -> None:
    inputs = [
        Input(ids.LAYERS_KIND, "value"),
        Input(ids.LAYERS_STAT, "value"),
        Input(ids.LAYERS_SORT, "value"),
        Input(ids.LAYERS_SEARCH, "value"),
        Input(ids.LAYERS_GROUP, "value"),
        Input(ids.LAYERS_SCALE, "value"),
        Input(ids.LAYERS_ONLY, "value"),
        Input(ids.LAYERS_PAGE, "value"),
    ]

    @app.callback(
        Output(ids.LAYERS_HEATMAP, "figure"),
        Output(ids.LAYERS_LIST, "children"),
        Output(ids.LAYERS_COUNT, "children"),
        Output(ids.LAYERS_PAGE, "options"),
        *inputs,
        Input(ids.VERSION, "data"),
        Input(ids.ZOOMS[PAGE], "data"),
        State(ids.URL, "search"),
    )
    def _update(*args: Any) -> Any:
        return update(ctx, *args)[:4]

    @app.callback(
        Output(ids.LAYERS_PAGE, "value"),
        Input(ids.LAYERS_KIND, "value"),
        Input(ids.LAYERS_STAT, "value"),
        Input(ids.LAYERS_SEARCH, "value"),
        Input(ids.LAYERS_GROUP, "value"),
        Input(ids.LAYERS_ONLY, "value"),
        Input(ids.LAYERS_SORT, "value"),
        prevent_initial_call=True,
    )
    def _first_page(*_: Any) -> Any:  # another selection starts at its first page
        return 1

    @app.callback(
        Output(ids.URL, "pathname", allow_duplicate=True),
        Output(ids.URL, "search", allow_duplicate=True),
        Input(ids.LAYERS_HEATMAP, "clickData"),
        State(ids.LAYERS_KIND, "value"),
        State(ids.LAYERS_STAT, "value"),
        State(ids.URL, "search"),
        prevent_initial_call=True,
    )
    def _click(click: Any, kind: Any, stat: Any, search: str | None) -> Any:
        return open_clicked(ctx, click, kind, stat, search)

    link_zoom(app, PAGE)

    def pairs(
        run: Any, kind: Any, stat: Any, sort: Any, q: Any, group: Any, scale: Any, only: Any, page: Any, zoom: Any
    ) -> Any:
        out = [("kind", kind), ("stat", stat)]
        out += [("sort", sort)] if sort != "worst" else []
        out += [("q", q)] if q else []
        out += [("group", group)] if group else []
        out += [("scale", scale)] if scale != "linear" else []
        out += [("only", "nonzero")] if "nonzero" in (only or []) else []
        out += [("page", page)] if page and page != 1 else []
        return out + zoom_pairs(zoom)

    write_state(app, PAGE, [*inputs, Input(ids.ZOOMS[PAGE], "data")], pairs)  # (the link's sel and hl stay)
