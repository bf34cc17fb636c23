"""Tensor -> numbers. Pure device-side kernels, no I/O and no host sync.

Two kernels, both returning a 1-D float64 tensor on the tensor's own device so that every value of a step can be
concatenated and moved to the host in one transfer (DESIGN principle 3):

* ``peak(x)``  -> [min, max]: one ``aminmax`` pass (NaN and Inf propagate, so a non-finite tensor is visible).
* ``full(x)``  -> FULL_LEN values: [sum, l2 norm, counts at the rounding edges (EDGES), finite abs max] + a 512-bin
  histogram.

The histogram key is the top 9 bits of |x| as float32 (8 exponent bits + the first fraction bit), read straight
from the bit pattern (no log2, no frexp). Keys 2e and 2e+1 hold the binade [2^(e-127), 2^(e-126)); key 510 holds
+Inf and key 511 NaN (every NaN that arithmetic produces is a quiet NaN, whose first fraction bit is set); keys 0 and
1 hold zeros and FP32 subnormals. The binade counts and NaN/Inf come from it. The FP16/BF16 overflow, subnormal and
flush counts come from the EDGES counts: the cast rounds to nearest, so its thresholds (65520, 2^-25, ...; see
formats.Format.flush_at) fall inside binades, and a binade histogram cannot place them. bf16 and fp16 tensors are
widened to float32 first, which is exact; float64 tensors are narrowed to float32 (a value within one float32
rounding of a threshold may then be counted on the other side of it).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .. import formats

HIST_KEYS = 512
PEAK_LEN = 2

# Binade of key k (k = 2..509): floor(log2|x|) = k // 2 - 127.
KEY_INF, KEY_NAN = 510, 511
_SHIFT = 22                   # float32: 1 sign + 8 exponent + 23 fraction bits; >> 22 keeps exponent + 1 fraction bit
_INF_BITS = 0x7F800000        # |x| bit patterns order like |x|: finite < inf < NaN


def _f32_bits(v: float) -> int:
    b = int(np.float32(v).view(np.int32))
    assert float(np.float32(v)) == v, f"rounding threshold {v!r} is not a float32"
    return b


def _edges() -> tuple[tuple, tuple]:
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


def _as_float32(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    if x.dtype != torch.float32:
        x = x.float()           # exact for fp16/bf16; fp64 values beyond float32 range become 0/Inf
    return x


def peak(x: torch.Tensor) -> torch.Tensor:
    """[min, max] of x in float64 (NaN if x holds a NaN): the every-step figure."""
    x = x.detach()
    if x.numel() == 0:
        return torch.zeros(PEAK_LEN, dtype=torch.float64, device=x.device)
    mn, mx = torch.aminmax(x)
    return torch.stack((mn, mx)).to(torch.float64)


# Values of CPU tensors are read on the host as soon as they are needed (no device to wait for); everything else stays
# on its device until the step's one transfer. Tests switch this off to run the accelerator path on the CPU.
HOST_READS = True


def on_host(t: torch.Tensor) -> bool:
    """Whether reading t's values now costs no device sync."""
    return HOST_READS and t.device.type == "cpu"


def full(x: torch.Tensor) -> torch.Tensor:
    """Full statistics of x as FULL_LEN float64 values (see module docstring for the layout)."""
    x = x.detach().reshape(-1)
    return _full_cpu(x) if on_host(x) else _full_device(x)


@functools.lru_cache(maxsize=None)
def _edge_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(EDGE_BITS, dtype=torch.int32, device=device)


def _edge_counts(bits: torch.Tensor) -> torch.Tensor:
    """How many |x| (float32 bit patterns) lie at or below each edge: one bucketize pass (exact, NaN-safe)."""
    idx = torch.bucketize(bits, _edge_table(bits.device), out_int32=True)    # edge[i-1] < bits <= edge[i]
    return torch.bincount(idx, minlength=len(EDGE_BITS) + 1)[:-1].cumsum(0)


