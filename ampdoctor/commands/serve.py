"""`ampdoctor serve TRACE_OR_DIR [--host 127.0.0.1] [--port 8050] [--allow-host NAME] [--reference TRACE]`: the
dashboard.

Dash and plotly load inside run(): `ampdoctor --help` and this module's import stay fast."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..dashboards import hosts
from ..dashboards.hosts import is_loopback
from ..trace import load
from ..trace.run import is_multi, load_run
from .common import EXIT_OK, UsageError

MIN_POLL_S, MAX_POLL_S = 0.1, 86400.0  # below 0.1 s the page does little but poll; a day is "never"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        metavar="TRACE_OR_DIR",
        nargs="+",
        help="a trace file, or a directory: every trace under it (a run picker), or a glob or files of one run's ranks",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8050, help="port (default 8050)")
    parser.add_argument(
        "--allow-host",
        metavar="NAME",
        action="append",
        default=[],
        help="also answer requests for this host name (repeatable; '*': any). By default only "
        "loopback names are answered, and with a non-loopback --host also that address, "
        "this machine's names and IP addresses: a guard against DNS rebinding",
    )
    parser.add_argument(
        "--reference", metavar="TRACE", default=None, help="a healthy trace to compare with (e.g. the FP32 run)"
    )
    parser.add_argument(
        "--poll", metavar="SECONDS", type=float, default=1.5, help="seconds between checks for new steps (default 1.5)"
    )


def check(args: argparse.Namespace) -> None:
    """Validate the arguments: a missing path or a bad trace is a one-line error (exit 2)."""
    if len(args.path) == 1:
        args.path = args.path[0]
    if is_multi(args.path) and (isinstance(args.path, list) or not os.path.isdir(args.path)):  # a glob, files
        with load_run(args.path) as rr:
            args.files = {os.path.realpath(p) for p in rr.paths.values()}
        args.path = os.path.commonpath([os.path.dirname(p) for p in args.files])
    if not os.path.exists(args.path):
        raise UsageError(f"ampdoctor serve: {args.path}: no such file or directory")
    if not (os.path.isfile(args.path) or os.path.isdir(args.path)):
        raise UsageError(f"ampdoctor serve: {args.path}: not a regular file or a directory")
    if os.path.isfile(args.path):
        load(args.path).close()  # TraceError (one line, exit 2) on a bad file
    if args.reference:
        if not os.path.isfile(args.reference):
            raise UsageError(f"ampdoctor serve: --reference {args.reference}: no such file")
        load(args.reference).close()
    if not 0 < args.port < 65536:
        raise UsageError(f"ampdoctor serve: --port {args.port}: not a port number")
    if not MIN_POLL_S <= args.poll <= MAX_POLL_S:  # NaN too
        raise UsageError(f"ampdoctor serve: --poll {args.poll}: must be {MIN_POLL_S} to {MAX_POLL_S:g} seconds")
    for name in args.allow_host:
        if name.strip() != hosts.ANY and hosts.hostname(name) is None:
            raise UsageError(f"ampdoctor serve: --allow-host {name}: not a host name")


def run(args: argparse.Namespace) -> int:
    check(args)
    from ..dashboards import server
    from ..dashboards.app import create_app

    app = create_app(
        args.path,
        reference=args.reference,
        poll_ms=int(args.poll * 1000),
        files=getattr(args, "files", None),
        host_policy=hosts.for_bind(args.host, tuple(args.allow_host)),
    )
    try:
        httpd = server.make_server(app, args.host, args.port)  # limits: dashboards/server.py
    except server.ListenError as exc:
        raise UsageError(f"ampdoctor serve: {exc}") from None
    if os.path.isdir(args.path) and not app.ampdoctor.runs():
        print(f"ampdoctor serve: no traces under {args.path} yet; they appear as training writes them", file=sys.stderr)
    if not is_loopback(args.host):
        print(
            f"ampdoctor serve: WARNING: binding {args.host} lets anyone on the network who can reach port "
            f"{args.port} read these traces (model structure, losses, statistics); use 127.0.0.1 and an SSH "
            f"tunnel unless that is what you want",
            file=sys.stderr,
        )
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"ampdoctor dashboard on http://{shown}:{httpd.port}/  (Ctrl+C to stop)", file=sys.stderr)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per poll request
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
    return EXIT_OK
