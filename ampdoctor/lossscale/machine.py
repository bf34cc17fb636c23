"""GradScaler's update rule stepped over the evidence of a trace for many settings at once, a window of steps at a
time: time linear in the steps for the whole grid of ``replay --suggest``, not steps x settings Python iterations.

Between two skips a setting's scale follows a known schedule (it grows by ``growth_factor`` every ``growth_interval``
clean steps), so the skip decisions of the next W steps are one array comparison; the setting then moves to its first
skip (or W steps on). Settings that reach the same state (step, scale, growth tracker, factors, interval) continue as
one (their past counts kept apart), and a search may drop the settings whose skipped steps alone already lose more than
a bound (they cannot be the best). The decisions, FP32 roundings and underflow shares are ``simulate``'s exactly
(scaler.py): the cascade below is its branch for branch. Offline side: numpy only.
"""

from __future__ import annotations

import math

import numpy as np

F32_MAX = float(np.finfo(np.float32).max)
WINDOW_MIN, WINDOW_MAX = 8, 4096


def f32(x):
    """Round to FP32, as the scale tensor stores it (beyond the FP32 max: inf); a float or an array of them."""
    with np.errstate(over="ignore"):
        if isinstance(x, np.ndarray):
            return x.astype(np.float32).astype(float)
        return float(np.float32(x))


def _pow2(g: float) -> bool:
    m, _ = math.frexp(g)
    return m == 0.5


