"""Precision map: module by module, what the recommended allocation asks, what each module computed and kept, and
the verdict, which is the diagnosis itself (the findings that name the module): the map never judges on its own.
Summary counts first, then the modules (search, the flagged ones only, a page at a time)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from dash import Input, Output, State, dcc, html

from ampdoctor.precision_label import describe_precision

from .. import data, ids
from .common import pager, pager_options, parse_all, run_of, table, write_state
from .layers import matches

if TYPE_CHECKING:
    import dash

    from ..context import Context

PAGE = "/precision"
PER_PAGE = 50


def layout(ctx: Context, run: str, query: dict[str, Any]) -> Any:
    tr = ctx.trace(run)
    only = query.get("only") in ("1", "true", "flagged")
    return html.Div(
        [
            html.H2("Precision map"),
            html.P(describe_precision(tr.config)),
            html.P(
                "Recommended: matrix multiplies and convolutions compute in FP16/BF16; normalisation keeps its "
                "parameters and statistics in FP32; softmax runs in FP32 when its outputs underflow; the loss and the "
                "weight update (master weights) are FP32. The verdict is the diagnosis: the findings that name the "
                "module.",
                className="muted",
            ),
            html.Div(id=ids.PRECISION_SUMMARY),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("search modules (text, or /regex/)"),
                            dcc.Input(
                                id=ids.PRECISION_SEARCH,
                                type="search",
                                value=query.get("q", ""),
                                debounce=True,
                                style={"width": "100%"},
                            ),
                        ],
                        className="control wide",
                    ),
                    dcc.Checklist(
                        id=ids.PRECISION_ONLY,
                        options=[{"label": " only modules a finding names", "value": "flagged"}],
                        value=["flagged"] if only else [],
                    ),
                    pager(ids.PRECISION_PAGE, 1),
                ],
                className="controls",
            ),
            html.Div(id=ids.PRECISION_TABLE + "-wrap"),
        ]
    )


def update(ctx: Context, q: Any, only: Any, page: Any, version: Any, search: str | None) -> Any:
    """(summary, table): the callback's work, as a plain function (the tests call it)."""
    run = run_of(ctx, search)
    tr = ctx.trace(run) if run else None
    if not run or tr is None:
        return None, None, [], 1
    st = ctx.diagnosis_state(run, wait=1.0)
    found = st.value if st is not None and (st.current or st.value is not None) else None
    rows = ctx.cached(
        run,
        ("precision", st.version if st is not None and found is not None else None),
        lambda t: data.precision_rows(t, found),
    )
    sel = set(parse_all(search, "sel"))
    verdicts = Counter(
        "ok" if r["verdict"] == "ok" else "diagnosing" if r["verdict"].startswith("diagnosing") else "flagged"
        for r in rows
    )
    types = Counter((r["type"] or "–", r["forward"]) for r in rows if not r["module"].startswith("("))
    summary = html.Div(
        [
            html.P(
                f"{len(rows):,} rows: {verdicts.get('flagged', 0):,} named by a finding, {verdicts.get('ok', 0):,} ok"
                + (f", {verdicts['diagnosing']:,} waiting for the diagnosis" if verdicts.get("diagnosing") else ""),
                id="precision-counts",
            ),
            html.Details(
                [
                    html.Summary("module types and the dtype they computed in"),
                    html.Table(
                        [html.Tr([html.Th("type"), html.Th("forward dtype"), html.Th("modules")])]
                        + [html.Tr([html.Td(t), html.Td(d), html.Td(f"{c:,}")]) for (t, d), c in types.most_common()],
                        className="data-table",
                    ),
                ]
            ),
        ]
    )
    keep = matches([r["module"] for r in rows], q)
    shown = [r for r, k in zip(rows, keep) if k and ("flagged" not in (only or []) or r["verdict"] not in ("ok",))]
    # the modules a link names first, then the ones a finding names, then the rest (model order within each)
    shown = sorted(shown, key=lambda r: (r["module"] not in sel, r["verdict"] == "ok"))
    options, page, words = pager_options(page, len(shown), PER_PAGE)
    part = shown[(page - 1) * PER_PAGE : page * PER_PAGE]
    return (
        summary,
        [
            html.P(f"{words} modules shown", className="muted"),
            table(part, ids.PRECISION_TABLE, highlight=sel, key_col="module"),
        ],
        options,
        page,
    )


def register(app: dash.Dash, ctx: Context) -> None:
    @app.callback(
        Output(ids.PRECISION_SUMMARY, "children"),
        Output(ids.PRECISION_TABLE + "-wrap", "children"),
        Output(ids.PRECISION_PAGE, "options"),
        Input(ids.PRECISION_SEARCH, "value"),
        Input(ids.PRECISION_ONLY, "value"),
        Input(ids.PRECISION_PAGE, "value"),
        Input(ids.VERSION, "data"),
        State(ids.URL, "search"),
    )
    def _update(*args: Any) -> Any:
        return update(ctx, *args)[:3]

    @app.callback(
        Output(ids.PRECISION_PAGE, "value"),
        Input(ids.PRECISION_SEARCH, "value"),
        Input(ids.PRECISION_ONLY, "value"),
        prevent_initial_call=True,
    )
    def _first_page(*_: Any) -> Any:
        return 1

    write_state(
        app,
        PAGE,
        [Input(ids.PRECISION_SEARCH, "value"), Input(ids.PRECISION_ONLY, "value")],
        lambda run, q, only: [("q", q), ("only", 1 if "flagged" in (only or []) else None)],
    )
