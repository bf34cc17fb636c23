"""Tensor -> numbers. Pure device-side kernels, no I/O and no host sync.

Two kernels, both returning a 1-D float64 tensor on the tensor's own device so that every value of a step can be
concatenated and moved to the host in one transfer (DESIGN principle 3):

* ``peak(x)``  -> [min, max]: one ``aminmax`` pass (NaN and Inf propagate, so a non-finite tensor is visible).
* ``full(x)``  -> FULL_LEN values: [nonzeros, count above the FP16 max, sum, l2 norm, finite abs max] + a
  512-bin histogram.

The histogram key is the top 9 bits of |x| as float32 (8 exponent bits + the first fraction bit), read straight
from the bit pattern (no log2, no frexp). Keys 2e and 2e+1 hold the binade [2^(e-127), 2^(e-126)); key 510 holds
+Inf and key 511 NaN (every NaN that arithmetic produces is a quiet NaN, whose first fraction bit is set); keys 0 and
1 hold zeros and FP32 subnormals. Every count the trace stores (zeros, NaN, Inf, FP16/BF16 subnormal and flush,
overflow) is derived from it on the host by ``derive`` below, so the device does a fixed handful of passes whatever
the number of statistics. bf16 and fp16 tensors are widened to float32 first, which is exact.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import formats

HIST_KEYS = 512
HEAD = 5                      # nonzeros, count |x| > 65504, sum, l2 norm, finite abs max
FULL_LEN = HEAD + HIST_KEYS
PEAK_LEN = 2

# Binade of key k (k = 2..509): floor(log2|x|) = k // 2 - 127.
KEY_INF, KEY_NAN = 510, 511
_SHIFT = 22                   # float32: 1 sign + 8 exponent + 23 fraction bits; >> 22 keeps exponent + 1 fraction bit


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


def _full_device(x: torch.Tensor) -> torch.Tensor:
    """Accelerator version: a fixed sequence of device ops, no value read on the host (no sync)."""
    xf = _as_float32(x)
    a = xf.abs()
    key = a.view(torch.int32) >> _SHIFT          # sign bit cleared by abs(), so 0..511
    hist = torch.bincount(key, minlength=HIST_KEYS)
    absmax = torch.nan_to_num(a, 0.0, 0.0, 0.0).amax() if a.numel() else a.new_zeros(())
    head = torch.stack((
        torch.count_nonzero(xf).to(torch.float32),
        torch.count_nonzero(a > formats.FP16.max).to(torch.float32),   # 65504 is not a power of two: compare
        xf.sum(),
        torch.linalg.vector_norm(xf),
        absmax,
    )).to(torch.float64)
    return torch.cat((head, hist.to(torch.float64)))


def _full_cpu(x: torch.Tensor) -> torch.Tensor:
    """The CPU version of ``full``: a value is on the host as soon as it is computed (no device to wait for), so
    the passes that only rare tensors need (non-finite values, values above 65504, huge values, zeros) run only when
    the histogram or the extremes say so, and the head is assembled in numpy. ~4 passes instead of ~10; the
    histogram (``bincount``, a serial loop at ~0.7 ns per value) is most of what remains."""
    n = x.numel()
    if not n:
        return torch.from_numpy(np.zeros(FULL_LEN))
    x = x.contiguous()
    if x.dtype == torch.bfloat16:          # bf16 is float32's top half: the same key from half the bytes
        key = (x.view(torch.int16) & 0x7FFF) >> (_SHIFT - 16)
        xf = x.float()
    else:
        xf = _as_float32(x)
        key = (xf.view(torch.int32) & 0x7FFFFFFF) >> _SHIFT     # |x|'s top 9 bits: 0..511
    hist = torch.bincount(key, minlength=HIST_KEYS).numpy()
    mn, mx = torch.aminmax(xf)
    absmax = max(-mn.item(), mx.item())
    nonfinite = bool(hist[KEY_INF:].any())
    if nonfinite:                                            # the head's abs max is over finite values
        absmax = torch.nan_to_num(xf, 0.0, 0.0, 0.0).abs().amax().item()
    zeros = n - int(torch.count_nonzero(xf)) if hist[0] else 0       # key 0: zeros and the smallest subnormals
    over = int(torch.count_nonzero(xf.abs() > formats.FP16.max)) if nonfinite or absmax > formats.FP16.max else 0
    if absmax * absmax * n < 2.0 ** 126:      # the float32 sum of squares cannot overflow: one dot product
        norm = math.sqrt(torch.dot(xf, xf).item())        # NaN/Inf when the tensor holds one, as a norm would be
    else:
        norm = torch.linalg.vector_norm(xf, dtype=torch.float64).item()
    out = np.empty(FULL_LEN)
    out[:HEAD] = (n - zeros, over, xf.sum().item(), norm, absmax)
    out[HEAD:] = hist
    return torch.from_numpy(out)


# ---------------------------------------------------------------------------------------------------------------
# Host side: numbers out of the raw vectors (numpy, runs on the writer thread).

FIELDS = ("numel", "nan", "inf", "zeros", "absmax", "minabs", "mean", "rms",
          "fp16_over", "fp16_sub", "fp16_flush", "bf16_over", "bf16_sub", "bf16_flush")
MIN_EXP, MAX_EXP = -127, 127      # histogram bins: -127 means "non-zero and below 2^-126" (FP32 subnormal)


def _binades(hist512: np.ndarray) -> np.ndarray:
    """512 key counts (last axis) -> counts per exponent field 0..254 (binade e = field - 127; NaN/Inf left out).
    Field 0 holds the zeros and the FP32 subnormals together; ``derive`` takes the zeros out."""
    return hist512[..., 0:510:2] + hist512[..., 1:510:2]       # (a sum over an axis of 2 is 20x slower)


def _count_from(bins: np.ndarray, lo_exp: int, hi_exp: int) -> np.ndarray:
    """Sum of binade counts for lo_exp <= e < hi_exp (bins indexed by e + 127 on the last axis)."""
    lo = max(lo_exp, MIN_EXP) + 127
    hi = min(hi_exp, MAX_EXP + 1) + 127
    return bins[..., lo:hi].sum(axis=-1) if hi > lo else np.zeros(bins.shape[:-1])


def merge(vectors: list[np.ndarray]) -> np.ndarray:
    """Combine full vectors of several tensors (module reuse, micro-batches) into one: sums add, maxima max."""
    return merge_rows(np.stack(vectors), np.zeros(1, dtype=np.int64))[0]


def merge_rows(mat: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``merge`` for many groups at once: rows of ``mat`` (one full vector each, grouped contiguously) combined
    per group; ``starts`` are the groups' first rows."""
    if len(starts) == len(mat):
        return mat
    out = np.add.reduceat(mat, starts, axis=0)
    out[:, 3] = np.sqrt(np.add.reduceat(mat[:, 3] ** 2, starts))
    out[:, 4] = np.maximum.reduceat(mat[:, 4], starts)
    return out