class Machine:
    """Settings stepped side by side (``run``); ``record`` keeps every step of each (``simulate``'s Replay arrays),
    otherwise only the histogram steps' scales and skips (what ``lost`` needs)."""

    def __init__(self, ev, settings: list, trackers: list, record: bool = False, bound: float = math.inf):
        m = len(settings)
        self.ev, self.n = ev, len(ev.steps)
        self.scale = f32(np.array([float(s["init_scale"]) for s in settings]))
        self.growth = np.array([float(s["growth_factor"]) for s in settings])
        self.backoff = np.array([float(s["backoff_factor"]) for s in settings])
        self.interval = np.array([int(s["growth_interval"]) for s in settings], dtype=np.int64)
        self.tracker = np.array(trackers, dtype=np.int64)
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
        self.merged: list = []  # (member, representative, skips offset, first histogram column it shares)
        self.slack = np.zeros(m, dtype=np.int64)  # per representative: the fewest past skips of its members, relative
        self.record = record
        if record:
            self.scales = np.empty((m, self.n))
            self.skipped = np.zeros((m, self.n), bool)
            self.estimated = np.zeros((m, self.n), bool)
        self._ev_arrays()

    def _ev_arrays(self) -> None:
        ev = self.ev
        self.rec = np.asarray(ev.rec_scale, dtype=float)
        self.over = np.asarray(ev.rec_over, dtype=bool)
        self.always = np.asarray(ev.always, dtype=bool)
        self.thr = np.asarray(ev.threshold, dtype=float)
        self.nb = np.asarray(ev.from_neighbours, dtype=bool)

    # -- the schedule and the decisions ----------------------------------------------------------------------------
    def _schedule(self, c: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(growths before each of the next ``width`` steps [g x w], the scale in force at each [g x w]) of settings
        ``c`` if none of those steps skips: the scale grows after the step on which the tracker reaches the interval,
        rounded to FP32, never to inf."""
        q = (self.tracker[c][:, None] + np.arange(width)[None, :]) // self.interval[c][:, None]
        s0, g = self.scale[c], self.growth[c]
        out = np.empty(q.shape)
        p2 = np.array([_pow2(x) for x in g], dtype=bool) & np.isfinite(s0) & (s0 > 0)
        if p2.any():  # a power-of-two factor multiplies exactly: s * g^q until the FP32 max
            i = np.flatnonzero(p2)
            e = np.array([math.frexp(x)[1] - 1 for x in g[i]], dtype=np.int64)
            e1 = np.maximum(e, 1)
            room = np.floor(np.log2(F32_MAX / s0[i]) / e1).astype(np.int64)  # growths that stay finite, +-1
            room = np.where(s0[i] * np.exp2(e1 * (room + 1.0)) <= F32_MAX, room + 1, room)
            room = np.where((room > 0) & (s0[i] * np.exp2(e1 * room.astype(float)) > F32_MAX), room - 1, room)
            k = np.minimum(q[i], np.maximum(room, 0)[:, None])
            out[i] = s0[i][:, None] * np.exp2((e[:, None] * k).astype(float))
        if (~p2).any():  # any other factor: the FP32 products one by one
            i = np.flatnonzero(~p2)
            top = int(q[i].max())
            table = np.empty((len(i), top + 1))
            table[:, 0] = s0[i]
            for j in range(top):
                grown = f32(table[:, j] * g[i])
                table[:, j + 1] = np.where(np.isfinite(grown), grown, table[:, j])
            out[i] = np.take_along_axis(table, q[i], axis=1)
        return q, out

    def _decide(self, s: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
    def run(self, advance=None) -> None:
        done_before = 0
        while True:
            alive = np.flatnonzero(self.active)
            if not len(alive):
                break
            for w in np.unique(self.window[alive]):
                self._step(alive[self.window[alive] == w], int(w))
            self._merge()
            if advance is not None:
                done = int((~self.active).sum())
                if done > done_before:
                    advance(done - done_before)
                    done_before = done

    def _step(self, c: np.ndarray, width: int) -> None:
        n = self.n
        idx = self.pos[c][:, None] + np.arange(width)[None, :]
        valid = idx < n
        t = np.minimum(idx, n - 1)
        _, s = self._schedule(c, width)
        skip, est = self._decide(s, t)
        skip &= valid
        has = skip.any(axis=1)
        length = np.where(has, skip.argmax(axis=1) + 1, valid.sum(axis=1))  # steps taken, the skip included
        last = length - 1
        rows = np.arange(len(c))
        if self.record:
            for r, k in enumerate(c.tolist()):
                a, b = int(self.pos[k]), int(self.pos[k] + length[r])
                self.scales[k, a:b] = s[r, : length[r]]
                self.estimated[k, a:b] = est[r, : length[r]]
                if has[r]:
                    self.skipped[k, b - 1] = True
        if len(self.hsteps):
            lo = np.searchsorted(self.hsteps, self.pos[c])
            hi = np.searchsorted(self.hsteps, self.pos[c] + length)
            for r in np.flatnonzero(hi > lo).tolist():
                k, cols = c[r], np.arange(lo[r], hi[r])
                off = self.hsteps[cols] - self.pos[k]
                self.h_scale[k, cols] = s[r, off]
                self.h_skip[k, cols] = has[r] & (off == last[r])
        # the state after the window: a skip backs off and resets the tracker; else the schedule went on
        end_scale = s[rows, last]
        grown_q = (self.tracker[c] + length) // self.interval[c]
        _, after = self._schedule(c, int(length.max()) + 1)
        clean_scale = after[rows, length]
        self.scale[c] = np.where(has, f32(end_scale * self.backoff[c]), clean_scale)
        self.tracker[c] = np.where(has, 0, (self.tracker[c] + length) - grown_q * self.interval[c])
        self.sk[c] += has
        self.pos[c] += length
        self.window[c] = np.where(
            has, np.clip(2 * length, WINDOW_MIN, WINDOW_MAX), np.minimum(2 * width, WINDOW_MAX)
        ).astype(np.int64)
        finished = self.pos[c] >= n
        self.active[c[finished]] = False
        if math.isfinite(self.bound):  # skipped steps alone lose more than the bound: not the best
            hopeless = (self.sk[c] + self.slack[c]) > self.bound * n + 2e-12 * n
            self.pruned[c[hopeless & ~finished]] = True
            self.active[c[hopeless]] = False

    def _merge(self) -> None:
        """Settings in the same state from here on run as one (the first of them)."""
        alive = np.flatnonzero(self.active)
        if len(alive) < 2 or self.record:
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
