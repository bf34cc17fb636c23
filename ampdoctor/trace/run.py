"""The per-rank traces of one distributed run, read together. Offline side: no torch import.

Under torch.distributed every rank writes its own trace (its rank and the world size in the ``run`` metadata).
``load_run`` takes a directory or a glob of such files and checks that they are the ranks of one run.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import ItemsView, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .files import SIDE_FILES
from .reader import Trace
from .reader import load as load_trace
from .schema import TraceError
from .shards import Combined

TRACE_EXT = (".db", ".sqlite", ".sqlite3", ".trace")
_GLOB = re.compile(r"[*?\[]")
_RANK_DIGITS = re.compile(r"(rank)?\d+$", re.IGNORECASE)
if TYPE_CHECKING:  # (typing names past Python 3.9: for the type checker only)
    from typing import Self, TypeAlias

    PathArg: TypeAlias = str | os.PathLike[str]
    # What load_run takes: a directory, a glob, or a list (tuple) of trace files.
    RunSpec: TypeAlias = PathArg | list[str] | list[os.PathLike[str]] | list[PathArg] | tuple[PathArg, ...]


@dataclass(frozen=True)
class Span:
    """Ranks ``first`` to ``last``, both included."""

    first: int
    last: int

    def __len__(self) -> int:
        return self.last - self.first + 1

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and self.first <= rank <= self.last

    def __str__(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


class RankRun:
    """The traces of one run's ranks, by rank: ``run[1]`` is rank 1's Trace; iterating yields them in rank order."""

    def __init__(self, source: str, traces: dict[int, Trace], world_size: int):
        self.source = source
        self.traces = dict(sorted(traces.items()))
        self.world_size = world_size
        self._combined: Combined | None = None

    @property
    def ranks(self) -> list[int]:
        return list(self.traces)

    @property
    def missing(self) -> list[Span]:
        """Ranks of the world that have no trace here (a rank that never attached, or a file left out), as runs of
        consecutive ranks: ``str`` of each is ``5`` or ``2-9``. One run more than there are traces at most: a world
        size of 10^15 in a crafted file costs what a world of 2 does."""
        out, start = [], 0
        for r in [*self.traces, self.world_size]:  # ranks in order (the dict is sorted), then the world's end
            if r > start:
                out.append(Span(start, r - 1))
            start = r + 1
        return out

    @property
    def n_missing(self) -> int:
        return sum(len(s) for s in self.missing)

    @property
    def paths(self) -> dict[int, str]:
        return {r: tr.path for r, tr in self.traces.items()}

    def __getitem__(self, rank: int) -> Trace:
        return self.traces[rank]

    def __iter__(self) -> Iterator[Trace]:
        return iter(self.traces.values())

    def __len__(self) -> int:
        return len(self.traces)

    def items(self) -> ItemsView[int, Trace]:
        return self.traces.items()

    def close(self) -> None:
        for tr in self.traces.values():
            tr.close()

    # -- a sharded run (FSDP): the whole tensors from the ranks' shards (shards.py) ---------------------------------
    @property
    def combined(self) -> Combined:
        """The ranks' shards combined (FSDP): whole-tensor statistics of the parameters, their gradients and
        updates, and the whole model's gradient norm; ``combined.sharded`` is False for an unsharded run."""
        if self._combined is None:
            self._combined = Combined(self)
        return self._combined

    @property
    def sharded(self) -> bool:
        """Whether the ranks hold shards of the parameters (FSDP): then a rank's own trace shows its shard."""
        return self.combined.sharded

    def views(self) -> dict[int, Trace]:
        """Each rank's trace as the rules read it: under FSDP with the whole tensors in place of its shards
        (shards.ShardView), else the trace itself."""
        return {rank: self.combined.view(rank) for rank in self.traces}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RankRun({self.source!r}, ranks={self.ranks}, world_size={self.world_size})"

    def _repr_html_(self) -> str:  # notebooks: the ranks side by side (ampdoctor/notebook.py)
        from ..notebook import rankrun_html

        return rankrun_html(self)


