"""``ampdoctor diagnose TRACE``: the rules over a trace as a readable report or JSON; exit 1 gates CI."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from ..rules import diagnose
from ..rules.registry import RULES
from ..rules.result import Diagnosis
from ..severity import SEVERITIES, at_least
from ..trace import load as load_trace
from ..trace.checks import invalid_settings_note
from ..trace.run import RankRun, is_multi, load, run_pattern
from .common import EXIT_FINDINGS, EXIT_OK, UsageError, evidence, printable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="+", help="trace file (.db), or a directory, glob or files of one run's ranks")
    parser.add_argument(
        "--reference",
        default=None,
        metavar="TRACE",
        help="a second trace to compare with (e.g. the same model in FP32)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list of findings")
    parser.add_argument(
        "--fail-on",
        default="warning",
        choices=SEVERITIES,
        help="exit 1 when a finding at or above this severity exists (default: warning)",
    )
    parser.add_argument("--disable", nargs="+", action="extend", default=[], metavar="ID", help="rule ids to leave out")


def run(args: argparse.Namespace) -> int:
    unknown = [r for r in args.disable if r not in RULES]
    if unknown:
        raise UsageError(f"ampdoctor diagnose: unknown rule id {unknown[0]!r}; known: {', '.join(RULES)}")
    tr = load(args.trace)  # a file's Trace, or a directory's or glob's RankRun
    for t in tr if isinstance(tr, RankRun) else [tr]:
        note = invalid_settings_note(t.config)
        if note:
            print(printable(f"ampdoctor diagnose: note: {t.path}: {note}"), file=sys.stderr)
    findings = diagnose(tr, reference=args.reference, rules={r: None for r in args.disable})
    if args.json:
        print(json.dumps([d.to_dict() for d in findings], indent=2))
    else:
        print(report(args.trace, findings))
        note = shard_note(args.trace)
        if note:
            print(note)
    return EXIT_FINDINGS if any(at_least(d.severity, args.fail_on) for d in findings) else EXIT_OK


def report(path: str, findings: list[Diagnosis]) -> str:
    """The human-readable report: one block per finding, worst first."""
    path = path if isinstance(path, str) else " ".join(path)
    if not findings:
        return f"{path}: no findings (rules run: {len(RULES)})"
    counts = {s: sum(d.severity == s for d in findings) for s in reversed(SEVERITIES)}
    lines = [f"{path}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
    for d in findings:
        ranks = f" (rank{'s' if len(d.ranks) > 1 else ''} {', '.join(map(str, d.ranks))})" if d.ranks else ""
        lines += ["", f"[{d.severity.upper()}] {d.rule}{ranks}: {d.title}"]
        lines += textwrap.wrap(d.summary, 110, initial_indent="  ", subsequent_indent="  ")
        if d.layers:
            lines.append("  layers:   " + ", ".join(d.layers[:8]) + (" ..." if len(d.layers) > 8 else ""))
        if d.steps:
            lines.append(f"  steps:    {d.steps[0]}" + (f"-{d.steps[-1]}" if d.steps[-1] != d.steps[0] else ""))
        ev = d.to_dict()["evidence"]
        lines.append("  evidence: " + ", ".join(f"{k}={evidence(v)}" for k, v in ev.items()))
        lines.append("  fix:")
        lines += ["    " + ln for part in d.fix for ln in part.text.splitlines()]  # code as printed, 4 in
    return "\n".join(lines)


def shard_note(spec: str | list[str]) -> str | None:
    """For one rank's trace of an FSDP run: the rules judged that rank's shards, and how to judge the whole tensors."""
    if is_multi(spec):
        return None
    path = spec[0] if isinstance(spec, list) else spec
    with load_trace(path) as tr:  # (one trace: is_multi said so)
        if "sharding" not in tr.meta:
            return None
    return (
        f"\nnote: {path} is one rank of an FSDP run: its gradient norm and parameter-gradient, weight and update "
        f"statistics are this rank's shard's, and the rules above judged those; the whole tensors: "
        f"ampdoctor diagnose '{run_pattern(path)}'"
    )
