"""What the pages share: URLs and the view state they carry, charts with their data download, tables, finding
cards with their evidence links, and the line that says what runs in the background."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import parse_qs, urlencode

from dash import dcc, html

from .. import diagnosis, evidence, figures, ids

if TYPE_CHECKING:
    import dash

    from ampdoctor.rules.result import Diagnosis

    from ..context import Context

SEVERITY_COLORS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}
GRAPH_CONFIG: Any = figures.GRAPH_CONFIG  # (plotly's config keys; dash types them as its Config TypedDict)


# -- URLs ------------------------------------------------------------------------------------------------------
def parse_search(search: str | None) -> dict[str, str]:
    """The URL's parameters, the first value of each."""
    q = parse_qs((search or "").lstrip("?"))
    return {k: v[0] for k, v in q.items() if v}


def parse_all(search: str | None, key: str) -> list[str]:
    """Every value of a repeated URL parameter (``sel=a&sel=b``)."""
    return parse_qs((search or "").lstrip("?")).get(key, [])


def href(path: str, run: str | None, params: Any = (), **kw: Any) -> str:
    """``path?run=...&...``: ``params`` as (key, value) pairs (keys may repeat), then ``kw``; None values left out."""
    pairs = ([("run", run)] if run else []) + list(params) + list(kw.items())
    pairs = [(k, v) for k, v in pairs if v is not None and v != ""]
    return path + ("?" + urlencode(pairs) if pairs else "")


def run_of(ctx: Context, search: str | None) -> str | None:
    """The run key a request is about (the URL's, else the first run); None when it names no served trace."""
    run = parse_search(search).get("run") or ctx.default_key()
    return run if ctx.resolve(run) is not None else None


def number(v: Any, default: Any = None) -> Any:
    """A URL parameter as a finite float, else ``default``."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return default
    return f if math.isfinite(f) else default


def step_range(query: dict[str, Any]) -> tuple[int, int] | None:
    """The zoom a URL carries (x0, x1), or None."""
    a, b = number(query.get("x0")), number(query.get("x1"))
    if a is None or b is None:
        return None
    a, b = int(a), int(b)
    return (a, b) if a <= b else (b, a)


def highlight(query: dict[str, Any]) -> tuple[int, int] | None:
    """The finding steps a URL outlines ("hl=a-b"), or None."""
    m = re.fullmatch(r"\s*(\d{1,12})\s*-\s*(\d{1,12})\s*", str(query.get("hl") or ""))
    return (int(m.group(1)), int(m.group(2))) if m else None


def zoom_store(page: str, query: dict[str, Any]) -> dcc.Store:
    """The page's shared zoom, seeded from the URL."""
    r = step_range(query)
    return dcc.Store(id=ids.ZOOMS[page], data={"x0": r[0], "x1": r[1]} if r else None)


def zoom_pairs(zoom: Any) -> list[tuple[str, Any]]:
    r = zoom_range(zoom)
    return [("x0", r[0]), ("x1", r[1])] if r else []


def link_zoom(app: dash.Dash, page: str, reset_id: str | None = None) -> None:
    """Zooming any step chart of ``page`` zooms them all (a double click resets): a clientside callback
    (assets/ampdoctor.js) writes the page's zoom store, which the page's figure callbacks take as input."""
    from dash import ClientsideFunction, Input, Output, State

    inputs = [Input(g, "relayoutData") for g in ids.STEP_GRAPHS[page]]
    if reset_id is not None:
        inputs.append(Input(reset_id, "n_clicks"))
    app.clientside_callback(  # type: ignore[no-untyped-call]  # (dash does not annotate it)
        ClientsideFunction("ampdoctor", "zoom"),
        Output(ids.ZOOMS[page], "data", allow_duplicate=True),
        *inputs,
        State(ids.ZOOMS[page], "data"),
        prevent_initial_call=True,
    )


def write_state(
    app: dash.Dash,
    page: str,
    inputs: list[Any],
    pairs_fn: Callable[..., Iterable[tuple[str, Any]]],
    keep: tuple[str, ...] = ("hl", "sel"),
) -> None:
    """Keep the address bar in step with a view: ``pairs_fn(run, *values)`` -> the view's URL parameters; the
    ``keep`` parameters of the link that opened the view (a finding's steps and layers) stay."""
    from dash import Output, State

    @app.callback(
        Output(ids.URL_WANT, "data", allow_duplicate=True),
        *inputs,
        State(ids.URL, "search"),
        prevent_initial_call=True,
    )
    def _state(*args: Any) -> Any:
        *values, search = args
        run = parse_search(search).get("run")
        q = parse_qs((search or "").lstrip("?"))
        kept = [(k, v) for k in keep for v in q.get(k, [])]
        return address(page, search, state_search(run, list(pairs_fn(run, *values)) + kept))


