"""The Dash app factory: one app per root (a trace file or a directory of traces).

Pages are modules with ``layout(ctx, run, query)`` and ``register(app, ctx)``; routing is one callback on the URL.
(Not ``dash.register_page``: its registry and ``dash.callback`` are process-wide, and the factory must be able to
build independent apps side by side, for several roots and in the tests.)
The browser names a trace only by its key in ``Context.runs()`` (its path relative to the root); nothing it sends
is ever joined to a file system path.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import urlencode

import dash
import flask
from dash import ClientsideFunction, Input, Output, State, dcc, html
from dash.exceptions import DependencyException
from flask import Response, request

from . import catalog, hosts, ids, plotlyjs, series, server
from .context import REFERENCE_KEY, Context
from .pages import compare, formats, layer, layers, overview, precision, whatif
from .pages import ranks as ranks_page
from .pages.common import href, parse_search, status_line

PAGES = {  # path -> (nav label, module)
    "/": ("Overview", overview),
    "/layers": ("Layers", layers),
    "/layer": (None, layer),
    "/precision": ("Precision map", precision),
    "/whatif": ("What-if", whatif),
    "/formats": ("Formats", formats),
    "/compare": ("Compare", compare),
    "/ranks": ("Ranks", ranks_page),
}
_log = logging.getLogger(__name__)


def run_options(ctx: Context) -> list[dict[str, Any]]:
    """Run picker entries: per-rank traces of one run next to each other, then the reference."""
    runs = sorted(ctx.runs().items(), key=lambda kv: (kv[1].group, kv[1].rank or 0, kv[0]))
    options = [{"label": catalog.run_label(r), "value": k} for k, r in runs]
    if ctx.reference_path:
        options.append({"label": "reference: " + os.path.basename(ctx.reference_path), "value": REFERENCE_KEY})
    return options


def header(ctx: Context, pathname: str, run: str | None) -> Any:
    links = [
        dcc.Link(
            label,
            href=href(path, run),
            id=f"nav-{path.strip('/') or 'overview'}",
            className="nav-link current" if path == pathname else "nav-link",
        )
        for path, (label, _) in PAGES.items()
        if label and (path != "/ranks" or (run and len(ctx.peers(run)) > 1))
    ]
    return html.Div(
        [
            html.B("ampdoctor", className="brand"),
            *links,
            html.Div(
                dcc.Dropdown(
                    id=ids.RUN_PICKER, options=run_options(ctx), value=run, clearable=False, placeholder="no traces yet"
                ),
                className="run-picker",
            ),
        ],
        id=ids.NAV,
        className="nav",
    )


def render(ctx: Context, pathname: str | None, search: str | None) -> Any:
    """(header, page) for a URL. Unknown runs and pages get a message, never a file system lookup."""
    pathname = pathname or "/"
    query = parse_search(search)
    run = query.get("run")
    if run is None:
        run = ctx.default_key()
    head = header(ctx, pathname, run if ctx.resolve(run) else None)
    if pathname not in PAGES:
        return head, html.Div([html.H3("No such page"), dcc.Link("Overview", href=href("/", run))])
    if run is None:
        return head, html.Div(
            [
                html.H3("No traces yet"),
                html.P(
                    "Nothing under the served path looks like an ampdoctor trace; "
                    "new traces appear here as training writes them."
                ),
            ]
        )
    if ctx.resolve(run) is None:
        return head, html.Div(
            [
                html.H3("Unknown run"),
                html.P("This run is not one of the traces served here."),
                dcc.Link("Back to the first run", href=href("/", ctx.default_key())),
            ],
            id="unknown-run",
        )
    if ctx.trace(run) is None:
        return head, html.Div([html.H3("Unreadable trace"), html.P(f"{run} could not be opened as a trace.")])
    return head, PAGES[pathname][1].layout(ctx, run, query)


def _failed(exc: Exception) -> None:
    """A callback that raised: its outputs stay as they were and the page says what went wrong (not a 500)."""
    _log.error("callback failed", exc_info=exc)
    dash.set_props(ids.ERROR, {"children": f"This view could not be updated: {type(exc).__name__}: {exc}"})


def create_app(
    root: str,
    reference: str | None = None,
    poll_ms: int = 1500,
    files: Any = None,
    host_policy: hosts.HostPolicy | None = None,
    diagnose_in: str = "process",
) -> dash.Dash:
    """A Dash app serving the traces at or under ``root`` (nothing else on the file system; only ``files``, real
    paths, when given), to requests for the host names of ``host_policy`` (default: loopback names only)."""
    ctx = Context(root, reference, poll_ms, files, diagnose_in)
    policy = host_policy or hosts.HostPolicy()
    app = dash.Dash(
        __name__,
        title="ampdoctor",
        suppress_callback_exceptions=True,
        assets_folder=os.path.join(os.path.dirname(__file__), "assets"),
        serve_locally=True,
        update_title=None,  # type: ignore[arg-type]  # None: no title change while updating (dash accepts it)
        on_error=_failed,
    )
    app.ampdoctor = ctx  # type: ignore[attr-defined]  # the Context, for `ampdoctor serve` and the tests
    server.harden(app)  # server.py: request size limit, security headers
    app.layout = html.Div(
        [
            dcc.Location(id=ids.URL, refresh="callback-nav"),
            # the view's own settings (kind, statistic, zoom, what-if values) are written here: into the address
            # bar and the history, without a navigation (refresh=False), so that a URL restores the view
            dcc.Location(id=ids.URL_STATE, refresh=False),
            dcc.Store(id=ids.URL_WANT),
            dcc.Interval(id=ids.POLL, interval=poll_ms),
            dcc.Store(id=ids.VERSION),
            html.Div(id=ids.HEADER),
            html.Div(id=ids.STATUS, className="status"),
            html.Div(id=ids.ERROR, className="page-error"),
            html.Div(id=ids.PAGE),
        ],
        className="page",
    )

    flask_app: flask.Flask = app.server
    partial = plotlyjs.bundle()
    if partial is not None:  # the partial plotly.js where Dash's renderer fetches plotly.js (a rule of its own)
        flask_app.add_url_rule(
            app.config.routes_pathname_prefix + plotlyjs.DASH_PATH,
            "ampdoctor-plotlyjs",
            lambda: flask.send_file(partial, mimetype="text/javascript", conditional=True),
        )

    @flask_app.before_request
    def _check_host() -> Any:
        ok = policy.allows(request.host)
        if ok:
            return None
        if ok is None:
            return Response("ampdoctor: malformed Host header\n", 400, mimetype="text/plain")
        return Response(
            f"ampdoctor: this dashboard answers requests for {policy.shown()} only (a guard against "
            f"DNS rebinding); to open it under another name, start it with --allow-host NAME\n",
            403,
            mimetype="text/plain",
        )

    @flask_app.teardown_request
    def _release(_exc: Any) -> Any:
        ctx.release()

    @app.callback(
        Output(ids.HEADER, "children"),
        Output(ids.PAGE, "children"),
        Output(ids.ERROR, "children"),
        Input(ids.URL, "pathname"),
        Input(ids.URL, "search"),
    )
    def _route(pathname: str | None, search: str | None) -> Any:
        return (*render(ctx, pathname, search), None)

    @app.callback(
        Output(ids.URL, "pathname", allow_duplicate=True),
        Output(ids.URL, "search", allow_duplicate=True),
        Input(ids.RUN_PICKER, "value"),
        State(ids.URL, "pathname"),
        State(ids.URL, "search"),
        prevent_initial_call=True,
    )
    def _pick(run: Any, pathname: str | None, search: str | None) -> Any:
        if not run or parse_search(search).get("run") == run:
            return dash.no_update, dash.no_update
        # the same view of the other run; a layer detail goes to the overview (site ids differ between runs)
        return ("/" if pathname == "/layer" else dash.no_update), "?" + urlencode({"run": run})

    app.clientside_callback(  # type: ignore[no-untyped-call]  # (dash does not annotate it)
        ClientsideFunction("ampdoctor", "address"),
        Output(ids.URL_STATE, "search"),
        Input(ids.URL_WANT, "data"),
        State(ids.URL, "pathname"),
        State(ids.URL, "search"),
        prevent_initial_call=True,
    )

    @app.callback(
        Output(ids.VERSION, "data"),
        Input(ids.POLL, "n_intervals"),
        State(ids.URL, "search"),
        State(ids.VERSION, "data"),
    )
    def _poll(_: Any, search: str | None, old: Any) -> Any:
        run = parse_search(search).get("run") or ctx.default_key()
        tr = ctx.trace(run)
        if tr is None:
            return dash.no_update
        new = {"run": run, "n": series.n_steps(tr), "g": ctx.generation()}
        return dash.no_update if new == old else new

    @app.callback(
        Output(ids.STATUS, "children"),
        Input(ids.POLL, "n_intervals"),
        Input(ids.URL, "search"),
    )
    def _status(_: Any, search: str | None) -> Any:
        """What is being computed in the background for this run, and for how long ("diagnosing: 3 s")."""
        run = parse_search(search).get("run") or ctx.default_key()
        if run is None or ctx.resolve(run) is None or ctx.trace(run) is None:
            return None
        return status_line(ctx, run)

    @app.callback(
        Output(ids.RUN_PICKER, "options"),
        Output(ids.URL, "search", allow_duplicate=True),
        Input(ids.POLL, "n_intervals"),
        State(ids.RUN_PICKER, "options"),
        State(ids.URL, "search"),
        prevent_initial_call=True,
    )
    def _new_runs(_: Any, options: Any, search: str | None) -> Any:
        """Traces that appear under the root join the picker; the first one opens if none was shown yet."""
        new = run_options(ctx)
        if new == (options or []):
            return dash.no_update, dash.no_update
        first = not options and new and not parse_search(search).get("run")
        return new, ("?" + urlencode({"run": new[0]["value"]}) if first else dash.no_update)

    for _, module in PAGES.values():
        module.register(app, ctx)

    @flask_app.errorhandler(DependencyException)
    def _unknown_file(_: Any) -> tuple[str, int]:
        # a made-up component-suite path ("../..."): not found, not a 500 with a traceback
        return "not found", 404

    return app
