"""GradScaler's update rule stepped over the evidence of a trace for many settings at once, a window of steps at a
time: time linear in the steps for the whole grid of ``replay --suggest``, not steps x settings Python iterations.

Between two skips a setting's scale follows a known schedule (it grows by ``growth_factor`` every ``growth_interval``
clean steps), so the skip decisions of the next W steps are one array comparison; the setting then moves to its first
skip (or W steps on). Settings that reach the same state (step, scale, growth tracker, factors, interval) continue as
one (their past counts kept apart), and a search may drop the settings whose skipped steps alone will lose more than a
bound (they cannot be the best): besides the skips so far, the ones still to come are bounded below
(``_future_skips``). The decisions, FP32 roundings and underflow shares are ``simulate``'s exactly (scaler.py): the
cascade below is its branch for branch. Offline side: numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast, overload

import numpy as np

from .defaults import Settings
from .evidence import BoolArray, Evidence, FloatArray, Histogram, IntArray
from .stepper import Lane, Track, run_one

F32_MAX = float(np.finfo(np.float32).max)
WINDOW_MIN, WINDOW_MAX = 8, 1 << 16  # steps looked ahead at once (decided one by one: at most 2 * BLOCK)
BLOCK = 64  # steps whose decisions a block floor settles at once
CHECKPOINT = 4096  # steps between the points where the settings of a family compare their states


@overload
def f32(x: float) -> float: ...
@overload
def f32(x: FloatArray) -> FloatArray: ...
def f32(x: float | FloatArray) -> float | FloatArray:
    """Round to FP32, as the scale tensor stores it (beyond the FP32 max: inf); a float or an array of them."""
    with np.errstate(over="ignore"):
        if isinstance(x, np.ndarray):
            return x.astype(np.float32).astype(float)
        return float(np.float32(x))


def _pow2(g: float) -> bool:
    m, _ = math.frexp(g)
    return m == 0.5


class Machine:
    """Settings stepped side by side (``run``); ``record`` keeps every step of each (``simulate``'s Replay arrays:
    each setting stepped alone, its steps rebuilt from its skips), otherwise only the histogram steps' scales and skips
    (what ``lost`` needs)."""

    def __init__(
        self,
        ev: Evidence,
        settings: Sequence[Settings],
        trackers: list[int],
        record: bool = False,
        bound: float = math.inf,
    ) -> None:
        m = len(settings)
        self.ev, self.n = ev, len(ev.steps)
        self.scale = f32(np.array([float(s["init_scale"]) for s in settings]))
        self.growth = np.array([float(s["growth_factor"]) for s in settings])
        self.backoff = np.array([float(s["backoff_factor"]) for s in settings])
        self.interval = np.array([int(s["growth_interval"]) for s in settings], dtype=np.int64)
        self.tracker = np.array(trackers, dtype=np.int64)
        self.pow2 = np.array([_pow2(g) for g in self.growth], dtype=bool)  # multiplies exactly
        self.exact = self.pow2 & np.array([_pow2(1.0 / b) for b in self.backoff], dtype=bool)  # a lattice of scales
        self.exp2 = np.array([math.frexp(g)[1] - 1 for g in self.growth], dtype=np.int64)
        self.pos = np.zeros(m, dtype=np.int64)
        self.sk = np.zeros(m, dtype=np.int64)
        self.window = np.full(m, 64, dtype=np.int64)
        self.active = np.ones(m, bool)
        self.pruned = np.zeros(m, bool)
        self.bound = bound
        self.hsteps = np.array(sorted(t for t in ev.hist if 0 <= t < self.n), dtype=np.int64)
        h = len(self.hsteps)
        self.h_scale = np.full((m, h), np.nan)
        self.h_skip = np.zeros((m, h), bool)
        # (member, representative, skips offset, first histogram column it shares)
        self.merged: list[tuple[int, int, int, int]] = []
        self.slack = np.zeros(m, dtype=np.int64)  # per representative: the fewest past skips of its members, relative
        self.record = record
        self._track: Track | None = None  # the evidence as lists, for the settings stepped alone (stepper.py)
        self._shares: dict[tuple[int, float], float] = {}  # (histogram step, scale) -> underflow share (``lost``)
        if record:
            self.scales = np.empty((m, self.n))
            self.skipped = np.zeros((m, self.n), bool)
            self.estimated = np.zeros((m, self.n), bool)
        self._ev_arrays()
        self._ceiling()
        self._floor()

    def _ev_arrays(self) -> None:
        ev = self.ev
        self.rec = np.asarray(ev.rec_scale, dtype=float)
        self.over = np.asarray(ev.rec_over, dtype=bool)
        self.always = np.asarray(ev.always, dtype=bool)
        self.thr = np.asarray(ev.threshold, dtype=float)
        self.nb = np.asarray(ev.from_neighbours, dtype=bool)

    def _ceiling(self) -> None:
        """Per step, log2 of the largest scale at which it can go through (``_decide`` gives no skip only at or below
        it; inf where no such bound holds), and its maximum over the steps from each step on."""
        rec, over, thr = self.rec, self.over, self.thr
        with np.errstate(invalid="ignore", divide="ignore"):
            free = np.where(np.isnan(thr), np.inf, thr)  # a NaN threshold never skips
            top = np.where(over, free, np.fmax(rec, free))  # with or without a scaler
            top = np.where(self.always, np.where(over, -np.inf, np.where(np.isnan(rec), -np.inf, rec)), top)
            x = np.log2(np.maximum(top, 0.0))
        self.ceiling = np.append(np.maximum.accumulate(x[::-1])[::-1], -np.inf)

    def _future_skips(self, c: IntArray) -> FloatArray:
        """A lower bound on the skips still to come for settings ``c`` (0 where none is known). A scale that goes
        through a step is at most 2^ceiling there, so after a growth at most 2^(ceiling + gamma); growing gamma (log2
        of the growth factor) every ``interval`` clean steps and backing off beta per skip, a setting at log2 scale x
        with L steps to go takes S >= (gamma (L - i + 1) / i - max(0, X + gamma - x)) / (beta + gamma) skips, X the
        highest ceiling ahead. Only for power-of-two factors (exact steps) well below the FP32 max (growth stops
        there)."""
        gamma = np.log2(self.growth[c])
        beta = -np.log2(self.backoff[c])
        i = self.interval[c].astype(float)
        left = (self.n - self.pos[c]).astype(float)
        top = self.ceiling[np.minimum(self.pos[c], self.n)]
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            x = np.log2(self.scale[c])
            room = np.maximum(0.0, top + gamma - x)
            lb = (gamma * (left - i + 1) / i - room) / (beta + gamma)
        known = self.exact[c] & np.isfinite(top) & (top + 2 * gamma < 127) & np.isfinite(lb)
        return np.where(known, np.maximum(np.floor(lb), 0.0), 0.0)

    # -- the schedule and the decisions ----------------------------------------------------------------------------
    def _schedule(self, c: IntArray, off: IntArray) -> FloatArray:
        """The scale in force ``off`` steps ahead ([g x k] offsets, rows for settings ``c``, which may repeat) if none
        of the steps before skips: the scale grows after the step on which the tracker reaches the interval, rounded
        to FP32, never to inf."""
        q = (self.tracker[c][:, None] + off) // self.interval[c][:, None]
        s0, g = self.scale[c], self.growth[c]
        out = np.empty(q.shape)
        with np.errstate(invalid="ignore"):
            p2 = self.pow2[c] & np.isfinite(s0) & (s0 > 0)
        if p2.any():  # a power-of-two factor multiplies exactly: s * g^q until the FP32 max
            i = np.flatnonzero(p2)
            e = self.exp2[c][i]
            e1 = np.maximum(e, 1)
            room = np.floor(np.log2(F32_MAX / s0[i]) / e1).astype(np.int64)  # growths that stay finite, +-1
            room = np.where(s0[i] * np.exp2(e1 * (room + 1.0)) <= F32_MAX, room + 1, room)
            room = np.where((room > 0) & (s0[i] * np.exp2(e1 * room.astype(float)) > F32_MAX), room - 1, room)
            k = np.minimum(q[i], np.maximum(room, 0)[:, None])
            out[i] = s0[i][:, None] * np.exp2((e[:, None] * k).astype(float))
        if (~p2).any():  # any other factor: the FP32 products one by one
            i = np.flatnonzero(~p2)
            top = int(q[i].max()) if q[i].size else 0
            table = np.empty((len(i), top + 1))
            table[:, 0] = s0[i]
            for j in range(top):
                grown = f32(table[:, j] * g[i])
                table[:, j + 1] = np.where(np.isfinite(grown), grown, table[:, j])
            out[i] = np.take_along_axis(table, q[i], axis=1)
        return out

    def _floor(self) -> None:
        """Per block of BLOCK steps, a scale at or below which none of its steps skips (``_decide`` says no skip for
        every s <= floor): a setting whose scale stays under it goes through the block without a decision made."""
        rec, over, thr, always = self.rec, self.over, self.thr, self.always
        with np.errstate(invalid="ignore"):
            free = np.where(np.isnan(thr), np.inf, thr)  # a NaN threshold: never "s > thr"
            below_rec = np.where(np.isnan(rec), np.inf, np.nextafter(rec, -np.inf))
            if self.ev.has_scaler:  # not over: at_rec | s < rec | s <= thr goes through
                calm = np.fmax(np.where(np.isnan(rec), -np.inf, rec), free)
            else:  # not over: at_rec or s <= thr goes through
                calm = free
            floor = np.where(always, -np.inf, np.where(over, np.minimum(free, below_rec), calm))
        self.block_floor = np.minimum.reduceat(floor, np.arange(0, self.n, BLOCK)) if self.n else np.zeros(0)

    def _decide(self, s: FloatArray, t: IntArray) -> tuple[BoolArray, BoolArray]:
        """simulate's cascade on arrays: (skip, decided by the estimated threshold)."""
        rec, over, always, thr = self.rec[t], self.over[t], self.always[t], self.thr[t]
        with np.errstate(invalid="ignore"):
            at_rec = s == rec
            above, below, past = s > rec, s < rec, s > thr
        if self.ev.has_scaler:
            skip = np.where(always, ~at_rec | over, np.where(over, at_rec | above | past, ~at_rec & ~below & past))
            estimated = ~at_rec & ~always & ~(over & above) & ~(~over & below)
        else:
            skip = np.where(always, ~at_rec | over, np.where(at_rec, over, past))
            estimated = ~at_rec & ~always
        return skip, estimated & self.nb[t]

    # -- stepping --------------------------------------------------------------------------------------------------
    def run(
        self,
        advance: Callable[[int], object] | None = None,
        shares: Callable[[Histogram, float], tuple[float, float]] | None = None,
    ) -> None:
        """Step every setting to the end (or until dropped). ``shares``: the underflow shares of a histogram at a
        scale (scaler.shares): with it, a setting that finishes tightens the bound to its own loss.

        The settings of one family (interval and factors: those that can meet in one state) wait for each other at
        every CHECKPOINT-th step, where the ones in the same state merge; families do not wait for each other."""
        told = [0]

        def tell() -> None:  # settings done since the last call
            if advance is not None:
                done = int((~self.active).sum())
                if done > told[0]:
                    advance(done - told[0])
                    told[0] = done

        _, family = np.unique(np.stack([self.interval, self.growth, self.backoff], axis=1), axis=0, return_inverse=True)
        family = family.reshape(-1)
        target = np.full(family.max() + 1 if len(family) else 0, CHECKPOINT, dtype=np.int64)
        self.prune(np.flatnonzero(self.active))
        if self.record:  # every step of each kept: one by one (stepper.py), the record rebuilt from the skips
            for k in np.flatnonzero(self.active).tolist():
                self._run_alone(k, record=True)
            tell()
            return
        while True:
            alive = np.flatnonzero(self.active)
            if not len(alive):
                tell()
                break
            # a family down to one setting: stepped alone, in plain Python (stepper.py)
            fam, count = np.unique(family[alive], return_counts=True)
            single = alive[np.isin(family[alive], fam[count == 1])]
            for k in single[np.argsort(-self.interval[single], kind="stable")].tolist():  # calm ones first
                self._run_alone(k)
                if shares is not None and math.isfinite(self.bound) and not self.pruned[k]:
                    self.bound = min(self.bound, self.lost(k, shares))
            alive = np.flatnonzero(self.active)
            if not len(alive):
                tell()
                break
            stop = np.minimum(target[family[alive]], self.n)
            moving = self.pos[alive] < stop
            if moving.any():
                c = alive[moving]
                small = self.window[c] <= 2 * BLOCK  # settings that skip often, apart from those that jump far
                for part in (c[small], c[~small]):
                    if len(part):
                        self._step(part, self.window[part], np.minimum(target[family[part]], self.n))
            arrived = np.setdiff1d(family[alive], family[alive[moving]])  # families all at their checkpoint
            for f in arrived.tolist():
                self._merge(alive[family[alive] == f])
                target[f] += CHECKPOINT
            if shares is not None and math.isfinite(self.bound):
                done_now = alive[~self.active[alive] & ~self.pruned[alive] & (self.pos[alive] >= self.n)]
                for k in done_now.tolist():  # (merged ones are inactive too, but not done)
                    self.bound = min(self.bound, self.lost(k, shares))
            tell()

    def _run_alone(self, k: int, record: bool = False) -> None:
        """Setting ``k`` stepped from where it stands to the end (or until the bound drops it) in plain Python;
        ``record``: and its every step kept (``_fill``)."""
        if self._track is None:
            self._track = Track.of(
                self.rec,
                self.over,
                self.always,
                self.thr,
                self.block_floor,
                self.hsteps,
                self.n,
                BLOCK,
                self.ev.has_scaler,
            )
        lane = Lane(
            scale=float(self.scale[k]),
            tracker=int(self.tracker[k]),
            skipped=int(self.sk[k]),
            pos=int(self.pos[k]),
            growth=float(self.growth[k]),
            backoff=float(self.backoff[k]),
            interval=int(self.interval[k]),
        )

        def keep(now: Lane) -> bool:  # the state so far stored; is the setting still in the running?
            self._store(k, now)
            self.prune(np.array([k]))
            return bool(self.active[k])

        start = (lane.scale, lane.tracker)
        skips: list[int] | None = [] if record else None
        if run_one(self._track, lane, self.h_scale[k], self.h_skip[k], keep, skips):
            self._store(k, lane)
            self.active[k] = False
            if skips is not None:
                self._fill(k, *start, skips)

    def _fill(self, k: int, scale: float, tracker: int, skips: list[int]) -> None:
        """The record of setting ``k`` (the scale at every step, its skips, the estimated decisions) rebuilt from the
        steps it skipped, having started at ``scale`` and ``tracker``: up to each skip the scale follows the schedule
        (``_schedule``) from the state the previous skip left (backed off, tracker 0)."""
        if not self.n:
            return
        final = (self.scale[k], self.tracker[k])
        row = np.array([k])
        a = 0
        for t in skips + ([self.n - 1] if not skips or skips[-1] < self.n - 1 else []):
            self.scale[k], self.tracker[k] = scale, tracker
            self.scales[k, a : t + 1] = self._schedule(row, np.arange(t + 1 - a)[None, :])[0]
            scale, tracker, a = f32(float(self.scales[k, t]) * float(self.backoff[k])), 0, t + 1
        self.scale[k], self.tracker[k] = final
        self.skipped[k, skips] = True
        self.estimated[k] = self._decide(self.scales[k], np.arange(self.n))[1]

    def _store(self, k: int, lane: Lane) -> None:
        self.scale[k], self.tracker[k], self.sk[k], self.pos[k] = lane.scale, lane.tracker, lane.skipped, lane.pos

    def lost(self, k: int, shares: Callable[[Histogram, float], tuple[float, float]]) -> float:
        """``Replay.lost`` of setting k from its histogram steps (after ``finish`` for a merged one)."""
        cache = self._shares
        applied = ~self.h_skip[k] & ~np.isnan(self.h_scale[k])
        under = []
        for j in np.flatnonzero(applied).tolist():
            key = (int(self.hsteps[j]), float(self.h_scale[k, j]))
            if key not in cache:
                cache[key] = shares(self.ev.hist[key[0]], key[1])[0]
            under.append(cache[key])
        u = np.array(under, dtype=float)
        u = u[~np.isnan(u)]
        mean = float(u.mean()) if len(u) else math.nan
        n = self.n
        return (int(self.sk[k]) + (n - int(self.sk[k])) * (0.0 if math.isnan(mean) else mean)) / n if n else math.nan

    def _step(self, c: IntArray, widths: IntArray, stop: IntArray) -> None:
        """Settings ``c`` to their next skip, or ``widths`` steps on, never past ``stop``."""
        n = self.n
        pos = self.pos[c]
        rows = np.arange(len(c))
        widths = np.broadcast_to(np.asarray(widths, dtype=np.int64), (len(c),))
        width = int(widths.max())
        # jump over the blocks whose floor stays above the scale (no decision there)
        nb = width // BLOCK + 1
        col = np.arange(nb)[None, :]
        b = np.minimum(pos[:, None] // BLOCK + col, len(self.block_floor) - 1)
        ends = np.minimum((b + 1) * BLOCK, n) - 1
        ok = self.block_floor[b] >= self._schedule(c, np.maximum(ends - pos[:, None], 0))
        ok &= col < (widths // BLOCK + 1)[:, None]  # each setting looks as far ahead as its own window
        fail = np.where(ok.all(axis=1), nb, ok.argmin(axis=1))
        safe = np.where(fail == 0, 0, (pos // BLOCK + fail) * BLOCK - pos)
        safe = np.clip(safe, 0, stop - pos)
        width = min(width, 2 * BLOCK)
        off = safe[:, None] + np.arange(width + 1)[None, :]  # one more: the scale after, when nothing skips
        idx = pos[:, None] + off[:, :width]
        valid = idx < stop[:, None]
        sched = self._schedule(c, off)
        s = sched[:, :width]
        skip, _ = self._decide(s, np.minimum(idx, n - 1))
        skip &= valid
        has = cast(BoolArray, skip.any(axis=1))  # (numpy's stubs: a bool or an array; a 2-d array gives an array)
        j = np.where(has, skip.argmax(axis=1) + 1, valid.sum(axis=1))  # decided steps taken, the skip included
        length = safe + j
        if len(self.hsteps):
            lo = np.searchsorted(self.hsteps, pos)
            hi = np.searchsorted(self.hsteps, pos + length)
            hr = np.repeat(rows, hi - lo)  # a row per histogram step passed
            if len(hr):
                cols = np.arange(len(hr)) - np.repeat(np.cumsum(hi - lo) - (hi - lo), hi - lo) + np.repeat(lo, hi - lo)
                h_off = self.hsteps[cols] - pos[hr]
                self.h_scale[c[hr], cols] = self._schedule(c[hr], h_off[:, None])[:, 0]
                self.h_skip[c[hr], cols] = has[hr] & (h_off == length[hr] - 1)
        # the state after the window: a skip backs off and resets the tracker; else the schedule went on
        end_scale = sched[rows, np.maximum(j - 1, 0)]  # the scale the skipped step ran at
        grown_q = (self.tracker[c] + length) // self.interval[c]
        clean_scale = sched[rows, j]
        self.scale[c] = np.where(has, f32(end_scale * self.backoff[c]), clean_scale)
        self.tracker[c] = np.where(has, 0, (self.tracker[c] + length) - grown_q * self.interval[c])
        self.sk[c] += has
        self.pos[c] += length
        # the next window: twice the way to this skip (a power of two: few distinct sizes to step apart), or twice
        # this window when none came
        grow = 1 << np.ceil(np.log2(np.maximum(2 * length, 1))).astype(np.int64)
        self.window[c] = np.where(has, np.clip(grow, WINDOW_MIN, WINDOW_MAX), np.minimum(2 * length + 1, WINDOW_MAX))
        self.window[c] = 1 << np.ceil(np.log2(np.maximum(self.window[c], WINDOW_MIN))).astype(np.int64)
        self.active[c[self.pos[c] >= n]] = False
        self.prune(c[self.active[c]])

    def prune(self, c: IntArray) -> None:
        """Drop the settings whose skipped steps alone will lose more than the bound: not the best."""
        if not math.isfinite(self.bound) or not len(c):
            return
        hopeless = (self.sk[c] + self.slack[c] + self._future_skips(c)) > self.bound * self.n + 2e-12 * self.n
        self.pruned[c[hopeless]] = True
        self.active[c[hopeless]] = False

    def _merge(self, alive: IntArray) -> None:
        """Settings in the same state from here on run as one (the first of them)."""
        alive = alive[self.active[alive]]
        if len(alive) < 2:
            return
        key = np.stack(
            [
                self.pos[alive].astype(float),
                self.scale[alive],
                self.tracker[alive].astype(float),
                self.interval[alive].astype(float),
                self.growth[alive],
                self.backoff[alive],
            ],
            axis=1,
        )
        _, first, inverse = np.unique(key, axis=0, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        for r, k in enumerate(alive.tolist()):
            rep = int(alive[first[inverse[r]]])
            if rep == k:
                continue
            col = int(np.searchsorted(self.hsteps, self.pos[k]))
            offset = int(self.sk[k] - self.sk[rep])
            self.merged.append((k, rep, offset, col))
            self.slack[rep] = min(self.slack[rep], offset + self.slack[k])
            self.active[k] = False

    def finish(self) -> None:
        """Members of a merged group take their representative's future (latest merges first: chains resolve)."""
        for k, rep, offset, col in reversed(self.merged):
            self.sk[k] = self.sk[rep] + offset
            self.pruned[k] = self.pruned[rep]  # a representative is dropped only when all its members can be
            self.h_scale[k, col:] = self.h_scale[rep, col:]
            self.h_skip[k, col:] = self.h_skip[rep, col:]
            self.scale[k] = self.scale[rep]
