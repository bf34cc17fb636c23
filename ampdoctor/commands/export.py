"""``ampdoctor export TRACE --to tensorboard|parquet|csv [--out DIR]``: a finished (or growing) trace's health
figures and findings, as the live exporters write them, after the fact. For one run's ranks, TensorBoard gets a
folder per rank (``rank0/``, ...) and the tables a ``rank`` column."""

from __future__ import annotations

import argparse
import os

from ..export import Exporter, ExportError, make_sinks
from ..export.rows import Point
from ..export.sinks import CSV, Parquet, Sink, TensorBoard
from ..export.spec import default_folder
from ..rules import diagnose
from ..rules.result import Diagnosis
from ..trace import load
from ..trace.run import is_multi, load_run
from .common import EXIT_OK, UsageError

TARGETS = ("tensorboard", "parquet", "csv")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="+", help="trace file (.db), or a directory, glob or files of one run's ranks")
    parser.add_argument("--to", required=True, choices=TARGETS, help="what to write")
    parser.add_argument("--out", default=None, metavar="DIR", help="folder to write into (default: next to the trace)")
    parser.add_argument(
        "--every",
        type=int,
        default=None,
        metavar="N",
        help="every N-th step, and every skipped or non-finite one (default: 10 for tensorboard, 1 for tables)",
    )


def run(args: argparse.Namespace) -> int:
    if args.every is not None and args.every < 1:
        raise UsageError(f"ampdoctor export: --every should be a positive integer, but given {args.every}")
    multi = is_multi(args.trace)
    label = args.trace if isinstance(args.trace, str) else args.trace[0]
    out = args.out or default_folder(label.rstrip("/*") if multi else label, args.to)
    try:
        if multi:
            written = _export_ranks(args.trace, args.to, out, args.every)
        else:
            load(args.trace).close()  # a bad file is one line before anything is made
            exporter = Exporter(args.trace, make_sinks([_spec(args.to, out)], args.trace, args.every))
            exporter.close()
            written = exporter.steps
    except ExportError as exc:
        raise UsageError(f"ampdoctor export: {exc}") from None
    print(f"{label}: {written} step(s) and their findings written to {out} ({args.to})")
    return EXIT_OK


def _spec(to: str, out: str) -> str:
    return f"{to}:{out}"


def _export_ranks(spec: list[str], to: str, out: str, every: int | None) -> int:
    """Each rank's steps, one after the other; the findings of the run (the rank rules included) once."""
    with load_run(spec) as rr:
        paths = rr.paths
        findings = diagnose(rr)
    kw = {} if every is None else {"every": every}
    written = 0
    table: CSV | Parquet | None = None
    if to != "tensorboard":
        table = (CSV if to == "csv" else Parquet)(out, rank=min(paths), **kw)
    try:
        for rank, path in paths.items():
            sink: Sink
            if table is not None:
                table.rank = rank
                sink = _Borrowed(table)
            else:
                sink = TensorBoard(os.path.join(out, f"rank{rank}"), **kw)
            exporter = Exporter(path, [sink], diagnose_at_close=False)
            exporter.close()
            written += exporter.steps
    finally:
        if table is not None:
            table.findings(findings, findings, 0)
            table.close()
    if table is None:
        tb = TensorBoard(out, **kw)  # the run's findings, once, at the top of the folder
        tb.findings(findings, findings, 0)
        tb.close()
    return written


class _Borrowed(Sink):
    """One table shared by the ranks' exporters: each writes its rows, none closes it."""

    def __init__(self, sink: Sink) -> None:
        super().__init__(sink.every, sink.prefix, sink.step_offset)
        self._sink = sink

    def wants(self, p: Point) -> bool:
        return self._sink.wants(p)

    def write(self, points: list[Point]) -> None:
        self._sink.write(points)

    def findings(self, new: list[Diagnosis], everything: list[Diagnosis], step: int) -> None:
        pass

    def flush(self) -> None:
        self._sink.flush()

    def close(self) -> None:
        self._sink.flush()
