"""A step's values as they reach the host: where each observation sits in the step's one vector (Entry, Layout),
the layout of a full-statistics vector, and the statistics derived from those vectors. numpy only: the writer
thread and the offline side use it; collect/stats.py computes the vectors with torch.

A full vector is [sum, l2 norm, counts at the rounding edges (EDGES), finite abs max] + a 512-key histogram. The
key is the top 9 bits of |x| as float32 (8 exponent bits + the first fraction bit): keys 2e and 2e+1 hold the binade
[2^(e-127), 2^(e-126)); key 510 holds +Inf and key 511 NaN (every NaN that arithmetic produces is a quiet NaN, whose
first fraction bit is set); keys 0 and 1 hold zeros and FP32 subnormals. The FP16/BF16 overflow, subnormal and flush
counts come from the EDGES counts: the cast rounds to nearest, so its thresholds (65520, 2^-25, ...; see
formats.Format.flush_at) fall inside binades, and a binade histogram cannot place them.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .. import formats


class Phase(str, Enum):
    """Where an observation was made (an Entry's phase; the events table's ``phase``)."""

    FWD = "fwd"  # a module's forward output (and its inputs)
    BWD = "bwd"  # a module's output gradient
    PARAM = "param"  # a parameter's gradient at the step end
    WEIGHT = "weight"
    UPDATE = "update"  # the change an optimizer step made to a parameter
    LOSS = "loss"


# The blocks of a step's vector (its ``bases`` keys): full-statistics vectors, the step figures, and one block of
# [min, max] pairs per dtype and device (peak_block).
FULL_BLOCK = "f"
EXTRAS_BLOCK = "x"


def peak_block(dtype: str, device: str | None = None, *, grads: bool = False) -> str:
    """The name of a block of [min, max] pairs: ``p<dtype>`` (``@device`` for a second device); parameter
    gradients' fixed slots ``g<dtype>@device``."""
    return ("g" if grads else "p") + dtype + (f"@{device}" if device is not None else "")


HIST_KEYS = 512

# Binade of key k (k = 2..509): floor(log2|x|) = k // 2 - 127.
KEY_INF, KEY_NAN = 510, 511
KEY_SHIFT = 22  # float32: 1 sign + 8 exponent + 23 fraction bits; >> 22 keeps exponent + 1 fraction bit
_INF_BITS = 0x7F800000  # |x| bit patterns order like |x|: finite < inf < NaN


def _f32_bits(v: float) -> int:
    b = int(np.float32(v).view(np.int32))
    assert float(np.float32(v)) == v, f"rounding threshold {v!r} is not a float32"
    return b


def _edges() -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The counts ``full`` keeps besides the histogram: for each edge, how many |x| lie at or below it (as a float32
    bit pattern; a strict "<" threshold t becomes the float32 just below t). Returns (names, bit patterns)."""
    names, bits = ["zero"], [0]
    for f in (formats.FP16, formats.BF16):
        names += [f"{f.name}_flush", f"{f.name}_sub", f"{f.name}_over"]
        over = _f32_bits(f.overflow_at)
        bits += [_f32_bits(f.flush_at), _f32_bits(f.subnormal_below) - 1, over - 1 if f.tie_overflows else over]
    order = np.argsort(bits, kind="stable")
    return tuple(names[i] for i in order), tuple(bits[i] for i in order)


EDGE_NAMES, EDGE_BITS = _edges()
# Layout of the head: sum, norm, one count per edge, absmax (last: the writer reads it at HEAD - 1).
I_SUM, I_NORM, I_EDGES = 0, 1, 2
HEAD = I_EDGES + len(EDGE_BITS) + 1
I_ABSMAX = HEAD - 1
FULL_LEN = HEAD + HIST_KEYS


def _binades(hist512: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """512 key counts (last axis) -> counts per exponent field 0..254 (binade e = field - 127; NaN/Inf left out).
    Field 0 holds the zeros and the FP32 subnormals together; ``derive`` takes the zeros out."""
    # (a sum over an axis of 2 is 20x slower)
    out: npt.NDArray[np.float64] = hist512[..., 0:510:2] + hist512[..., 1:510:2]
    return out


def merge_rows(mat: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Full vectors of several tensors of one site (module reuse, micro-batches) combined into one, for many sites
    at once: rows of ``mat`` grouped contiguously, ``starts`` the groups' first rows. Sums add, maxima max."""
    if len(starts) == len(mat):
        return mat
    out = np.add.reduceat(mat, starts, axis=0)
    out[:, I_NORM] = np.sqrt(np.add.reduceat(mat[:, I_NORM] ** 2, starts))
    out[:, I_ABSMAX] = np.maximum.reduceat(mat[:, I_ABSMAX], starts)
    return out


