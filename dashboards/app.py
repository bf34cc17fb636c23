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
import threading
import time
from urllib.parse import urlencode

import dash
from dash import Input, Output, State, dcc, html
from dash.exceptions import DependencyException
from flask import Response, request

from ampdoctor.trace import TraceError

from . import catalog, diagnosis, hosts, ids, ranks, server
from .pages import compare, formats, layer, layers, overview, precision, whatif
from .pages.common import href, parse_search

PAGES = {  # path -> (nav label, module)
    "/": ("Overview", overview),
    "/layers": ("Layers", layers),
    "/layer": (None, layer),
    "/precision": ("Precision map", precision),
    "/whatif": ("What-if", whatif),
    "/formats": ("Formats", formats),
    "/compare": ("Compare", compare),
}
REFERENCE_KEY = "reference"
MAX_IDLE = 8  # open connections kept per trace file between requests
FINDINGS_EVERY_S = 5.0  # a growing trace is diagnosed again at most this often (a big run takes seconds)
_CSS = {
    "page": {
        "fontFamily": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif",
        "margin": "0 auto",
        "maxWidth": "1300px",
        "padding": "0.5em 1.5em",
        "color": "#222",
    },
    "nav": {
        "display": "flex",
        "gap": "1.2em",
        "alignItems": "center",
        "borderBottom": "1px solid #ddd",
        "paddingBottom": "0.5em",
        "marginBottom": "0.8em",
        "flexWrap": "wrap",
    },
    "error": {"color": "#d62728", "fontWeight": "bold"},
}
_log = logging.getLogger(__name__)


class Context:
    """What one app serves: the runs under its root, opened traces, and results cached per trace length.

    Flask answers requests on several threads and a Trace (one SQLite connection, its snapshot a transaction) is
    not for sharing: a request borrows one Trace per file from a pool and gives it back when it ends (release).
    """

    def __init__(self, root: str, reference: str | None = None, poll_ms: int = 1500, files: set | None = None):
        self.root = os.path.realpath(root)
        self.reference_path = reference
        self.poll_ms = poll_ms
        self._lock = threading.Lock()  # guards the dicts below; never held around file I/O
        self._idle: dict = {}  # path -> [Trace] not borrowed by any thread
        self._local = threading.local()  # .held: path -> Trace borrowed by this thread
        self._cache: dict = {}
        self._runs: tuple[float, dict] = (0.0, {})
        self._findings: dict = {}  # run key -> (steps, time, (findings, error))
        self.files = files  # a glob or list of one run's files: only these are served
        self._rank_meta: dict = {}  # path -> (rank, world size) from the trace's metadata

    def runs(self) -> dict:
        """Traces under the root (rescanned at most every second, so new runs show up)."""
        with self._lock:
            stamp, runs = self._runs
        if time.monotonic() - stamp > 1.0:
            # outside the lock: a slow disk delays one request
            runs = ranks.with_ranks(catalog.discover_runs(self.root), self._rank_meta, self.files)
            with self._lock:
                self._runs = (time.monotonic(), runs)
        return runs

    def resolve(self, key) -> catalog.Run | None:
        """The run a browser-supplied key names, or None: only keys of runs() (and the reference) exist."""
        if not isinstance(key, str):
            return None
        if key == REFERENCE_KEY and self.reference_path:
            path = os.path.realpath(self.reference_path)
            return catalog.Run(REFERENCE_KEY, path, "reference: " + os.path.basename(path), None)
        return self.runs().get(key)

    def default_key(self) -> str | None:
        runs = self.runs()
        return next(iter(runs), None)

    def trace(self, key):
        """This thread's open Trace of a run key, or None (unknown key or unreadable file)."""
        run = self.resolve(key)
        if run is None:
            return None
        held = self._held()
        tr = held.get(run.path)
        if tr is None:
            with self._lock:
                idle = self._idle.get(run.path)
                tr = idle.pop() if idle else None
            if tr is not None and not server.renew(tr):  # server.py: replaced or changed, so opened and checked anew
                tr.close()
                tr = None
            if tr is None:
                try:
                    tr = server.open_trace(run.path)  # server.py: each query bounded in time
                except TraceError:
                    return None
            held[run.path] = tr
        return tr

    def _held(self) -> dict:
        if not hasattr(self._local, "held"):
            self._local.held = {}
        return self._local.held

    def release(self) -> None:
        """Give the traces this thread borrowed back to the pool (at the end of each request)."""
        held, self._local.held = self._held(), {}
        surplus = []
        with self._lock:
            for path, tr in held.items():
                idle = self._idle.setdefault(path, [])
                (idle if len(idle) < MAX_IDLE else surplus).append(tr)
        for tr in surplus:
            tr.close()

    def cached(self, key: str, what, fn):
        """``fn()`` computed once per (run, trace length, what): a live trace invalidates itself as it grows."""
        tr = self.trace(key)
        if tr is None:
            return None
        n = (server.generation(tr), tr.n_steps)  # server.py: a file replaced by another is another trace
        k = (key, n, what)
        with self._lock:
            if k in self._cache:
                return self._cache[k]
        value = fn(tr)
        with self._lock:
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[k] = value
        return value

    def findings(self, key: str) -> list:
        return self.findings_and_error(key)[0]

    def findings_and_error(self, key: str) -> tuple[list, str | None]:
        """The run's findings, worst first, and None; or [] and the error when a rule failed on this snapshot of
        a live trace (the next poll tries again): someone else's rule never breaks the page.

        While a trace grows the rules run again at most every FINDINGS_EVERY_S seconds, not on every poll.
        """
        tr = self.trace(key)
        if tr is None:
            return [], None
        n = (server.generation(tr), tr.n_steps)  # server.py: a file replaced by another is another trace
        with self._lock:
            last = self._findings.get(key)
        if last is not None and (last[0] == n or time.monotonic() - last[1] < FINDINGS_EVERY_S):
            return last[2]
        ref = self.trace(REFERENCE_KEY) if self.reference_path and key != REFERENCE_KEY else None
        try:
            found = diagnosis.findings(tr, ref) + ranks.group_findings(self, key)  # + the run's rank rules
            result = (sorted(found, key=lambda d: diagnosis.SEVERITY_ORDER.get(d.severity, 3)), None)
        except Exception as exc:
            result = ([], f"{type(exc).__name__}: {exc}")
        with self._lock:
            self._findings[key] = (n, time.monotonic(), result)
        return result


