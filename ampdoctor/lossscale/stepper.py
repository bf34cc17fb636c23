"""One setting of a Machine (machine.py) stepped to the end in plain Python: once the settings of a family have merged,
each runs alone, and for one setting a scalar loop (a block of BLOCK decision-free steps passed over at once, the
others decided one by one) costs less than numpy calls on arrays of one row. Same cascade, FP32 roundings and
histogram records as the Machine (and so as ``simulate``). Offline side: numpy only."""

from __future__ import annotations

import math

import numpy as np

PRUNE_EVERY = 4096  # steps between two looks at the bound


_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)


def _f32(x: float) -> float:
    """Round to FP32 (beyond its max: inf). A power-of-two multiple of an FP32 value in the normal range is one."""
    if _F32_TINY <= x <= _F32_MAX and math.frexp(x)[0] == 0.5:
        return x
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(x))


def run_one(m, k: int) -> None:
    """Step setting ``k`` of Machine ``m`` from where it stands to the end of the trace, or until the bound drops it."""
    lists = m.__dict__.get("_lists")
    if lists is None:
        in_block: dict[int, list[tuple[int, int]]] = {}  # block -> its histogram steps and their columns
        for j, t in enumerate(m.hsteps.tolist()):
            in_block.setdefault(t // m.BLOCK, []).append((t, j))
        lists = m.__dict__["_lists"] = (
            m.rec.tolist(),
            m.over.tolist(),
            m.always.tolist(),
            m.thr.tolist(),
            m.block_floor.tolist(),
            in_block,
            {int(t): j for j, t in enumerate(m.hsteps.tolist())},
        )
    rec, over, always, thr, floor, in_block, hcol = lists
    n, block, hs = m.n, m.BLOCK, m.ev.has_scaler
    s, tr, sk, t = float(m.scale[k]), int(m.tracker[k]), int(m.sk[k]), int(m.pos[k])
    g, b, iv = float(m.growth[k]), float(m.backoff[k]), int(m.interval[k])
    h_scale, h_skip = m.h_scale[k], m.h_skip[k]

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
            m.scale[k], m.tracker[k], m.sk[k], m.pos[k] = s, tr, sk, t
            m.prune(np.array([k]))
            if not m.active[k]:
                return
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
        j = hcol.get(t)
        if j is not None:
            h_scale[j], h_skip[j] = s, skip
        if skip:
            s, tr, sk = _f32(s * b), 0, sk + 1
        else:
            tr += 1
            if tr >= iv:
                s, tr = grown(s, 1), 0
        t += 1
    m.scale[k], m.tracker[k], m.sk[k], m.pos[k] = s, tr, sk, t
    m.active[k] = False
