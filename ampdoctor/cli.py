"""The ampdoctor command line: thin subcommands over the library.

Each command opens the trace, calls the library and formats the result. Bad input (a missing or corrupt trace,
a wrong argument) is one line on stderr and exit code 2, never a traceback. Commands that live with their
library part (diagnose, replay, serve, report) are modules exposing ``add_arguments(parser)`` and ``run(args)``.
"""
from __future__ import annotations

import argparse
import importlib
import math
import re
import sys

import numpy as np

from . import __version__
from .trace import TraceError, load
from .trace.observation import cost_line, observation_line
from .trace.run import is_multi

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2

# name -> (module, help); a module that is not there (an optional part) leaves its command out
PLUGIN_COMMANDS = {
    "diagnose": ("ampdoctor.diagnose.command", "rules over a trace: what is wrong, where, and the fix"),
    "replay": ("ampdoctor.replay_command", "simulate the dynamic loss scaler over a recorded trace"),
    "serve": ("ampdoctor.dashboards.command", "the dashboard (Dash), live while training or offline"),
    "report": ("ampdoctor.dashboards.report_command", "one self-contained HTML report"),
}


# C0 and C1 controls but tab and newline, DEL, and the bidirectional overrides that reorder what a line shows
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with control characters written as escapes (``\\x1b``): names in a trace are user data, and an
    ESC sequence printed raw drives the terminal (clears it, sets its title)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class _Printable:
    """The command's standard output, written through printable()."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(printable(text))

    def __getattr__(self, name):
        return getattr(self._stream, name)


class UsageError(Exception):
    """Bad arguments: printed as one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def _fmt(v, width=10) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-".rjust(width)
    if isinstance(v, float):
        if v == 0:
            return "0".rjust(width)
        if math.isinf(v):
            return ("inf" if v > 0 else "-inf").rjust(width)
        return (f"{v:.3g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.2e}").rjust(width)
    return str(v).rjust(width)


def _share(count, numel) -> str:
    if count is None or numel is None or numel == 0 or (isinstance(count, float) and math.isnan(count)):
        return "-"
    return f"{100.0 * count / numel:.2f}%"


