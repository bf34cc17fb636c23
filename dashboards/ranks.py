"""The dashboard's view of distributed runs: per-rank traces grouped by the rank in their metadata (also when the
file name carries only a number, as ``{rank}`` makes it), and the rank rules' findings of a run's group."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from typing import TYPE_CHECKING

from ampdoctor.rules.multirank import rank_findings
from ampdoctor.trace import TraceError, load
from ampdoctor.trace.run import RankRun

if TYPE_CHECKING:
    from .app import Context

_TRAILING_NUMBER = re.compile(r"[._-]?\d+$")


def _rank_meta(path: str, cache: dict) -> tuple[int, int] | None:
    """(rank, world size) from a trace's metadata, read once per file; None when unreadable or not distributed."""
    if path not in cache:
        try:
            tr = load(path)
            try:
                run = tr.meta.get("run", {}) or {}
            finally:
                tr.close()
            rank, world = run.get("rank"), run.get("world_size")
            ok = isinstance(rank, int) and isinstance(world, int) and world > 1
            cache[path] = (rank, world) if ok else None
        except TraceError:
            return None  # maybe still being created: asked again at the next scan
    return cache[path]


def with_ranks(runs: dict, cache: dict, files: set | None = None) -> dict:
    """``runs`` (catalog.discover_runs), restricted to ``files`` when given, with the rank and group of every
    per-rank trace whose name has a trailing number that its metadata confirms as its rank."""
    out = {}
    for key, run in runs.items():
        if files is not None and run.path not in files:
            continue
        if run.rank is None:
            stem = os.path.splitext(key)[0]
            m = _TRAILING_NUMBER.search(stem)
            meta = _rank_meta(run.path, cache) if m else None
            if meta is not None and int(m.group(0).lstrip("._-")) == meta[0]:
                run = replace(run, group=stem[: m.start()] or stem, rank=meta[0])
        out[key] = run
    return out


def group_findings(ctx: Context, key: str) -> list:
    """The rank rules over the ranks of the run ``key`` belongs to ([] for a run of one rank)."""
    me = ctx.resolve(key)
    if me is None or me.rank is None:
        return []
    peers = {r.rank: r for k, r in ctx.runs().items() if r.group == me.group and r.rank is not None}
    if len(peers) < 2:
        return []
    traces = {rank: ctx.trace(r.key) for rank, r in peers.items()}
    if any(t is None or not t.n_steps for t in traces.values()):
        return []
    return rank_findings(RankRun(me.group, traces, max(traces) + 1))