def _full_device(x: torch.Tensor) -> torch.Tensor:
    """Accelerator version: a fixed sequence of device ops, no value read on the host (no sync)."""
    xf = _as_float32(x)
    bits = xf.view(torch.int32) & 0x7FFFFFFF           # |x| as float32 bits
    hist = torch.bincount(bits >> _SHIFT, minlength=HIST_KEYS)
    finite = torch.where(bits < _INF_BITS, bits, 0)
    absmax = finite.amax().view(torch.float32) if bits.numel() else xf.new_zeros(())
    # Sum and norm of x * 2^-e (absmax ~ 2^e), times 2^e: in float32 the squares of x itself overflow above
    # |x| ~ 1.8e19 and vanish below ~1e-23, and a sum overflows near 3.4e38. Scaling by a power of two is exact
    # (2^126 at most, so that 2^-e stays finite); NaN/Inf still propagate, as in torch.sum.
    e = torch.frexp(absmax)[1].clamp(min=-126)
    xs = xf * torch.ldexp(torch.ones_like(absmax), -e)
    sum_norm = torch.stack((xs.sum(), torch.linalg.vector_norm(xs))).double() * torch.exp2(e.double())
    head = torch.cat((sum_norm, _edge_counts(bits).to(torch.float64), absmax.to(torch.float64).reshape(1)))
    return torch.cat((head, hist.to(torch.float64)))


@functools.lru_cache(maxsize=None)
def _settled(dtype: torch.dtype) -> tuple:
    """For each edge, the key holding it and whether the input dtype settles it without looking at values: every
    value of that dtype inside the key lies at or below the edge (True), above it (False), or either (None). An
    FP16 tensor has no value between 65504 and 65520, so its overflow count is 0 without a pass."""
    out = []
    for b in EDGE_BITS:
        key = b >> _SHIFT
        if dtype == torch.float32 or b == 0:
            out.append((key, None if b else True))
            continue
        # the smallest non-zero and the largest value of the dtype inside the key (python floats: a torch
        # comparison with a python float would round the float to the dtype first)
        lo, hi = (float(v) for v in np.array([max(key << _SHIFT, 1), ((key + 1) << _SHIFT) - 1],
                                             dtype=np.int32).view(np.float32))
        first, last = torch.tensor([lo, hi]).to(dtype)
        if first.item() < lo:
            first = torch.nextafter(first, first.new_tensor(math.inf))
        if last.item() > hi:
            last = torch.nextafter(last, last.new_tensor(0.0))
        edge = float(np.array([b], dtype=np.int32).view(np.float32)[0])
        if first.item() > hi or last.item() < lo or last.item() <= edge:     # none in the key, or all below
            out.append((key, True))
        else:
            out.append((key, False if first.item() > edge else None))
    return tuple(out)


def _full_cpu(x: torch.Tensor) -> torch.Tensor:
    """The CPU version of ``full``: a value is on the host as soon as it is computed (no device to wait for), so
    the passes that only rare tensors need (non-finite values, huge or tiny values, zeros, values inside a key that
    holds a rounding edge) run only when the histogram or the extremes say so, and the head is assembled in numpy.
    ~4 passes instead of ~10; the histogram (``bincount``, a serial loop at ~0.7 ns per value) is most of what
    remains."""
    n = x.numel()
    if not n:
        return torch.from_numpy(np.zeros(FULL_LEN))
    x = x.contiguous()
    bits = None
    if x.dtype == torch.bfloat16:          # bf16 is float32's top half: the same key from half the bytes
        key = (x.view(torch.int16) & 0x7FFF) >> (_SHIFT - 16)
        xf = x.float()
    else:
        xf = _as_float32(x)
        bits = xf.view(torch.int32) & 0x7FFFFFFF
        key = bits >> _SHIFT                                 # |x|'s top 9 bits: 0..511
    hist = torch.bincount(key, minlength=HIST_KEYS).numpy()
    mn, mx = torch.aminmax(xf)
    absmax = max(-mn.item(), mx.item())
    if hist[KEY_INF:].any():                                 # the head's abs max is over finite values
        absmax = torch.nan_to_num(xf, 0.0, 0.0, 0.0).abs().amax().item()
    zeros = n - int(torch.count_nonzero(xf)) if hist[0] else 0       # key 0: zeros and the smallest subnormals
    below = np.concatenate(([0], np.cumsum(hist)))           # below[k]: values in keys < k
    edges = np.empty(len(EDGE_BITS))
    for i, (k, settled) in enumerate(_settled(x.dtype)):
        key_zeros = zeros if k == 0 else 0
        if EDGE_BITS[i] == 0:
            edges[i] = zeros
        elif settled or hist[k] == key_zeros:                # every value of the edge's key is at or below it
            edges[i] = below[k] + hist[k]
        elif settled is False:                               # every non-zero value of the key is above it
            edges[i] = below[k] + key_zeros
        else:                                                # values on both sides of the edge may be there
            bits = xf.view(torch.int32) & 0x7FFFFFFF if bits is None else bits
            edges[i] = int(torch.count_nonzero(bits <= EDGE_BITS[i]))
    out = np.empty(FULL_LEN)
    out[I_SUM], out[I_NORM], out[I_ABSMAX] = _sum_cpu(xf, absmax), _norm_cpu(xf, absmax), absmax
    out[I_EDGES:I_ABSMAX] = edges
    out[HEAD:] = hist
    return torch.from_numpy(out)


