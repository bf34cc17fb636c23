"""The dashboard's limits: what one request may cost, what the pages may do in a browser, and traces that change
under the server.

- HTTP: request bodies up to MAX_BODY (413 beyond: a 300 MB JSON body took the server to 1.6 GB), a socket timeout on
  every connection (a client that stops sending is dropped) and at most MAX_CONNECTIONS connections at once (one
  thread each; further ones are answered 503 at once, no thread started).
- Headers: the pages show local data, so no other site may frame them (``X-Frame-Options``, CSP
  ``frame-ancestors``), run script in them (a Content-Security-Policy of the app's own files and the one inline
  script Dash writes, by its hash), sniff a type or learn the URL (``Referrer-Policy``).
- Traces: a served file replaced by rename (``rsync``, ``cp`` + ``mv``) or rewritten in place is opened and checked
  again; its schema changed under an open connection (a table replaced by a view) is noticed by SQLite's schema
  cookie and checked again; and every SQL statement on a trace is bounded in time (QUERY_LIMIT_S), so a query that
  would never end is interrupted and the page says so.
"""

from __future__ import annotations

import io
import math
import os
import socket
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import IO, TYPE_CHECKING, Any, Union

from flask import Flask, Response
from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

if TYPE_CHECKING:
    import dash
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

from ampdoctor.trace import Trace, load

_Request = Union[socket.socket, tuple[bytes, socket.socket]]  # what socketserver hands a handler
MAX_BODY = 8 * 2**20  # bytes of a request body: a callback's inputs and state are kilobytes
SOCKET_TIMEOUT_S = 20.0  # seconds a connection may stay silent while the server reads from it
MAX_CONNECTIONS = 64  # connections served at once (each is a thread)
QUERY_LIMIT_S = 60.0  # seconds one SQL statement on a trace may run (one of a 10^6-step trace takes a few)
REVALIDATE_S = 60.0  # a trace changed in place (a live one grows all the time) is checked again at most this often
_PROGRESS_OPS = 10_000  # SQLite virtual-machine steps between two looks at the clock (~0.1-1 ms)


# -- response headers ------------------------------------------------------------------------------------------------
def content_security_policy(script_hashes: Sequence[str]) -> str:
    """The pages' CSP: scripts, requests, fonts and images from this server only, the inline script Dash writes
    allowed by its hash; inline styles allowed (Dash's and plotly's components set them); framed by nobody."""
    return "; ".join(
        [
            "default-src 'self'",
            "script-src 'self' " + " ".join(script_hashes),
            "style-src 'self' 'unsafe-inline'",
            "img-src 'self' data: blob:",
            "font-src 'self' data:",
            "connect-src 'self'",
            "object-src 'none'",
            "base-uri 'none'",
            "form-action 'self'",
            "frame-ancestors 'none'",
        ]
    )


def harden(app: dash.Dash, max_body: int = MAX_BODY) -> None:
    """Bound ``app``'s request bodies and add the security headers to every response (a dash.Dash app)."""
    headers = {
        "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Content-Security-Policy": content_security_policy(app.csp_hashes()),
    }
    app.server.config["MAX_CONTENT_LENGTH"] = max_body  # a body with a larger Content-Length: 413 before it is read
    app.server.wsgi_app = _ChunkedBodyLimit(app.server.wsgi_app, max_body, headers)

    flask_app: Flask = app.server

    @flask_app.after_request
    def _headers(response: Response) -> Response:
        for name, value in headers.items():
            response.headers.setdefault(name, value)
        return response


class _ChunkedBodyLimit:
    """WSGI middleware: a chunked body (no Content-Length) is read here, up to ``max_body`` bytes, and handed on
    with its length; one longer is answered 413. (Flask's limit alone would cut it at ``max_body`` bytes and hand
    on the truncated JSON.)"""

    def __init__(self, app: WSGIApplication, max_body: int, headers: dict[str, str]) -> None:
        self.app, self.max_body, self.headers = app, max_body, headers

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        chunked = "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
        if chunked and not environ.get("CONTENT_LENGTH"):
            body = _read_at_most(environ["wsgi.input"], self.max_body + 1)
            if len(body) > self.max_body:
                text = b"ampdoctor: request body too large\n"
                start_response(
                    "413 Request Entity Too Large",
                    [("Content-Type", "text/plain"), ("Content-Length", str(len(text))), *self.headers.items()],
                )
                return [text]
            environ["wsgi.input"], environ["CONTENT_LENGTH"] = io.BytesIO(body), str(len(body))
        return self.app(environ, start_response)