def is_multi(spec: RunSpec) -> bool:
    """A directory, a glob pattern or a list of files (what ``load_run`` takes), as opposed to one trace file."""
    if isinstance(spec, (list, tuple)):
        return True
    spec = os.fspath(spec)
    return os.path.isdir(spec) or (not os.path.exists(spec) and bool(_GLOB.search(spec)))


def _files(spec: RunSpec) -> list[str]:
    if isinstance(spec, (list, tuple)):
        names = [os.fspath(p) for p in spec]
        for n in names:
            if not os.path.isfile(n):
                raise TraceError(f"{n}: no such file" if not os.path.exists(n) else f"{n}: not a trace file")
        if len(set(names)) < len(names):
            raise TraceError("the same trace is given twice")
        where = "no trace file given"
    elif os.path.isdir(spec):
        names = sorted(os.path.join(spec, n) for n in os.listdir(spec) if n.lower().endswith(TRACE_EXT))
        where = f"{spec}: no trace files ({', '.join('*' + e for e in TRACE_EXT)}) in this directory"
    else:
        names = sorted(n for n in glob.glob(os.fspath(spec)) if not n.endswith(SIDE_FILES))  # SQLite's, not traces
        where = f"{spec}: no file matches this pattern"
    names = [n for n in names if os.path.isfile(n)]  # regular files only: a FIFO would block the open
    if not names:
        raise TraceError(where)
    return names


def run_pattern(path: str) -> str:
    """``runs/exp-1.db`` -> ``runs/exp-*.db``: the glob of the run a file belongs to, for error messages."""
    stem, ext = os.path.splitext(path)
    return _RANK_DIGITS.sub(lambda m: (m.group(1) or "") + "*", stem) + ext


def _label(spec: RunSpec) -> str:
    if not isinstance(spec, (list, tuple)):
        return os.fspath(spec)
    names = [os.fspath(p) for p in spec]
    return " ".join(names) if len(names) <= 3 else f"{names[0]} ... ({len(names)} files)"


def load_run(spec: RunSpec) -> RankRun:
    """Open the per-rank traces of one run: a directory (its trace files), a glob (``runs/exp-*.db``) or a list
    of trace files (what a shell makes of an unquoted glob).

    Raises TraceError with one line on a bad file, on no file at all, and when the files are not the ranks of one
    run (two traces of one rank, different world sizes or torchrun run ids)."""
    files = _files(spec)
    spec = _label(spec)
    traces: dict[int, Trace] = {}
    worlds, ids = set(), set()
    opened: list[Trace] = []
    try:
        for path in files:
            tr = load_trace(path)
            opened.append(tr)
            run = tr.meta.get("run", {}) or {}
            rank, world = run.get("rank", 0), run.get("world_size", 1)
            if not isinstance(rank, int) or not isinstance(world, int) or rank < 0 or world < 1:
                raise TraceError(f"{path}: rank {rank!r} / world size {world!r} in its metadata are not valid")
            if rank in traces:
                groups = sorted({run_pattern(t.path) for t in opened})
                hint = (
                    f"it holds several runs ({', '.join(groups[:4])}); pass one run's files as a glob"
                    if len(groups) > 1
                    else "pass a glob that matches one run's files"
                )
                raise TraceError(
                    f"{spec}: two traces of rank {rank} ({traces[rank].path}, {path}): not the ranks of one run; {hint}"
                )
            traces[rank] = tr
            worlds.add(max(world, rank + 1))
            ids.add(run.get("run_id"))
        if len(worlds) > 1 or len(ids - {None}) > 1:
            raise TraceError(
                f"{spec}: these traces come from different runs (world sizes {sorted(worlds)}, "
                f"run ids {len(ids - {None})}); pass one run's files"
            )
    except BaseException:
        for tr in opened:
            tr.close()
        raise
    return RankRun(spec, traces, max(worlds))


def load(spec: RunSpec) -> Trace | RankRun:
    """A trace file gives its Trace (exactly ``ampdoctor.trace.load``); a directory, glob or list of files gives
    the RankRun of its per-rank traces. Raises TraceError with one line on bad input."""
    if is_multi(spec):
        return load_run(spec)
    assert not isinstance(spec, (list, tuple))  # (is_multi: a list or tuple is a run)
    return load_trace(spec)
