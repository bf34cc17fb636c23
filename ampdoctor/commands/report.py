"""`ampdoctor report TRACE -o report.html [--reference TRACE]`: one self-contained HTML file (plotly loads inside
run())."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator

from ..trace import load
from ..trace.run import is_multi, load_run
from .common import EXIT_OK, UsageError
from .output import atomic_write, check_output


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace",
        metavar="TRACE",
        nargs="+",
        help="trace file (.db), or a directory, glob or files of one run's ranks (one report)",
    )
    parser.add_argument(
        "-o", "--output", metavar="HTML", default=None, help="HTML file to write (default: TRACE with .html)"
    )
    parser.add_argument(
        "--reference", metavar="TRACE", default=None, help="a healthy trace to compare with (e.g. the FP32 run)"
    )


def run(args: argparse.Namespace) -> int:
    from ..dashboards.report import STAGES, write_report

    if is_multi(args.trace):
        return _run_ranks(args)
    if not os.path.exists(args.trace):
        raise UsageError(f"ampdoctor report: {args.trace}: no such file")
    out = os.path.splitext(args.trace)[0] + ".html" if args.output is None else args.output
    real = check_output(out, _inputs([args.trace], args.reference), "report", default=args.output is None)
    tr = load(args.trace)
    ref = load(args.reference) if args.reference else None
    with _progress(len(STAGES)) as stage, atomic_write(real, out, "report") as tmp:
        write_report(tr, tmp, ref, progress=stage)
    print(f"wrote {out}")
    return EXIT_OK


@contextlib.contextmanager
def _progress(total: int) -> Iterator[Callable[[str], None] | None]:
    """The report's progress, called as each stage starts: a bar on stderr when it is a terminal, else None (tqdm is
    only imported where it shows: ~0.1 s, its version read from the package metadata)."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, desc="report", unit="stage", leave=False) as bar:

        def stage(name: str) -> None:
            bar.set_postfix_str(name)
            bar.update()

        yield stage


def _inputs(traces: list[str], reference: str | None) -> list[str]:
    """The files a report reads (it must not write over any of them)."""
    return [*traces, *([reference] if reference else [])]


def _run_ranks(args: argparse.Namespace) -> int:
    """The report of a multi-rank run: its ranks side by side and the findings naming them."""
    from ..dashboards.rank_views import default_output, write_rank_report

    with load_run(args.trace) as rr:
        out = default_output(rr) if args.output is None else args.output
        real = check_output(
            out, _inputs(list(rr.paths.values()), args.reference), "report", default=args.output is None
        )
        ref = load(args.reference) if args.reference else None
        with atomic_write(real, out, "report") as tmp:
            write_rank_report(rr, tmp, ref)
    print(f"wrote {out}")
    return EXIT_OK