def derive_many(
    mat: npt.NDArray[np.float64], numel: npt.ArrayLike
) -> tuple[dict[str, npt.NDArray[np.float64]], npt.NDArray[np.float64]]:
    """Statistics (schema.STATS_FIELDS -> one array with a value per row) and the binade histograms (rows of counts for
    e = -127..127) of full vectors stacked as rows; numel per row."""
    numel = np.asarray(numel, dtype=np.float64)
    total, norm, absmax = mat[:, I_SUM], mat[:, I_NORM], mat[:, I_ABSMAX]
    le = {name: mat[:, I_EDGES + i] for i, name in enumerate(EDGE_NAMES)}  # |x| at or below each edge
    keys = mat[:, HEAD:]
    nan, inf = keys[:, KEY_NAN], keys[:, KEY_INF]
    bins = _binades(keys).astype(np.float64)
    zeros = le["zero"]
    bins[:, 0] -= zeros  # exponent field 0 is zeros + FP32 subnormals
    occupied = bins > 0
    lowest = np.where(occupied.any(axis=1), occupied.argmax(axis=1), -1)
    # Smallest non-zero magnitude, to the binade: the lower edge of the lowest occupied binade (FP32 subnormals:
    # the smallest subnormal).
    minabs = np.where(lowest < 0, 0.0, np.where(lowest == 0, 2.0**-149, np.exp2(lowest - 127.0)))
    safe = np.where(numel > 0, numel, 1.0)
    stats = {
        "numel": numel,
        "nan": nan,
        "inf": inf,
        "zeros": zeros,
        "absmax": absmax,
        "minabs": minabs,
        "mean": np.where(numel > 0, total / safe, 0.0),
        "rms": np.where(numel > 0, norm / np.sqrt(safe), 0.0),
    }
    # What a cast to FP16 / BF16 does to each value (round to nearest even; formats.Format.flush_at etc.):
    # flushed to zero, rounded to a non-zero subnormal, or overflowed to inf (finite values only: NaN/Inf are
    # counted apart). Exact counts, read at the edges.
    for f in (formats.FP16, formats.BF16):
        flush, sub, over = le[f"{f.name}_flush"], le[f"{f.name}_sub"], le[f"{f.name}_over"]
        stats[f"{f.name}_flush"] = flush - zeros
        stats[f"{f.name}_sub"] = sub - flush
        stats[f"{f.name}_over"] = numel - over - nan - inf
    return stats, bins


def derive(vec: npt.ArrayLike, numel: int) -> tuple[dict[str, float], npt.NDArray[np.float64]]:
    """Statistics dict (schema.STATS_FIELDS) and the binade histogram (counts for e = -127..127) of one full
    vector."""
    with np.errstate(all="ignore"):
        stats, bins = derive_many(np.asarray(vec, dtype=np.float64)[None, :], [numel])
    return {k: float(v[0]) for k, v in stats.items()}, bins[0]


class Entry(NamedTuple):
    """One observation of a site during a step: which values of the step's vector belong to it. A tuple, so that
    two steps with the same control flow compare equal cheaply and share one precomputed Layout."""

    site: int
    phase: Phase
    values: list[
        tuple[int, str, int]
    ]  # per tensor: (offset, block, numel); FULL_BLOCK: FULL_LEN values, else a peak_block's [min, max]
    inputs: list[tuple[int, str, int]] = []  # noqa: RUF012 (a NamedTuple's default, never mutated)  forward only, same layout