def _read_at_most(stream: IO[bytes], n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = stream.read(min(n - len(out), 2**16))
        if not data:
            break
        out += data
    return bytes(out)


# -- the HTTP server -------------------------------------------------------------------------------------------------
class ListenError(Exception):
    """The server cannot listen on the address (in use, not an address of this machine, a name that resolves to
    nothing): one line for the command line."""


class _Handler(WSGIRequestHandler):
    protocol_version = "HTTP/1.1"  # as werkzeug's threaded server sets it (every response closes the connection)
    timeout = SOCKET_TIMEOUT_S  # socketserver sets it on the connection: a silent client is dropped

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # no line per request (the dashboard polls every second or two)


class BoundedServer(ThreadedWSGIServer):
    """werkzeug's threaded server with at most ``max_connections`` connections (threads) at once; one more is
    answered 503 and closed without a thread."""

    def __init__(
        self, host: str, port: int, app: WSGIApplication, max_connections: int = MAX_CONNECTIONS, timeout_s: float = 0
    ):
        handler = type("Handler", (_Handler,), {"timeout": timeout_s or SOCKET_TIMEOUT_S})
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(host, port, app, handler)

    def server_bind(self) -> None:
        try:
            super().server_bind()
        except OSError as exc:  # werkzeug would print it and exit 1
            raise ListenError(f"cannot listen on {self.host}:{self.port} ({exc.strerror or exc})") from None

    def server_activate(self) -> None:
        try:
            super().server_activate()
        except OSError as exc:
            raise ListenError(f"cannot listen on {self.host}:{self.port} ({exc.strerror or exc})") from None

    def process_request(self, request: _Request, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            _refuse(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: _Request, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _refuse(request: _Request) -> None:
    if not isinstance(request, socket.socket):
        return
    body = b"ampdoctor: too many connections at once; try again\n"
    try:
        request.settimeout(1.0)
        request.sendall(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            b"Retry-After: 1\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
    except OSError:
        pass


def make_server(
    app: dash.Dash, host: str, port: int, max_connections: int = MAX_CONNECTIONS, timeout_s: float = 0
) -> BoundedServer:
    """The server ``ampdoctor serve`` runs ``app`` on (``timeout_s`` 0: SOCKET_TIMEOUT_S); ListenError when it
    cannot listen."""
    return BoundedServer(host, port, app.server, max_connections, timeout_s)


# -- traces that change under the server -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Identity:
    """Which file a path names and its state: a rename gives another inode, a rewrite another size or time."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str) -> Identity | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def same_file(self, other: Identity | None) -> bool:
        return other is not None and (self.dev, self.ino) == (other.dev, other.ino)


@dataclass
class _Guard:
    identity: Identity | None  # the file's when it was checked
    schema: int  # SQLite's schema cookie then
    checked_at: float
    limit_s: float  # the longest a statement may run
    started: float = math.inf  # when the statement running now started

    def started_now(self, _sql: str) -> None:
        self.started = time.monotonic()

    def too_long(self) -> bool:
        return time.monotonic() - self.started > self.limit_s


_GUARDS: weakref.WeakKeyDictionary[Trace, _Guard] = weakref.WeakKeyDictionary()  # Trace -> _Guard


def open_trace(path: str, limit_s: float = QUERY_LIMIT_S) -> Trace:
    """``ampdoctor.load(path)`` (checked), its file identity and schema noted, and each of its statements from now
    on interrupted after ``limit_s`` seconds (a TraceError: the view says so)."""
    before = Identity.of(path)
    tr = load(path)
    return _guarded(tr, _Guard(before, _schema_cookie(tr), time.monotonic(), limit_s))


_TEMPLATES: dict[
    str, Trace
] = {}  # real path -> the Trace this process last opened and checked there (used under the lock only)
_TEMPLATES_LOCK = threading.Lock()


def _template(real: str) -> Trace:
    """The checked Trace of ``real`` while renew holds, else one opened and checked now (the caller holds the lock,
    so a replaced one is closed while nobody reads it: no descriptor is left on a replaced file)."""
    tr = _TEMPLATES.get(real)
    if tr is not None and renew(tr):
        return tr
    new = open_trace(real)
    if tr is not None:
        tr.close()
    _TEMPLATES[real] = new
    return new


def check(path: str) -> None:
    """Check the trace at ``path`` (TraceError when it cannot be read) and keep it: the reader's checks (seconds on a
    long run) run once per file per process however many parts ask (the command's argument check, the rank scan,
    the first request), and again when the file was replaced or changed REVALIDATE_S ago."""
    with _TEMPLATES_LOCK:
        _template(os.path.realpath(path))


def checked_meta(path: str) -> dict[str, Any]:
    """The metadata of the checked trace at ``path`` (see check)."""
    with _TEMPLATES_LOCK:
        return _template(os.path.realpath(path)).meta


def open_checked(path: str) -> Trace:
    """A Trace of ``path`` on a connection of its own (for one thread at a time), with the limits of open_trace,
    reopened from the checked one (see check) without the reader's checks again."""
    with _TEMPLATES_LOCK:
        tr = _template(os.path.realpath(path))
        return _guarded(tr.reopen(), replace(_GUARDS[tr], started=math.inf))


def _guarded(tr: Trace, guard: _Guard) -> Trace:
    _GUARDS[tr] = guard
    tr.connection.set_trace_callback(guard.started_now)  # called as each statement starts
    tr.connection.set_progress_handler(guard.too_long, _PROGRESS_OPS)  # called as it runs; True interrupts it
    return tr


def renew(tr: Trace) -> bool:
    """A request takes an open trace from the pool: False when it no longer reads what was checked (the file was
    replaced or is gone, its schema changed, or it changed and was last checked REVALIDATE_S ago or more: a live
    trace grows all the time); the caller then opens it anew."""
    guard = _GUARDS.get(tr)
    if guard is None:
        return True
    now = Identity.of(tr.path)
    if guard.identity is None or not guard.identity.same_file(now) or _schema_cookie(tr) != guard.schema:
        return False
    return now == guard.identity or time.monotonic() - guard.checked_at < REVALIDATE_S


def generation(tr: Trace) -> tuple[int, ...]:
    """What a result computed from ``tr`` depends on besides its length: the file it was read from."""
    guard = _GUARDS.get(tr)
    return (guard.identity.dev, guard.identity.ino) if guard is not None and guard.identity is not None else ()


def _schema_cookie(tr: Trace) -> int:
    """SQLite's schema version of the file now (-1 when it cannot be read): any change to a table or view bumps it."""
    try:
        return int(tr.connection.execute("PRAGMA schema_version").fetchone()[0])
    except sqlite3.Error:
        return -1