# -- info ------------------------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    if is_multi(args.trace):                     # a directory or glob of one run's ranks
        from .ranks_command import info_ranks
        return info_ranks(args.trace)
    tr = load(args.trace)
    meta, cfg = tr.meta, tr.config
    steps = tr.steps()
    sites = tr.sites()
    run = meta.get("run", {})
    print(f"trace      {args.trace}")
    print(f"run        {run.get('model', '?')} ({run.get('params', 0):,} parameters) on {run.get('device', '?')} "
          f"({run.get('device_name', '')}); torch {run.get('torch', '?')}, ampdoctor {run.get('ampdoctor', '?')}")
    print(f"steps      {len(steps)} recorded"
          + (f", full statistics at {len(tr.full_steps())}" if len(steps) else "")
          + ("" if "closed" in meta else " (run still open or ended without close())"))
    print("observed   " + observation_line(meta, steps))
    cost = cost_line(steps)
    if cost:
        print(f"overhead   {cost}")
    kinds = sites.groupby("kind").size().to_dict() if len(sites) else {}
    print("sites      " + (", ".join(f"{k} {v}" for k, v in kinds.items()) or "none"))
    dtypes = sites.groupby("dtype").size().to_dict() if len(sites) else {}
    print("dtypes     " + (", ".join(f"{k} ({v} sites)" for k, v in dtypes.items()) or "-"))
    ac = cfg.get("autocast", {})
    print("precision  " + describe_precision(cfg))
    if ac.get("enabled"):
        print(f"autocast   {ac.get('dtype')} on {ac.get('device_type')}")
    if cfg.get("optimizer"):
        print(f"optimizer  {cfg['optimizer']['class']}, lr {_fmt(steps['lr'].iloc[-1] if len(steps) else None, 0)}")
    sc = cfg.get("scaler")
    if sc:
        settings = ", ".join(f"{k} {sc[k]}" for k in ("growth_factor", "backoff_factor", "growth_interval") if k in sc)
        print(f"scaler     {sc.get('class')} ({'enabled' if sc.get('enabled') else 'disabled'}; {settings})")
        scales = steps["loss_scale"].dropna()
        if len(scales):
            print(f"loss scale {scales.iloc[0]:g} at step 0, range {scales.min():g} .. {scales.max():g}, "
                  f"last {steps['loss_scale_next'].dropna().iloc[-1]:g}")
    skipped = steps.index[steps["skipped"]].tolist() if len(steps) else []
    print(f"skipped    {len(skipped)} step(s)" + (f": {_ranges(steps['step'][steps['skipped']].tolist())}"
                                                  if skipped else ""))
    if len(steps):
        loss = steps["loss"].dropna()
        if len(loss):
            print(f"loss       {loss.iloc[0]:.4g} at step {int(steps['step'][loss.index[0]])} -> {loss.iloc[-1]:.4g} "
                  f"at step {int(steps['step'][loss.index[-1]])}")
    ev = tr.events("nonfinite")
    if len(ev):
        first = ev.iloc[0]
        where = f"{first['path']} ({first['site_kind']})" if first["path"] else "the loss"
        print(f"non-finite {len(ev)} step(s); first at step {int(first['step'])}: {where}, {first['phase']} "
              f"phase, {first['data'].get('value', '?')} — {first['message']}")
    unknown = tr.events("nonfinite_unknown")
    if len(unknown):
        print(f"non-finite {len(unknown)} step(s) of unknown origin (observed by the sentinel only): "
              f"{_ranges(unknown['step'].astype(int).tolist())}")
    elif not len(ev):
        print("non-finite none")
    wev = tr.events("nonfinite_weights")
    if len(wev):
        first = wev.iloc[0]
        names = ", ".join(first["data"].get("params", [])[:3])
        print(f"weights    NaN/Inf after the optimizer step of step {int(first['step'])}: "
              f"{first['data'].get('count', '?')} tensor(s) ({names}{', ...' if first['data'].get('count', 0) > 3 else ''})")
    return EXIT_OK


def describe_precision(cfg: dict) -> str:
    """O0/O1/O2/O3-style label of a run from its observed configuration."""
    if not cfg:
        return "unknown: no step recorded yet"
    ac = cfg.get("autocast", {}) or {}
    params = cfg.get("param_dtypes", {}) or {}
    total = sum(params.values()) or 1
    half = sum(v for k, v in params.items() if k in ("float16", "bfloat16")) / total
    master = "FP32 master weights" if half < 0.5 else "half-precision weights"
    if ac.get("enabled"):
        return f"O1-style: autocast {ac.get('dtype')}, {master}"
    if half >= 0.99:
        return "O3-style: model in half precision, no autocast"
    if half > 0:
        return "O2-style: mostly half-precision weights (some FP32), no autocast"
    return "O0: FP32 throughout (no autocast, FP32 weights)"


def _ranges(steps: list[int]) -> str:
    out, start, prev = [], None, None
    for s in steps:
        if start is None:
            start = prev = s
        elif s == prev + 1:
            prev = s
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = s
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out[:12]) + (" ..." if len(out) > 12 else "")


# -- layers ----------------------------------------------------------------------------------------------------
SORT_KEYS = ("order", "absmax", "minabs", "mean", "rms", "fp16_under", "fp16_over", "zeros", "nonfinite")