class Layout:
    """Index arrays for the entries of a step (built once per distinct layout, reused while steps repeat it)."""

    def __init__(self, entries: list[Entry], bases: dict[str, int]):
        refs = [r for e in entries for r in e.values]
        n = len(refs)
        self.offs = np.fromiter((o + bases[m] for o, m, _ in refs), dtype=np.int64, count=n)
        self.full = np.fromiter((m == FULL_BLOCK for _, m, _ in refs), dtype=bool, count=n)
        self.any_full = bool(self.full.any())
        self.owner = np.fromiter((i for i, e in enumerate(entries) for _ in e.values), dtype=np.int64, count=n)
        tensor_site = np.array([e.site for e in entries], dtype=np.int64)[self.owner] if n else np.zeros(0, np.int64)
        self.order = np.argsort(tensor_site, kind="stable")
        self.sites, self.starts = np.unique(tensor_site[self.order], return_index=True)
        self.full_plan = FullPlan(entries, bases) if self.any_full else None

    def peaks(self, values: np.ndarray) -> np.ndarray:
        """max |x| per tensor (last axis; values may stack several steps as rows): NaN if it held a NaN, else Inf
        if an Inf."""
        out = np.empty(values.shape[:-1] + (len(self.offs),))
        p, f = ~self.full, self.full
        if p.any():
            o = self.offs[p]
            out[..., p] = np.maximum(np.abs(values[..., o]), np.abs(values[..., o + 1]))  # NaN propagates
        if self.any_full:
            o = self.offs[f] + HEAD
            nan, inf, absmax = values[..., o + KEY_NAN], values[..., o + KEY_INF], values[..., o - 1]
            out[..., f] = np.where(nan > 0, np.nan, np.where(inf > 0, np.inf, absmax))
        return out

    def site_peaks(self, peaks: np.ndarray) -> np.ndarray:
        """Worst peak per site (over calls and tensors; last axis); NaN wins through np.maximum."""
        if not peaks.shape[-1]:
            return np.zeros(peaks.shape[:-1] + (0,))
        return np.maximum.reduceat(peaks[..., self.order], self.starts, axis=-1)


class FullPlan:
    """Where the full statistics of a step's sites are: the sites every observation of which had them (a site
    with one peaks-only call would get partial numbers), their full vectors' offsets grouped by site, and what
    each site's row needs besides (total numel, calls, whether it is a backward site, stored with the scale)."""

    def __init__(self, entries: list[Entry], bases: dict[str, int]):
        per_site: dict[int, list[Any]] = {}
        for e in entries:
            d = per_site.setdefault(e.site, [[], [], 0, e.phase, True])  # offsets, numels, calls, phase, all full
            d[2] += 1
            d[3] = e.phase
            for o, m, n in e.values:
                if m == FULL_BLOCK:
                    d[0].append(o + bases[FULL_BLOCK])
                    d[1].append(n)
                else:
                    d[4] = False
        keep = [(site, d) for site, d in per_site.items() if d[4] and d[0]]
        self.sites = np.array([site for site, _ in keep], dtype=np.int64)
        self.offs = np.array([o for _, d in keep for o in d[0]], dtype=np.int64)
        self.starts = np.cumsum([0] + [len(d[0]) for _, d in keep[:-1]]).astype(np.int64)
        self.numel = np.array([sum(d[1]) for _, d in keep], dtype=np.float64)
        self.calls = [d[2] for _, d in keep]
        self.bwd = np.array([d[3] == Phase.BWD for _, d in keep], dtype=bool)


def tensor_peaks(values: np.ndarray, refs: list[tuple[int, str, int]], bases: dict[str, int]) -> np.ndarray:
    """max |x| of each referenced tensor (see Layout.peaks)."""
    if not refs:
        return np.zeros(0)
    with np.errstate(all="ignore"):
        return Layout([Entry(-1, Phase.FWD, list(refs))], bases).peaks(values)