def address(page: str, opened: str | None, search: str) -> dict[str, str]:
    """An address-bar write of ``page``'s view, opened at ``opened`` (the navigation's query): the browser applies
    it only while that navigation is the current one (assets/ampdoctor.js), so that an answer arriving after the
    user has followed a link leaves the next page's address alone."""
    return {"page": page, "opened": opened or "", "search": search}


def zoom_range(zoom: Any) -> tuple[int, int] | None:
    if not isinstance(zoom, dict):
        return None
    a, b = number(zoom.get("x0")), number(zoom.get("x1"))
    if a is None or b is None:
        return None
    return (math.floor(min(a, b)), math.ceil(max(a, b)))


def state_search(run: str | None, pairs: Any) -> str:
    """The address bar's query for a view: the run, then the view's settings in a fixed order."""
    return "?" + urlencode([("run", run)] + [(k, v) for k, v in pairs if v is not None and v != ""]) if run else ""


def uirevision(run: Any, *parts: Any) -> str:
    """One value per view: while it stays the same, the browser keeps the user's zoom and legend toggles on
    every figure the server sends again (live updates)."""
    return "|".join(str(p) for p in (run, *parts))


# -- pieces of a page ------------------------------------------------------------------------------------------
def graph(id_: str, **kw: Any) -> html.Div:
    """A chart with a "CSV" button that downloads what it shows (in the browser, from the figure's data)."""
    data_attr: dict[str, Any] = {"data-graph": id_}  # (a data-* attribute: dash takes it as a keyword)
    return html.Div(
        [
            html.Button("CSV", className="csv-download", title="download the data this chart shows (CSV)", **data_attr),
            dcc.Graph(id=id_, config=GRAPH_CONFIG, **kw),
        ],
        className="chart",
    )


def table(
    rows: list[dict[str, Any]],
    id_: Any = None,
    bad_col: str | None = "verdict",
    highlight: Any = (),
    key_col: str | None = None,
) -> Any:
    """A data table with a "CSV" button; rows whose ``key_col`` is in ``highlight`` are outlined, ``bad_col``'s cells
    marked unless "ok", empty or a dash. One component: the rows travel as JSON in its ``data-rows`` attribute and the
    browser draws them (assets/ampdoctor.js ``drawTable``, as text: a layer name is never markup). A Dash component a
    cell would cost the page's renderer ~2.5 ms each: 100 rows of 10 columns held the Formats page for 2.5-3 s."""
    if not rows:
        return html.P("nothing recorded", id=id_) if id_ else html.P("nothing recorded")
    head = list(rows[0])
    col = head.index(bad_col) if bad_col in head else -1
    cells = [[str(v) for v in r.values()] for r in rows]
    spec = {
        "head": head,
        "rows": cells,
        "bad": [i for i, c in enumerate(cells) if col >= 0 and c[col] not in ("ok", "", "–")],
        "col": col,
        "highlight": [i for i, r in enumerate(rows) if key_col and r.get(key_col) in highlight],
    }
    kw: dict[str, Any] = {"id": id_} if id_ else {}
    kw["data-rows"] = json.dumps(spec, separators=(",", ":"))  # (a data-* attribute: dash takes it as a keyword)
    data_attr: dict[str, Any] = {"data-table": id_ or ""}
    return html.Div(
        [
            html.Button("CSV", className="csv-download", title="download this table (CSV)", **data_attr),
            html.Table(className="data-table", **kw),
        ],
        className="table-wrap",
    )


def prose(text: str) -> list[Any]:
    """Recommendation prose as plain text, a paragraph a line, with `code` spans. Never Markdown: a layer name in
    the text is user data, and Markdown would turn ``![x](http://host/track)`` into an image the browser fetches."""
    paras: list[Any] = []
    for line in text.splitlines():
        parts = re.split(r"`([^`]+)`", line.strip())
        kids = [html.Code(p) if i % 2 else p for i, p in enumerate(parts) if p]
        if kids:
            paras.append(html.P(kids, className="recommendation-text"))
    return paras


