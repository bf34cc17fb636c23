"""The ranks of a sharded run (FSDP) read together: the statistics of a whole tensor from its shards' statistics in
the ranks' traces. Offline side: no torch import.

Under FSDP each rank records its own shard of every parameter, of its gradient and of its update (collect/sharded.py;
meta ``sharding``). What needs the whole tensor combines exactly across the shards: counts (numel, NaN, Inf, zeros,
the FP16/BF16 overflow, subnormal and flush counts) and histograms add; peaks and abs maxima take the max (a NaN
wins); the smallest magnitude takes the min; norms are the root of the summed squares (rms and mean through numel).
The sentinel's gradient norm is each rank's shards' norm, combined the same way; its largest gradient the max (a
parameter no FSDP unit manages is each rank's own, unreduced: each rank's copy counts once there). One
copy of each shard counts (``replica`` 0: HSDP replicates the shards). A statistic that a shard's trace lacks (a
rank without a trace, a step one rank did not observe) is missing, never a partial figure. Activations and output
gradients are not shards (each rank computed them on its own batch): they stay per rank.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import ItemsView, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from . import bulk, checks
from .reader import Trace
from .schema import HIST_HI, HIST_LO, TraceError

if TYPE_CHECKING:
    import pandas as pd  # (the frames come from the rank's Trace: `ampdoctor info` starts without pandas)


class Ranks(Protocol):
    """What Combined reads of a run (run.RankRun, which imports this module)."""

    def items(self) -> ItemsView[int, Trace]: ...
    def __getitem__(self, rank: int) -> Trace: ...
    def __iter__(self) -> Iterator[Trace]: ...
    def __len__(self) -> int: ...


SHARDED_KINDS = ("param_grad", "weight", "update")
# statistics that add across shards; the others: absmax (max), minabs (min), mean and rms (through numel)
SUMS = ("numel", "nan", "inf", "zeros", "fp16_over", "fp16_sub", "fp16_flush", "bf16_over", "bf16_sub", "bf16_flush")
COMBINED = (*SUMS, "absmax", "minabs", "mean", "rms", "peak")
HIST_BINS = HIST_HI - HIST_LO + 1

_SPEC: checks.Spec = {"placements": [checks.STR], "shards": checks.INT, "replica": checks.INT}
_SHARDING: checks.Spec = {
    "engine": checks.STR,
    "specs": [_SPEC],
    "params": ({checks.STR: [(checks.INT, [checks.INT])]},),
}


@dataclass(frozen=True)
class Sharding:
    """What a rank's trace says about its shards: the engine ("fsdp2", "fsdp1"), the shard specs, and per
    parameter name (spec index, numel of this rank's shard, the whole tensor's shape)."""

    engine: str
    specs: list[dict[str, Any]]
    params: dict[str, list[Any]]

    def replica(self, name: str) -> int:
        return int(self.specs[self.params[name][0]]["replica"])

    def local_numel(self, name: str) -> int:
        return int(self.params[name][1])

    def whole_numel(self, name: str) -> int:
        return int(math.prod(self.params[name][2]))

    def whole_shape(self, name: str) -> str:
        return "x".join(str(v) for v in self.params[name][2])

    @property
    def rank_replica(self) -> int | None:
        """The copy of the shards this rank holds, when every spec agrees (the sentinel's norm spans them all)."""
        replicas = {int(s["replica"]) for s in self.specs}
        return replicas.pop() if len(replicas) == 1 else None


def sharding_of(tr: Trace) -> Sharding | None:
    """The ``sharding`` entry of a trace (None: nothing was sharded); TraceError on a malformed one."""
    raw = tr.meta.get("sharding")
    if raw is None:
        return None
    try:
        checks.check_value(raw, _SHARDING, "meta sharding")
        for name, row in raw.get("params", {}).items():
            if (
                len(row) != 3
                or not isinstance(row[0], int)
                or not 0 <= row[0] < len(raw["specs"])
                or not isinstance(row[1], int)
                or row[1] < 0
                or not isinstance(row[2], list)
                or any(not isinstance(v, int) or v < 0 for v in row[2])
            ):
                raise checks.Invalid(f"meta sharding.params[{name!r}] is not [spec, numel, shape]")
        for key in ("engine", "specs", "params"):
            if key not in raw:
                raise checks.Invalid(f"meta sharding has no {key!r}")
    except checks.Invalid as exc:
        raise TraceError(f"{tr.path}: corrupt trace ({exc})") from None
    return Sharding(raw["engine"], raw["specs"], raw["params"])


class Combined:
    """The shards of a RankRun's ranks combined (``RankRun.combined``). Arrays are indexed by step (row i is step i, up
    to the longest rank's last step); a cell a contributing shard lacks is missing (NaN; -1 for peaks)."""

    def __init__(self, rr: Ranks):
        self.rr = rr
        self.shardings = {rank: sharding_of(tr) for rank, tr in rr.items()}
        self.engine = next((s.engine for s in self.shardings.values() if s is not None), None)
        self.n_steps = max((tr.n_steps for tr in rr), default=0)
        self._cache: dict[object, Any] = {}
        names = sorted({n for s in self.shardings.values() if s is not None for n in s.params})
        # per parameter: the ranks whose shard counts (copy 0, not empty), and whether they make up the whole tensor
        self.contributors: dict[str, list[int]] = {}
        self.incomplete: list[str] = []
        for name in names:
            holders = [
                (r, s)
                for r, s in self.shardings.items()
                if s is not None and name in s.params and s.replica(name) == 0 and s.local_numel(name) > 0
            ]
            whole = next(s.whole_numel(name) for s in self.shardings.values() if s is not None and name in s.params)
            if sum(s.local_numel(name) for _, s in holders) != whole:
                self.incomplete.append(name)  # a shard's trace is missing: no whole-tensor figure
            else:
                self.contributors[name] = [r for r, _ in holders]
        # the sentinel: one copy of every shard (ranks whose copy is 0), every such rank present
        copies = [s.rank_replica for s in self.shardings.values() if s is not None]
        shards = {int(sp["shards"]) for s in self.shardings.values() if s is not None for sp in s.specs}
        self.sentinel_ranks = [r for r, s in self.shardings.items() if s is not None and s.rank_replica == 0]
        self.sentinel_complete = None not in copies and len(shards) == 1 and len(self.sentinel_ranks) == shards.pop()

    @property
    def sharded(self) -> bool:
        return self.engine is not None

    def is_sharded(self, path: str, kind: str) -> bool:
        return kind in SHARDED_KINDS and (path in self.contributors or path in self.incomplete)

    # -- the sentinel ------------------------------------------------------------------------------------------------
    def grad_figures(self) -> tuple[np.ndarray, np.ndarray]:
        """(gradient norm, largest |gradient|) of the whole model per step: the root of the ranks' summed squared
        shard norms, the max of their peaks. NaN where a rank's figure is NaN (its gradients held one) or missing,
        and everywhere when the ranks' traces do not hold one copy of every shard."""
        if "grad" not in self._cache:
            norm2 = np.zeros(self.n_steps)
            peak = np.zeros(self.n_steps)
            for r in self.sentinel_ranks:
                st = self.rr[r].step_columns()  # (arrays from the writer's step blocks: no frame, no lr JSON)
                n, m = _by_step(st, "grad_norm", self.n_steps), _by_step(st, "grad_max", self.n_steps)
                with np.errstate(invalid="ignore", over="ignore"):
                    norm2 = norm2 + n * n  # NaN propagates
                peak = np.where(np.isnan(m) | np.isnan(peak), np.nan, np.maximum(peak, m))
            norm = np.sqrt(norm2)
            if not self.sentinel_complete:
                norm[:], peak[:] = np.nan, np.nan
            self._cache["grad"] = (norm, peak)
        out: tuple[np.ndarray, np.ndarray] = self._cache["grad"]
        return out

    # -- per-site statistics -----------------------------------------------------------------------------------------
    def records(self, field: str, kind: str) -> tuple[dict[str, int], np.ndarray]:
        """(column of each sharded site path, [steps x sites] of ``field`` over the whole tensors). Missing cells: NaN
        (-1 for "peak": not observed; NaN there is a tensor that held a NaN, as in ``Trace.records``)."""
        key = (field, kind)
        if key not in self._cache:
            self._cache[key] = self._combine(field, kind)
        out: tuple[dict[str, int], np.ndarray] = self._cache[key]
        return out

    def _rank_columns(self, kind: str) -> dict[int, dict[str, int]]:
        """Per rank: the column of each contributing site in that rank's ``records(..., kind)``."""
        out = {}
        for r, tr in self.rr.items():
            sites = tr.sites(kind)
            out[r] = {p: j for j, p in enumerate(sites["path"]) if r in self.contributors.get(p, ())}
        return out

    def _combine(self, field: str, kind: str) -> tuple[dict[str, int], np.ndarray]:
        paths = sorted(self.contributors) if kind in SHARDED_KINDS else []
        col = {p: j for j, p in enumerate(paths)}
        n, k = self.n_steps, len(paths)
        need = np.array([len(self.contributors[p]) for p in paths], dtype=np.int32)
        seen = np.zeros((n, k), dtype=np.int32)
        peak = field == "peak"
        start = {"minabs": math.inf, "absmax": -math.inf}.get(field, 0.0)
        acc = np.full((n, k), start)
        weight = np.zeros((n, k)) if field in ("mean", "rms") else None  # numel, for mean and rms
        nan_seen = np.zeros((n, k), dtype=bool) if peak else None  # a peak that held a NaN
        for r, cols in self._rank_columns(kind).items():
            if not cols:
                continue
            tr = self.rr[r]
            src = np.fromiter(cols.values(), dtype=np.int64, count=len(cols))
            dst = np.fromiter((col[p] for p in cols), dtype=np.int64, count=len(cols))
            vals = _rows(tr.records(field, kind, fill=-1.0 if peak else np.nan)[:, src], n)
            present = (vals >= 0) | np.isnan(vals) if peak else ~np.isnan(vals)
            if field in ("mean", "rms"):
                num = _rows(tr.records("numel", kind)[:, src], n)
                present &= ~np.isnan(num)
                num = np.where(present, num, 0.0)
                v = np.where(present, vals, 0.0)
                acc[:, dst] += v * num if field == "mean" else v * v * num
                assert weight is not None
                weight[:, dst] += num
            elif peak:
                assert nan_seen is not None
                nan_seen[:, dst] |= present & np.isnan(vals)
                acc[:, dst] = np.maximum(acc[:, dst], np.where(present & ~np.isnan(vals), vals, 0.0))
            elif field == "absmax":
                acc[:, dst] = np.maximum(acc[:, dst], np.where(present, vals, -math.inf))
            elif field == "minabs":  # 0: the shard held no non-zero value
                acc[:, dst] = np.minimum(acc[:, dst], np.where(present & (vals > 0), vals, math.inf))
            else:
                acc[:, dst] += np.where(present, vals, 0.0)
            seen[:, dst] += present
        complete = seen == need[None, :]
        with np.errstate(invalid="ignore", divide="ignore"):
            if weight is not None:
                acc = np.where(weight > 0, acc / np.where(weight > 0, weight, 1.0), 0.0)
                if field == "rms":
                    acc = np.sqrt(acc)
        if field == "minabs":
            acc[np.isinf(acc)] = 0.0
        if nan_seen is not None:
            acc[nan_seen] = np.nan
            acc[~complete] = -1.0
        else:
            acc[~complete] = np.nan
        return col, acc

    def hist(self, path: str, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, summed binade counts) of a sharded site: the steps every contributing shard has a histogram."""
        ranks = self.contributors.get(path, [])
        parts = []
        for r in ranks:
            tr = self.rr[r]
            try:
                sid = tr.site_id(path, kind)
            except KeyError:
                return np.zeros(0, dtype=np.int64), np.zeros((0, HIST_BINS), dtype=np.int64)
            parts.append(tr.hist(sid))
        if not parts:
            return np.zeros(0, dtype=np.int64), np.zeros((0, HIST_BINS), dtype=np.int64)
        common = parts[0][0]
        for steps, _ in parts[1:]:
            common = np.intersect1d(common, steps)
        total = np.zeros((len(common), parts[0][1].shape[1]), dtype=np.int64)
        for steps, counts in parts:
            total += counts[np.searchsorted(steps, common)]
        return common, total

    def view(self, rank: int) -> Trace:
        """Rank ``rank``'s trace as the rules read it: the whole tensors in place of its shards (the rank's own
        trace when nothing is sharded)."""
        tr = self.rr[rank]
        return ShardView(tr, self, rank) if self.sharded and self.shardings.get(rank) is not None else tr


def _rows(arr: np.ndarray, n: int) -> np.ndarray:
    """An array of a rank's steps padded (NaN) or cut to n rows."""
    if len(arr) >= n:
        return arr[:n]
    return np.vstack([arr, np.full((n - len(arr), arr.shape[1]), np.nan)])


