"""What the offline side reads of one trace, read once and kept (View): the steps table, the sites, a bounded sample of
the full-statistics and histogram steps with their statistics and histograms (one query each, every site at once),
and the one pass over the peaks that the rules, the replay and the format what-if reduce them with (peaks.Scan).

Sub-linear in the steps where the question allows it: a median over steps (the share of a gradient in the subnormal
range, the what-if's lost share) rests on at most MAX_STEPS steps evenly spaced over the run, the first and the last
included; every step is read where a single step can decide (the largest peak, a non-finite value, the replay's
per-step gradient). A run of up to MAX_STEPS full-statistics steps is read whole. Offline side: numpy/pandas only.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pandas as pd

from . import peaks as P
from .bulk import Hists
from .reader import Trace
from .schema import ROOT

# Full-statistics or histogram steps a median over steps rests on at most (a 10^6-step run at the default tiers has
# ~12,500 and ~7,500): the median of 256 evenly spaced steps moves by a few percent of the spread at most.
MAX_STEPS = 256
# A file whose steps hold rows for few of its sites (at most 1 in 16: a crafted or very sparse trace) is read at fewer
# steps, so that no [steps x sites] array exceeds this many cells: memory follows what the file holds.
SPARSE_CELLS = 1 << 18
STAT_FIELDS = ("numel", "zeros", "absmax", "rms", "scale", "fp16_sub")  # read together (others: on demand)
# read together at other steps than stat_steps (the histogram steps: the format what-if's abs max, the loss scale the
# replay's histograms carry); nothing else is read there, and fewer columns decode faster (~0.3 s at 10^6 steps)
AT_FIELDS = ("absmax", "scale")


def sample(steps: np.ndarray, cap: int = MAX_STEPS) -> np.ndarray:
    """At most ``cap`` of ``steps`` (sorted), evenly spaced, the first and the last included."""
    if len(steps) <= cap:
        return steps
    return steps[np.unique(np.round(np.linspace(0, len(steps) - 1, cap)).astype(np.int64))]


class View:
    """Cached, bounded reads of one trace (read inside one Trace.snapshot for a consistent state)."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self._sites: dict[str | None, pd.DataFrame] = {}
        self._stats: dict[tuple[str, str | None, bytes], np.ndarray] = {}  # (field, kind, steps) -> values
        self._windows: dict[int, P.Windows] = {}
        # what other modules derive from these reads, kept by them for the view's other readers (whatif.Inputs)
        self.derived: dict[tuple[Any, ...], Any] = {}

    @staticmethod
    def of(obj: object) -> View:
        """The View of a Trace (a new one), a View itself, or an object holding one (``.view``, a rules Run)."""
        if isinstance(obj, View):
            return obj
        view = getattr(obj, "view", None)
        if isinstance(view, View):
            return view
        return View(cast(Trace, obj))  # (anything else: a Trace)

    # -- tables --------------------------------------------------------------------------------------------------
    @cached_property
    def steps(self) -> pd.DataFrame:
        return self.trace.steps(lr_groups=False)

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @cached_property
    def meta(self) -> dict[str, Any]:
        return self.trace.meta

    @property
    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = self.meta.get("config", {}) or {}
        return config

    def sites(self, kind: str | None = None) -> pd.DataFrame:
        if kind not in self._sites:
            self._sites[kind] = self.trace.sites(kind)
        return self._sites[kind]

    # -- full statistics -----------------------------------------------------------------------------------------
    @cached_property
    def full_steps(self) -> np.ndarray:
        """Every step with full statistics (within the steps this view holds)."""
        fs = self.trace.full_steps()
        return fs[fs < self.n_steps]

    @cached_property
    def stat_steps(self) -> np.ndarray:
        """The full-statistics steps the statistics are read at: all of them, or MAX_STEPS evenly spaced."""
        return sample(self.full_steps, self._cap("stats", self.full_steps))

    def _cap(self, table: str, steps: np.ndarray) -> int:
        """MAX_STEPS, or fewer for a table whose steps hold rows of few sites (SPARSE_CELLS)."""
        n_sites = len(self.sites())
        if len(steps) <= 4 or n_sites * MAX_STEPS <= SPARSE_CELLS:
            return MAX_STEPS
        probe = sample(steps, 16)
        rows = self.trace.query(f"SELECT count(*) FROM {table} WHERE step IN ({','.join(map(str, probe.tolist()))})")
        if rows[0][0] * 16 >= n_sites * len(probe):
            return MAX_STEPS
        return max(4, min(MAX_STEPS, SPARSE_CELLS // n_sites))

    def stat(self, field: str, kind: str, steps: np.ndarray | None = None) -> np.ndarray:
        """[len(steps) x sites(kind)] of one statistic at ``steps`` (default: stat_steps), NaN where none. The
        statistics of STAT_FIELDS at stat_steps (of AT_FIELDS at other steps) are read for every site in one query."""
        steps = self.stat_steps if steps is None else np.asarray(steps, dtype=np.int64)
        key = (field, kind, steps.tobytes())
        if key not in self._stats:
            whole = (field, None, steps.tobytes())
            if whole not in self._stats:
                together = STAT_FIELDS if np.array_equal(steps, self.stat_steps) else AT_FIELDS
                fields = together if field in together else (field,)
                for f, arr in self.trace.stats_at(fields, None, steps).items():
                    self._stats[(f, None, steps.tobytes())] = arr
            self._stats[key] = self._stats[whole][:, self.sites(kind)["id"].to_numpy()]
        return self._stats[key]

    # -- histograms ----------------------------------------------------------------------------------------------
    @cached_property
    def hist_steps(self) -> np.ndarray:
        """The histogram steps read: all of them, or MAX_STEPS evenly spaced."""
        hs = self.trace.hist_steps()
        hs = hs[hs < self.n_steps]
        return sample(hs, self._cap("hists", hs))

    @cached_property
    def hists(self) -> Hists:
        """Every site's histograms at hist_steps, in (step, site) order."""
        return self.trace.hists_at(self.hist_steps)

    @cached_property
    def _by_site(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        order = np.argsort(self.hists.site, kind="stable")  # (site, step) order
        sites, starts = np.unique(self.hists.site[order], return_index=True)
        return order, sites, np.append(starts, len(order))

    def site_hists(self, site: int) -> Hists:
        """The histograms of one site at hist_steps, in step order."""
        order, sites, bounds = self._by_site
        i = np.searchsorted(sites, site)
        if i >= len(sites) or sites[i] != site:
            return self.hists.take(np.zeros(0, dtype=np.int64))
        return self.hists.take(order[bounds[i] : bounds[i + 1]])

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """Indices into ``hists`` of the rows of these sites, in (step, site) order."""
        return np.flatnonzero(np.isin(self.hists.site, ids))

    # -- peaks ---------------------------------------------------------------------------------------------------
    @cached_property
    def gradients(self) -> P.Gradients:
        """The gradient sites and the format each is computed in (the replay's definition)."""
        sc = self.config.get("scaler") or {}
        st = self.steps
        scaled = bool(sc.get("enabled")) and bool(st["loss_scale"].notna().any())
        rec = st["loss_scale"].to_numpy(float) if scaled else np.full(len(st), np.nan)
        return P.gradient_sites(self.sites("grad_out"), self.sites("param_grad"), self.sites("act"), rec)

    @cached_property
    def scan(self) -> P.Scan:
        """The one pass over the peaks: per site, per row (act / gradient groups, the gradient ratio) and the
        delayed-scaling windows at hist_steps for the act and grad_out sites."""
        return self._scan(P.HISTORIES)

    def windows(self, history: int) -> P.Windows:
        """The delayed-scaling windows of one amax history length (a length outside P.HISTORIES: one more pass)."""
        if history in P.HISTORIES:
            windows = self.scan.windows
            assert windows is not None  # (_scan always asks for windows)
            return windows
        if history not in self._windows:
            windows = self._scan((history,), windows_only=True).windows
            assert windows is not None
            self._windows[history] = windows
        return self._windows[history]

    def _scan(self, histories: tuple[int, ...], windows_only: bool = False) -> P.Scan:
        n = len(self.sites())
        acts, go, pg = (self.sites(k)["id"].to_numpy() for k in ("act", "grad_out", "param_grad"))
        st = self.steps
        ls = st["loss_scale"].to_numpy(float)
        stored = np.where(np.isfinite(ls) & (ls > 0), ls, 1.0)  # output gradients are stored scaled
        cols = np.concatenate([acts, go])
        windows = P.Windows(
            cols=cols,
            divide=np.concatenate([np.zeros(len(acts), bool), np.ones(len(go), bool)]),
            stored=stored,
            queries=self.hist_steps,
            histories=tuple(histories),
        )
        g = self.gradients
        ratio = None if windows_only else P.Ratio(g.ids, g.limits, g.scaled, g.carried)
        groups = {} if windows_only else {"act": acts, "grad": np.concatenate([go, pg])}
        return P.scan(self.trace.peak_chunks(self.n_steps), n, groups, ratio, windows)

    def peak_max(self, kind: str) -> np.ndarray:
        """Per site of ``kind``: the largest finite peak over every observed step (NaN: none)."""
        peak: npt.NDArray[np.float64] = self.scan.site_max[self.sites(kind)["id"].to_numpy()]
        return peak

    def nonfinite_rows(self, group: str, unseen: bool) -> np.ndarray:
        """Steps with a peaks row where a site of ``group`` held NaN/Inf (or, with ``unseen``, was not observed)."""
        s = self.scan
        bad = s.bad[group] | s.unseen[group] if unseen else s.bad[group]
        steps: npt.NDArray[np.int64] = s.steps[bad]
        return steps

    def per_step(self, rows: np.ndarray, fill: float) -> np.ndarray:
        """A per-row array of the scan spread over every step (``fill`` for the steps without a peaks row)."""
        out = np.full(self.n_steps, fill, dtype=np.asarray(rows).dtype)
        ok = self.scan.steps < self.n_steps
        out[self.scan.steps[ok]] = rows[ok]
        return out


def containers(paths: Iterable[str]) -> set[str]:
    """The module paths among ``paths`` whose output gradient is their last child's: a path some other path lies
    under, and the root when there is any other module. Linear in the total length of the paths."""
    present = set(paths)
    out = {p.rsplit(".", 1)[0] for p in present if "." in p}
    for p in list(out):
        while "." in p:
            p = p.rsplit(".", 1)[0]
            out.add(p)
    out &= present
    if ROOT in present and len(present) > 1:
        out.add(ROOT)
    return out