def _sum_cpu(xf: torch.Tensor, absmax: float) -> float:
    """Sum in float32 where it cannot overflow, else in float64 (NaN/Inf propagate as in torch.sum)."""
    if absmax * xf.numel() < 2.0 ** 127:
        return xf.sum().item()
    return xf.sum(dtype=torch.float64).item()


def _norm_cpu(xf: torch.Tensor, absmax: float) -> float:
    """L2 norm: one float32 dot product where its sum of squares can neither overflow nor lose the small values
    (absmax in [2^-40, 2^63 / sqrt(n)]), else in float64. NaN/Inf when the tensor holds one, as a norm would be."""
    if 2.0 ** -40 <= absmax and absmax * absmax * xf.numel() < 2.0 ** 126:
        return math.sqrt(torch.dot(xf, xf).item())
    return torch.linalg.vector_norm(xf, dtype=torch.float64).item()


# ---------------------------------------------------------------------------------------------------------------
# Host side: numbers out of the raw vectors (numpy, runs on the writer thread).

FIELDS = ("numel", "nan", "inf", "zeros", "absmax", "minabs", "mean", "rms",
          "fp16_over", "fp16_sub", "fp16_flush", "bf16_over", "bf16_sub", "bf16_flush")
MIN_EXP, MAX_EXP = -127, 127      # histogram bins: -127 means "non-zero and below 2^-126" (FP32 subnormal)


def _binades(hist512: np.ndarray) -> np.ndarray:
    """512 key counts (last axis) -> counts per exponent field 0..254 (binade e = field - 127; NaN/Inf left out).
    Field 0 holds the zeros and the FP32 subnormals together; ``derive`` takes the zeros out."""
    return hist512[..., 0:510:2] + hist512[..., 1:510:2]       # (a sum over an axis of 2 is 20x slower)


def merge(vectors: list[np.ndarray]) -> np.ndarray:
    """Combine full vectors of several tensors (module reuse, micro-batches) into one: sums add, maxima max."""
    return merge_rows(np.stack(vectors), np.zeros(1, dtype=np.int64))[0]


def merge_rows(mat: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``merge`` for many groups at once: rows of ``mat`` (one full vector each, grouped contiguously) combined
    per group; ``starts`` are the groups' first rows."""
    if len(starts) == len(mat):
        return mat
    out = np.add.reduceat(mat, starts, axis=0)
    out[:, I_NORM] = np.sqrt(np.add.reduceat(mat[:, I_NORM] ** 2, starts))
    out[:, I_ABSMAX] = np.maximum.reduceat(mat[:, I_ABSMAX], starts)
    return out


def derive_many(mat: np.ndarray, numel: np.ndarray) -> tuple[dict, np.ndarray]:
    """Statistics (FIELDS -> one array with a value per row) and the binade histograms (rows of counts for
    e = -127..127) of full vectors stacked as rows; numel per row."""
    numel = np.asarray(numel, dtype=np.float64)
    total, norm, absmax = mat[:, I_SUM], mat[:, I_NORM], mat[:, I_ABSMAX]
    le = {name: mat[:, I_EDGES + i] for i, name in enumerate(EDGE_NAMES)}     # |x| at or below each edge
    keys = mat[:, HEAD:]
    nan, inf = keys[:, KEY_NAN], keys[:, KEY_INF]
    bins = _binades(keys).astype(np.float64)
    zeros = le["zero"]
    bins[:, 0] -= zeros                                  # exponent field 0 is zeros + FP32 subnormals
    occupied = bins > 0
    lowest = np.where(occupied.any(axis=1), occupied.argmax(axis=1), -1)
    # Smallest non-zero magnitude, to the binade: the lower edge of the lowest occupied binade (FP32 subnormals:
    # the smallest subnormal).
    minabs = np.where(lowest < 0, 0.0, np.where(lowest == 0, 2.0 ** -149, np.exp2(lowest - 127.0)))
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


def derive(vec: np.ndarray, numel: int) -> tuple[dict, np.ndarray]:
    """Statistics dict (FIELDS) and the binade histogram (counts for e = -127..127) from one full vector."""
    with np.errstate(all="ignore"):
        stats, bins = derive_many(np.asarray(vec, dtype=np.float64)[None, :], [numel])
    return {k: float(v[0]) for k, v in stats.items()}, bins[0]