def _by_step(st: dict[str, np.ndarray], col: str, n: int) -> np.ndarray:
    """A column of a rank's steps (``Trace.step_columns``) padded (NaN) or cut to n steps."""
    out = np.full(n, np.nan)
    steps = np.asarray(st["step"], dtype=np.int64)
    keep = (steps >= 0) & (steps < n)
    out[steps[keep]] = np.asarray(st[col], dtype=np.float64)[keep]
    return out


class ShardView(Trace):
    """A rank's trace with the whole tensors in place of its shards: parameter-gradient, weight and update
    statistics, histograms and peaks combined over the ranks' shards, and the steps' ``grad_norm`` / ``grad_max``
    the whole model's (the rank's own shard figures kept as ``grad_norm_shard`` / ``grad_max_shard``). Everything
    else is the rank's own. Shares the rank's open file (``close()`` leaves it to the RankRun)."""

    def __init__(self, trace: Trace, combined: Combined, rank: int):  # (no Trace.__init__: the file is open)
        self.path = trace.path
        self._conn = trace._conn
        self._snapshot_depth, self._counted = 0, None  # (its own snapshot is the rank's: no count kept here)
        self._full_check = trace._full_check  # how the rank's file is checked (whole at open, or as read) ...
        self._checked_rows = trace._checked_rows  # ... and, as read, how far its small tables are (shared)
        self._own = trace
        self._combined = combined
        self.rank = rank

    def __repr__(self) -> str:
        return f"ShardView({self.path!r}, rank={self.rank}, shards combined over {len(self._combined.rr)} ranks)"

    def close(self) -> None:
        pass

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[ShardView]:
        with self._own.snapshot():
            yield self

    def steps(self, lr_groups: bool = True) -> pd.DataFrame:
        st = self._own.steps(lr_groups)
        norm, peak = self._combined.grad_figures()
        idx = st["step"].to_numpy(dtype=np.int64)
        st["grad_norm_shard"], st["grad_max_shard"] = st["grad_norm"], st["grad_max"]
        st["grad_norm"], st["grad_max"] = _at(norm, idx), _at(peak, idx)
        return st

    def sites(self, kind: str | None = None) -> pd.DataFrame:
        sites = self._own.sites(kind)
        sh = self._combined.shardings[self.rank]
        if sh is None:
            return sites
        whole = [
            sh.whole_shape(p) if k in SHARDED_KINDS and p in sh.params else s
            for p, k, s in zip(sites["path"], sites["kind"], sites["shape"])
        ]
        return sites.assign(shape=whole)

    def records(
        self, field: str, kind: str = "act", fill: float = np.nan, steps: npt.ArrayLike | None = None
    ) -> npt.NDArray[np.float64]:
        if steps is not None:  # the rows of these steps (the combined figures are kept for every step)
            steps = np.asarray(steps, dtype=np.int64)
            whole = self.records(field, kind, fill)
            out = np.full((len(steps), whole.shape[1]), fill)
            ok = (steps >= 0) & (steps < len(whole))
            out[ok] = whole[steps[ok]]
            return out
        out = self._own.records(field, kind, fill)
        if kind not in SHARDED_KINDS or field not in COMBINED or not out.shape[1]:
            return out
        col, comb = self._combined.records(field, kind)
        paths = self._own.sites(kind)["path"].tolist()
        n = len(out)
        for j, p in enumerate(paths):
            if p in col:
                v = _rows(comb[:, col[p] : col[p] + 1], n)[:, 0]
                missing = (v == -1.0) if field == "peak" else np.isnan(v)
                out[:, j] = np.where(missing, fill, v)
            elif self._combined.is_sharded(p, kind):  # a shard's trace is missing: no whole-tensor figure
                out[:, j] = fill
        return out

    # -- the bounded reads of trace.view.View, with the whole tensors in place of the shards ---------------------------
    def _whole_columns(self, field: str, kind: str | None) -> Iterator[tuple[int, np.ndarray | None]]:
        """(column in a [.. x sites(kind)] array, the whole tensor's values over every step, None where a shard's
        trace is missing) of each sharded site of ``kind`` (None: every kind)."""
        sites = self._own.sites(kind)
        for k in SHARDED_KINDS:
            if kind is not None and kind != k:
                continue
            col, comb = self._combined.records(field, k)
            for j in np.flatnonzero((sites["kind"] == k).to_numpy(bool)):
                p = str(sites["path"].iloc[j])
                if p in col:
                    yield int(j), comb[:, col[p]]
                elif self._combined.is_sharded(p, k):
                    yield int(j), None

    def stats_at(self, fields: Sequence[str], kind: str | None, steps: npt.ArrayLike) -> dict[str, np.ndarray]:
        out = self._own.stats_at(fields, kind, steps)
        steps = np.asarray(steps, dtype=np.int64)
        for f in fields:
            if f not in COMBINED or f == "peak":
                continue
            for j, v in self._whole_columns(f, kind):
                out[f][:, j] = np.nan if v is None else _at(v, steps)
        return out

    def peak_chunks(self, n_steps: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        whole = list(self._whole_columns("peak", None))  # column = site id (every site, in id order)
        for steps, block in self._own.peak_chunks(n_steps):
            for j, v in whole:
                if j < block.shape[1]:  # -1: not observed (no shard's trace, or a step beyond the combined)
                    block[:, j] = -1.0 if v is None else np.where(steps < len(v), _at(v, steps), -1.0)
            yield steps, block

    def hists_at(self, steps: npt.ArrayLike, sites: npt.ArrayLike | None = None) -> bulk.Hists:
        own = self._own.hists_at(steps, sites)
        table = self._own.sites()
        want = set(np.asarray(sites, dtype=np.int64).tolist()) if sites is not None else None
        steps = np.asarray(steps, dtype=np.int64)
        parts: list[tuple[int, int, np.ndarray]] = []  # (step, site, 255 counts) of the whole tensors
        replaced = []
        for sid, path, k in zip(table["id"], table["path"], table["kind"]):
            if (want is not None and int(sid) not in want) or not self._combined.is_sharded(path, k):
                continue
            replaced.append(int(sid))
            if path in self._combined.incomplete:
                continue
            hs, counts = self._combined.hist(path, k)
            for i in np.flatnonzero(np.isin(hs, steps)):
                parts.append((int(hs[i]), int(sid), counts[i]))
        if not replaced:
            return own
        keep = own.take(np.flatnonzero(~np.isin(own.site, replaced)))
        rows = [(int(keep.step[r]), int(keep.site[r]), r) for r in range(len(keep))]
        rows += [(st, sid, -1 - i) for i, (st, sid, _) in enumerate(parts)]
        rows.sort(key=lambda t: (t[0], t[1]))
        lo, chunks = [], []
        for _, _, r in rows:
            if r >= 0:
                lo.append(int(keep.lo[r]))
                chunks.append(keep.counts[keep.offsets[r] : keep.offsets[r + 1]])
            else:
                lo.append(HIST_LO)
                chunks.append(np.asarray(parts[-1 - r][2], dtype=np.int64))
        sizes = np.array([len(c) for c in chunks], dtype=np.int64)
        return bulk.Hists(
            np.array([t[0] for t in rows], dtype=np.int64),
            np.array([t[1] for t in rows], dtype=np.int64),
            np.array(lo, dtype=np.int64),
            np.concatenate(([0], np.cumsum(sizes))),
            np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64),
        )

    def hist(self, site: int | str, kind: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        sid = self._own.site_id(site, kind)
        sites = self._own.sites()
        row = sites[sites["id"] == sid]
        if not len(row) or not self._combined.is_sharded(row["path"].iloc[0], row["kind"].iloc[0]):
            return self._own.hist(sid)
        path, k = row["path"].iloc[0], row["kind"].iloc[0]
        if path in self._combined.incomplete:  # a shard's trace is missing: no whole-tensor histogram
            return np.zeros(0, dtype=np.int64), np.zeros((0, HIST_BINS), dtype=np.int64)
        return self._combined.hist(path, k)


def _at(values: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """values[step] for each step (NaN beyond the array)."""
    out = np.full(len(steps), np.nan)
    ok = (steps >= 0) & (steps < len(values))
    out[ok] = values[steps[ok]]
    return out
