"""One setting of a Machine (machine.py) stepped to the end in plain Python: once the settings of a family have merged,
each runs alone, and for one setting a scalar loop (a block of BLOCK decision-free steps passed over at once, the
others decided one by one) costs less than numpy calls on arrays of one row. Same cascade, FP32 roundings and
histogram records as the Machine (and so as ``simulate``). The Machine hands over what the loop needs (the evidence
as lists, the setting's state, its histogram records and a way to ask whether to go on): this module does not know
the Machine. Offline side: numpy only."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .evidence import BoolArray, FloatArray, IntArray

PRUNE_EVERY = 4096  # steps between two looks at the bound


_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)


def _f32(x: float) -> float:
    """Round to FP32 (beyond its max: inf). A power-of-two multiple of an FP32 value in the normal range is one."""
    if _F32_TINY <= x <= _F32_MAX and math.frexp(x)[0] == 0.5:
        return x
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(x))


@dataclass(frozen=True)
class Track:
    """The per-step evidence a lone setting is stepped over, as Python lists (cheap to index one item at a time)."""

    rec: list[float]  # recorded scale
    over: list[bool]  # overflowed at it
    always: list[bool]  # overflows at every scale
    thr: list[float]  # estimated threshold
    floor: list[float]  # per block of ``block`` steps: a scale at or below which none of them skips
    in_block: dict[int, list[tuple[int, int]]]  # block -> its histogram steps and their columns
    hcol: dict[int, int]  # histogram step -> its column
    n: int  # steps
    block: int  # steps a floor covers
    has_scaler: bool

    @classmethod
    def of(
        cls,
        rec: FloatArray,
        over: BoolArray,
        always: BoolArray,
        thr: FloatArray,
        block_floor: FloatArray,
        hsteps: IntArray,
        n: int,
        block: int,
        has_scaler: bool,
    ) -> Track:
        in_block: dict[int, list[tuple[int, int]]] = {}
        for j, t in enumerate(hsteps.tolist()):
            in_block.setdefault(t // block, []).append((t, j))
        return cls(
            rec=rec.tolist(),
            over=over.tolist(),
            always=always.tolist(),
            thr=thr.tolist(),
            floor=block_floor.tolist(),
            in_block=in_block,
            hcol={int(t): j for j, t in enumerate(hsteps.tolist())},
            n=n,
            block=block,
            has_scaler=has_scaler,
        )


@dataclass
class Lane:
    """One setting's state (scale, growth tracker, skips so far, next step) and its factors and interval."""

    scale: float
    tracker: int
    skipped: int
    pos: int
    growth: float
    backoff: float
    interval: int


def run_one(
    track: Track,
    lane: Lane,
    h_scale: FloatArray,
    h_skip: BoolArray,
    keep: Callable[[Lane], bool],
    skips: list[int] | None = None,
) -> bool:
    """Step ``lane`` (in place) from where it stands to the end of the track, recording the scale and skip of each
    histogram step in ``h_scale`` / ``h_skip``. Every PRUNE_EVERY steps ``keep`` is asked with the state so far
    whether to go on: False drops the setting there (the return value: whether it reached the end). ``skips``
    gets the steps that skipped, in order."""
    rec, over, always, thr, floor, in_block, hcol = (
        track.rec,
        track.over,
        track.always,
        track.thr,
        track.floor,
        track.in_block,
        track.hcol,
    )
    n, block, hs = track.n, track.block, track.has_scaler
    s, tr, sk, t = lane.scale, lane.tracker, lane.skipped, lane.pos
    g, b, iv = lane.growth, lane.backoff, lane.interval

    def grown(x: float, times: int) -> float:
        for _ in range(times):
            y = _f32(x * g)
            if not math.isfinite(y):  # torch never grows the scale to inf
                break
            x = y
        return x

    look = t + PRUNE_EVERY
    while t < n:
        if t >= look:
            lane.scale, lane.tracker, lane.skipped, lane.pos = s, tr, sk, t
            if not keep(lane):
                return False
            look = t + PRUNE_EVERY
        if t % block == 0 and t + block <= n:
            last = grown(s, (tr + block - 1) // iv)  # the largest scale in force within the block
            if last <= floor[t // block]:  # no step of the block skips at these scales
                for th, j in in_block.get(t // block, ()):  # its histogram steps: the scale the schedule reached
                    h_scale[j], h_skip[j] = grown(s, (tr + th - t) // iv), False
                s = grown(s, (tr + block) // iv)
                tr = (tr + block) % iv
                t += block
                continue
        r = rec[t]
        if s == r:
            skip = over[t]
        elif always[t] or (hs and over[t] and s > r):  # no scale helps / overflow is monotone in the scale
            skip = True
        elif hs and not over[t] and s < r:
            skip = False
        else:
            skip = s > thr[t]
        col = hcol.get(t)
        if col is not None:
            h_scale[col], h_skip[col] = s, skip
        if skip:
            s, tr, sk = _f32(s * b), 0, sk + 1
            if skips is not None:
                skips.append(t)
        else:
            tr += 1
            if tr >= iv:
                s, tr = grown(s, 1), 0
        t += 1
    lane.scale, lane.tracker, lane.skipped, lane.pos = s, tr, sk, t
    return True
