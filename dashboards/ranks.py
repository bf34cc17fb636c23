"""The dashboard's view of distributed runs: per-rank traces grouped by the rank in their metadata (also when the
file name carries only a number, as ``{rank}`` makes it); the rank rules run with the diagnosis (diagjob)."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from typing import TYPE_CHECKING

from ampdoctor.trace import TraceError

from . import server

if TYPE_CHECKING:
    from .catalog import Run

_TRAILING_NUMBER = re.compile(r"[._-]?\d+$")


def _rank_meta(path: str, cache: dict[str, tuple[int, int] | None]) -> tuple[int, int] | None:
    """(rank, world size) from a trace's metadata, read once per file; None when unreadable or not distributed."""
    if path not in cache:
        try:
            run = server.checked_meta(path).get("run") or {}  # checked once; the first request reuses it
            if not isinstance(run, dict) or not run:
                return None  # a trace just created: its run entry is not written yet; asked again at the next scan
            rank, world = run.get("rank"), run.get("world_size")
            cache[path] = (rank, world) if isinstance(rank, int) and isinstance(world, int) and world > 1 else None
        except TraceError:
            return None  # maybe still being created: asked again at the next scan
    return cache[path]


def with_ranks(
    runs: dict[str, Run], cache: dict[str, tuple[int, int] | None], files: set[str] | None = None
) -> dict[str, Run]:
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
            if m is not None and meta is not None and int(m.group(0).lstrip("._-")) == meta[0]:
                run = replace(run, group=stem[: m.start()] or stem, rank=meta[0])
        out[key] = run
    return out