def cmd_layers(args) -> int:
    tr = load(args.trace)
    sites = tr.sites(args.kind)
    full = tr.full_steps()
    if not len(full):
        raise UsageError(f"{args.trace}: no step with full statistics yet")
    step = int(full[-1]) if args.step is None else args.step
    if step not in set(full.tolist()):
        near = full[np.argmin(np.abs(full - step))]
        raise UsageError(f"step {step} has no full statistics; nearest full step: {near} "
                         f"(full statistics every {tr.meta.get('run', {}).get('every', '?')} steps and at anomalies)")
    fields = ("numel", "absmax", "minabs", "mean", "rms", "fp16_sub", "fp16_flush", "fp16_over", "zeros", "nan",
              "inf", "scale")
    cols = {f: tr.records(f, args.kind)[step] for f in fields}
    rows = []
    for j, site in enumerate(sites.itertuples()):
        if math.isnan(cols["numel"][j]):
            continue
        n = cols["numel"][j]
        rows.append({"order": j, "path": site.path, "type": site.module_type or "", "dtype": site.dtype,
                     **{f: cols[f][j] for f in fields},
                     "fp16_under": (cols["fp16_sub"][j] + cols["fp16_flush"][j]) / n if n else 0.0,
                     "nonfinite": cols["nan"][j] + cols["inf"][j]})
    if not rows:
        print(f"no {args.kind} sites at step {step}")
        return EXIT_OK
    reverse = args.sort not in ("order", "minabs")
    rows.sort(key=lambda r: (-np.inf if math.isnan(r[args.sort]) else r[args.sort]) if reverse
              else (np.inf if math.isnan(r[args.sort]) else r[args.sort]), reverse=reverse)
    scale = rows[0]["scale"]
    note = f" (values scaled by the loss scale {scale:g})" if args.kind == "grad_out" and scale and scale != 1 else ""
    print(f"{args.kind} at step {step}{note}, sorted by {args.sort}")
    width = max(len(r["path"]) for r in rows)
    print(f"{'layer':{width}s} {'type':14s} {'dtype':9s} {'abs max':>10s} {'min |x|>0':>10s} {'mean':>10s} "
          f"{'rms':>10s} {'fp16 sub':>9s} {'fp16 ->0':>9s} {'fp16 ovf':>9s} {'zeros':>8s} {'nan/inf':>8s}")
    for r in rows:
        print(f"{r['path']:{width}s} {r['type'][:14]:14s} {str(r['dtype'])[:9]:9s} {_fmt(r['absmax'])} "
              f"{_fmt(r['minabs'])} {_fmt(r['mean'])} {_fmt(r['rms'])} {_share(r['fp16_sub'], r['numel']):>9s} "
              f"{_share(r['fp16_flush'], r['numel']):>9s} {_share(r['fp16_over'], r['numel']):>9s} "
              f"{_share(r['zeros'], r['numel']):>8s} {int(r['nonfinite']):>8d}")
    return EXIT_OK


# -- entry point -------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ampdoctor", description="Diagnose mixed-precision (FP16/BF16) training from a trace file.")
    p.add_argument("--version", action="version", version=f"ampdoctor {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sp = sub.add_parser("info", help="summary of a trace: steps, sites, precision, loss scale, first non-finite")
    sp.add_argument("trace", nargs="+", help="trace file (.db), or a directory, glob or files of one run's ranks")
    sp.set_defaults(func=cmd_info)
    sp = sub.add_parser("layers", help="per-layer statistics of one step, the way one prints gradients layer by layer")
    sp.add_argument("trace", help="trace file (.db)")
    sp.add_argument("--step", type=int, default=None, help="step (default: the last with full statistics)")
    sp.add_argument("--kind", default="grad_out", choices=["act", "grad_out", "param_grad", "weight", "update"])
    sp.add_argument("--sort", default="order", choices=SORT_KEYS, help="column to sort by (worst first)")
    sp.set_defaults(func=cmd_layers)
    for name, (module, help_) in PLUGIN_COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        sp = sub.add_parser(name, help=help_, description=help_)
        mod.add_arguments(sp)
        sp.set_defaults(func=mod.run)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    stdout, sys.stdout = sys.stdout, _Printable(sys.stdout)
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return EXIT_OK
        if isinstance(getattr(args, "trace", None), list) and len(args.trace) == 1:
            args.trace = args.trace[0]           # one file, directory or quoted glob; several: one run's ranks
        return int(args.func(args) or EXIT_OK)
    except (TraceError, UsageError) as exc:
        print(printable(f"ampdoctor: {exc}" if isinstance(exc, TraceError) else str(exc)), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK
    finally:
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