def status_line(ctx: Context, run: str) -> Any:
    """What runs in the background for this run, in words and seconds; the last error when it failed."""
    parts: list[Any] = []
    st = ctx.diagnosis_state(run)
    if st is not None:
        if st.running:
            what = "diagnosing again" if st.value is not None else "diagnosing"
            parts.append(html.Span(f"{what}: {st.elapsed():.0f} s", className="busy", id="diagnosis-status"))
        elif st.error and not st.current:
            parts.append(html.Span(f"diagnosis failed: {st.error}", className="bad", id="diagnosis-status"))
    sm_state = ctx.summary_state(run)  # (the charts start it: a status poll reads nothing)
    if sm_state is not None and sm_state.running:
        parts.append(html.Span(f"summarising every step: {sm_state.elapsed():.0f} s", className="busy"))
    return parts or None


def _resolve(ctx: Context, run: str, link: evidence.Link) -> str:
    """The run key a link opens: the finding's own run, or the trace of the rank it names."""
    if link.rank is None:
        return run
    return ctx.peers(run).get(link.rank, run)


def link_href(ctx: Context, run: str, link: evidence.Link) -> str:
    return href(link.page, _resolve(ctx, run, link), link.query())


def finding_card(d: Diagnosis, run: str, ctx: Context, layer_links: bool = True) -> Any:
    """A finding: severity, rule, title, summary, its layers and steps as links to the views that show them, the
    evidence rows (labelled), the views that prove it, and the fix (code copyable)."""
    sev = str(getattr(d, "severity", "info"))
    color = SEVERITY_COLORS.get(sev, "#888")
    culprits: list[Any] = []
    for i, link in enumerate(evidence.culprit_links(d)[:12] if layer_links else []):
        culprits.append(dcc.Link(link.layer, href=link_href(ctx, run, link), className="culprit"))
        if i < len(d.layers) - 1:
            culprits.append(", ")
    if layer_links and len(d.layers) > 12:
        culprits.append(f"… ({len(d.layers)} layers in all)")
    views = evidence.links(d)
    steps = diagnosis.steps_label(d)
    step_el: Any = None
    if steps:
        target = next((v for v in views if dict(v.params).get("hl")), None)
        step_el = (
            dcc.Link(steps, href=link_href(ctx, run, target), className="finding-steps")
            if target
            else html.Span(steps, className="finding-steps")
        )
    rec: list[Any] = []
    for kind, chunk in diagnosis.fix_parts(d):
        if kind == "code":
            rec.append(
                html.Div(
                    [
                        dcc.Clipboard(content=chunk, title="copy", className="copy"),
                        html.Pre(html.Code(chunk)),
                    ],
                    className="code",
                )
            )
        else:
            rec.extend(prose(chunk))
    ev = diagnosis.evidence_items(d)
    return html.Div(
        [
            html.Div(
                [
                    html.Span(sev.upper(), className="severity", style={"color": color}),
                    html.Code(str(d.rule), className="rule-id"),
                    html.Span(diagnosis.ranks_label(d), className="ranks"),
                ]
            ),
            html.H4(str(d.title)),
            html.P(str(getattr(d, "summary", "") or "")),
            html.P(
                [
                    *([html.B("Layers: "), *culprits, " "] if culprits else []),
                    *([html.B("Steps: "), step_el] if step_el is not None else []),
                ]
            )
            if culprits or step_el is not None
            else None,
            html.Div(
                [html.B("Evidence: ")]
                + [dcc.Link(v.label, href=link_href(ctx, run, v), className="evidence-link") for v in views],
                className="evidence-links",
            )
            if views
            else None,
            html.Table([html.Tr([html.Th(k), html.Td(v)]) for k, v in ev], className="evidence") if ev else None,
            html.Details([html.Summary("Recommendation"), *rec], open=True),
        ],
        className=f"finding finding-{sev}",
        style={"borderLeftColor": color},
    )


def pager(id_: str, page: int = 1) -> dcc.Dropdown:
    """The page picker of a long list (its options set by the list's callback: pager_options)."""
    return dcc.Dropdown(
        id=id_,
        options=[{"label": "page 1", "value": 1}],
        value=page,
        clearable=False,
        className="pager-pick",
        searchable=False,
    )


def pager_options(page: Any, total: int, per: int) -> tuple[list[dict[str, Any]], int, str]:
    """(options, the page shown, "51-100 of 1,000"): nothing is cut without saying so."""
    pages = max(1, -(-total // per))
    page = min(max(1, int(number(page, 1))), pages)
    a, b = (page - 1) * per + 1, min(total, page * per)
    words = f"{a:,}–{b:,} of {total:,}" if total else "none"
    return [{"label": f"page {i} of {pages}", "value": i} for i in range(1, pages + 1)], page, words