def run_options(ctx: Context) -> list[dict]:
    """Run picker entries: per-rank traces of one run next to each other, then the reference."""
    runs = sorted(ctx.runs().items(), key=lambda kv: (kv[1].group, kv[1].rank or 0, kv[0]))
    options = [{"label": catalog.run_label(r), "value": k} for k, r in runs]
    if ctx.reference_path:
        options.append({"label": "reference: " + os.path.basename(ctx.reference_path), "value": REFERENCE_KEY})
    return options


def header(ctx: Context, pathname: str, run: str | None):
    links = [
        dcc.Link(
            label,
            href=href(path, run),
            id=f"nav-{path.strip('/') or 'overview'}",
            style={"fontWeight": "bold" if path == pathname else "normal"},
        )
        for path, (label, _) in PAGES.items()
        if label
    ]
    return html.Div(
        [
            html.B("ampdoctor"),
            *links,
            html.Div(
                dcc.Dropdown(
                    id=ids.RUN_PICKER, options=run_options(ctx), value=run, clearable=False, placeholder="no traces yet"
                ),
                style={"minWidth": "320px", "marginLeft": "auto"},
            ),
        ],
        id=ids.NAV,
        style=_CSS["nav"],
    )


def render(ctx: Context, pathname: str | None, search: str | None):
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
    files=None,
    host_policy: hosts.HostPolicy | None = None,
) -> dash.Dash:
    """A Dash app serving the traces at or under ``root`` (nothing else on the file system; only ``files``, real
    paths, when given), to requests for the host names of ``host_policy`` (default: loopback names only)."""
    ctx = Context(root, reference, poll_ms, files)
    policy = host_policy or hosts.HostPolicy()
    app = dash.Dash(
        __name__,
        title="ampdoctor",
        suppress_callback_exceptions=True,
        assets_folder=os.path.join(os.path.dirname(__file__), "assets"),
        serve_locally=True,
        update_title=None,
        on_error=_failed,
    )
    app.ampdoctor = ctx
    server.harden(app)  # server.py: request size limit, security headers
    app.layout = html.Div(
        [
            dcc.Location(id=ids.URL, refresh="callback-nav"),
            dcc.Interval(id=ids.POLL, interval=poll_ms),
            dcc.Store(id=ids.VERSION),
            html.Div(id=ids.HEADER),
            html.Div(id=ids.ERROR, style=_CSS["error"]),
            html.Div(id=ids.PAGE),
        ],
        style=_CSS["page"],
    )

    @app.server.before_request
    def _check_host():
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

    @app.server.teardown_request
    def _release(_exc):
        ctx.release()

    @app.callback(
        Output(ids.HEADER, "children"),
        Output(ids.PAGE, "children"),
        Output(ids.ERROR, "children"),
        Input(ids.URL, "pathname"),
        Input(ids.URL, "search"),
    )
    def _route(pathname, search):
        return (*render(ctx, pathname, search), None)

    @app.callback(
        Output(ids.URL, "pathname", allow_duplicate=True),
        Output(ids.URL, "search", allow_duplicate=True),
        Input(ids.RUN_PICKER, "value"),
        State(ids.URL, "pathname"),
        State(ids.URL, "search"),
        prevent_initial_call=True,
    )
    def _pick(run, pathname, search):
        if not run or parse_search(search).get("run") == run:
            return dash.no_update, dash.no_update
        # the same view of the other run; a layer detail goes to the overview (site ids differ between runs)
        return ("/" if pathname == "/layer" else dash.no_update), "?" + urlencode({"run": run})

    @app.callback(
        Output(ids.VERSION, "data"),
        Input(ids.POLL, "n_intervals"),
        State(ids.URL, "search"),
        State(ids.VERSION, "data"),
    )
    def _poll(_, search, old):
        run = parse_search(search).get("run") or ctx.default_key()
        tr = ctx.trace(run)
        if tr is None:
            return dash.no_update
        new = {"run": run, "n": tr.n_steps}
        return dash.no_update if new == old else new

    @app.callback(
        Output(ids.RUN_PICKER, "options"),
        Output(ids.URL, "search", allow_duplicate=True),
        Input(ids.POLL, "n_intervals"),
        State(ids.RUN_PICKER, "options"),
        State(ids.URL, "search"),
        prevent_initial_call=True,
    )
    def _new_runs(_, options, search):
        """Traces that appear under the root join the picker; the first one opens if none was shown yet."""
        new = run_options(ctx)
        if new == (options or []):
            return dash.no_update, dash.no_update
        first = not options and new and not parse_search(search).get("run")
        return new, ("?" + urlencode({"run": new[0]["value"]}) if first else dash.no_update)

    for _, module in PAGES.values():
        module.register(app, ctx)

    @app.server.errorhandler(DependencyException)
    def _unknown_file(_):  # a made-up component-suite path ("../..."): not found, not a 500 with a traceback
        return "not found", 404

    return app