def derive_many(mat: np.ndarray, numel: np.ndarray) -> tuple[dict, np.ndarray]:
    """Statistics (FIELDS -> one array with a value per row) and the binade histograms (rows of counts for
    e = -127..127) of full vectors stacked as rows; numel per row."""
    numel = np.asarray(numel, dtype=np.float64)
    nonzeros, over16, total, norm, absmax = (mat[:, i] for i in range(HEAD))
    keys = mat[:, HEAD:]
    nan, inf = keys[:, KEY_NAN], keys[:, KEY_INF]
    bins = _binades(keys).astype(np.float64)
    zeros = numel - nonzeros
    bins[:, 0] -= zeros                                  # exponent field 0 is zeros + FP32 subnormals
    occupied = bins > 0
    lowest = np.where(occupied.any(axis=1), occupied.argmax(axis=1), -1)
    # Smallest non-zero magnitude, to the binade: the lower edge of the lowest occupied binade (FP32 subnormals:
    # the smallest subnormal).
    minabs = np.where(lowest < 0, 0.0, np.where(lowest == 0, 2.0 ** -149, np.exp2(lowest - 127.0)))
    safe = np.where(numel > 0, numel, 1.0)
    fp16, bf16 = formats.FP16, formats.BF16
    stats = {
        "numel": numel,
        "nan": nan,
        "inf": inf,
        "zeros": zeros,
        "absmax": absmax,
        "minabs": minabs,
        "mean": np.where(numel > 0, total / safe, 0.0),
        "rms": np.where(numel > 0, norm / np.sqrt(safe), 0.0),
        "fp16_over": over16 - inf,                                              # finite |x| > 65504
        "fp16_sub": _count_from(bins, fp16.subnormal_exp, fp16.normal_exp),     # [2^-24, 2^-14)
        "fp16_flush": _count_from(bins, -999, fp16.subnormal_exp),             # (0, 2^-24): rounds to 0 in FP16
        # BF16 keeps FP32's exponent range: overflow only in the top binade, underflow only among FP32 subnormals.
        # Finite values above the BF16 max all lie in FP32's top binade [2^127, 2^128), which also holds values
        # below it: exact when absmax settles it or that binade holds one value, else unknown (NaN).
        "bf16_over": np.where(absmax <= bf16.max, 0.0, np.where(bins[:, -1] == 1, 1.0, np.nan)),
        "bf16_sub": bins[:, 0].copy(),                                         # non-zero |x| < 2^-126
        # Non-zero |x| < 2^-133 (would flush in BF16) lie among the FP32 subnormals, which the histogram does not
        # split; exact (0) when there are none, else unknown (NaN, stored as NULL) rather than a guess.
        "bf16_flush": np.where(bins[:, 0] == 0, 0.0, np.nan),
    }
    return stats, bins


def derive(vec: np.ndarray, numel: int) -> tuple[dict, np.ndarray]:
    """Statistics dict (FIELDS) and the binade histogram (counts for e = -127..127) from one full vector."""
    with np.errstate(all="ignore"):
        stats, bins = derive_many(np.asarray(vec, dtype=np.float64)[None, :], [numel])
    return {k: float(v[0]) for k, v in stats.items()}, bins[0]
