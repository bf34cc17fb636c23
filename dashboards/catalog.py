"""The trace files under a root that the dashboard may open, and their names in the run picker: no plotly, no dash.

The browser names a run only by its key here (its path relative to the root); nothing it sends is joined to a path.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

from ampdoctor.trace import is_trace
from ampdoctor.trace.run import TRACE_EXT

RANK_SUFFIX = re.compile(r"[._-]?rank[._-]?(\d+)$", re.IGNORECASE)  # runs/exp-rank1.db: rank 1 of runs/exp


@dataclass(frozen=True)
class Run:
    """One trace file the dashboard may open: ``key`` is its path relative to the root (the only name the
    browser ever sends back), ``group`` the run it belongs to (per-rank traces share one) and ``rank``."""

    key: str
    path: str
    group: str
    rank: int | None


def discover_runs(root: str, max_files: int = 2000) -> dict[str, Run]:
    """Trace files at or under ``root`` (a file or a directory), keyed by their path relative to the root.

    Symbolic links that lead outside the root are skipped: the browser reaches nothing but what this returns.
    Only regular files are opened: opening a FIFO named ``x.db`` would wait for a writer forever.
    """
    root = os.path.realpath(root)
    if os.path.isfile(root):
        stem = os.path.splitext(os.path.basename(root))[0]
        return {os.path.basename(root): Run(os.path.basename(root), root, RANK_SUFFIX.sub("", stem), _rank(stem))}
    runs: dict[str, Run] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.lower().endswith(TRACE_EXT):
                continue
            path = os.path.realpath(os.path.join(dirpath, name))
            if os.path.commonpath([root, path]) != root or not _regular(path) or not is_trace(path):
                continue
            key = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            stem = os.path.splitext(key)[0]
            runs[key] = Run(key, path, RANK_SUFFIX.sub("", stem), _rank(stem))
            if len(runs) >= max_files:
                return runs
    return runs


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _rank(stem: str) -> int | None:
    m = RANK_SUFFIX.search(stem)
    return int(m.group(1)) if m else None


def run_label(run: Run) -> str:
    return run.group if run.rank is None else f"{run.group} (rank {run.rank})"
