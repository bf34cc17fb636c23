"""Native one-pass kernels (numba) for CPU tensors: a tensor's full-statistics vector, and the sentinel's global
gradient norm and peak, each from one read of the values.

Why native: the statistics are a dozen reductions (a 512-key histogram, seven rounding-edge counts, sum, sum of
squares, finite abs max); as torch/numpy passes each one reads the tensor again and pays its dispatch. Here one
loop does all of them, a chunk of CHUNK values at a time: first the arithmetic reductions (SIMD), then the histogram
increments over the same chunk while it is in L1 cache (four sub-histograms, so that runs of equal keys do not wait
on each other's stores). bf16 and fp16 values are widened to float32 bit patterns chunk by chunk, in integers,
exactly as torch's ``x.float()`` does (an fp16 signalling NaN comes out quiet). Sums run in float64: a float32
value and its square are exact in float64, so neither can overflow or vanish; only the additions round.

Tensors are read through their data pointer and strides (no numpy view per call, one compiled signature per
kernel); the caller (stats.py, buffers.py) checks dtype, device and layout. Importing this module needs numba and
compiles the kernels, or loads them from numba's on-disk cache (``__pycache__`` beside this file, else the
user-wide cache directory; in memory only where neither is writable): stats.native() does it in a background
thread.
"""

# mypy: disable-error-code="call-arg,var-annotated"
# (numba's intrinsics and jitted functions are typed by numba at compile time, not by mypy)
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

F32, BF16, F16 = 0, 1, 2  # kinds of input: float32, and the two 16-bit formats read through their bits
CHUNK = 2048  # values per chunk: 8 KB of float32 bits, read again from L1 by the histogram loop
N_EDGES = 7  # rounding edges (trace/vectors.py EDGE_BITS), passed in: a change there needs no recompilation
# Layout of a partial state (int64): per edge the values of its key at or below it, the largest finite |x| as float32
# bits, 4 sub-histograms.
S_ABSMAX = N_EDGES
S_HIST = N_EDGES + 1
HIST_KEYS = 512
STATE_LEN = S_HIST + 4 * HIST_KEYS

_MASK = np.int32(0x7FFFFFFF)
_INF = np.int32(0x7F800000)


def _jit(sig: str) -> Callable[[Callable[..., Any]], Any]:
    """Compile eagerly for one signature, cached on disk where numba finds a writable place, else in memory (a
    read-only install with no writable home still gets its kernels, compiled anew in each process)."""

    def wrap(fn: Callable[..., Any]) -> Any:
        opts = {"nogil": True, "fastmath": {"reassoc"}, "error_model": "numpy"}
        try:  # ('reassoc' lets the float64 sums vectorize; NaN/Inf still propagate: no 'nnan'/'ninf')
            return njit(sig, cache=True, **opts)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return njit(sig, cache=False, **opts)(fn)

    return wrap


# -- reading memory at an address, and float32 bits as a float -------------------------------------------------------
@intrinsic
def _i32_at(typingctx: Any, addr: Any) -> tuple[Any, ...]:
    sig = types.CPointer(types.int32)(types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@intrinsic
def _u16_at(typingctx: Any, addr: Any) -> tuple[Any, ...]:
    sig = types.CPointer(types.uint16)(types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@intrinsic
def _f32(typingctx: Any, bits: Any) -> tuple[Any, ...]:
    sig = types.float32(types.int32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _bits(typingctx: Any, value: Any) -> tuple[Any, ...]:
    sig = types.int32(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@njit(inline="always")  # (inlined into the entry points: one compilation each)
def _from_bf16(h: int) -> np.int32:
    """float32 bit pattern (int32) of a bf16 value given as its 16 bits: its top half."""
    return np.int32(h) << 16


@njit(inline="always")  # (inlined into the entry points: one compilation each)
def _from_fp16(h: int | np.int32) -> np.int32:
    """float32 bit pattern (int32) of an fp16 value given as its 16 bits, as torch's ``.float()`` gives it. No
    branches (the loop vectorizes): every case computed, one selected."""
    h = np.int32(h)
    a = h & 0x7FFF
    normal = (a << 13) + np.int32(112 << 23)  # rebias the exponent (15 -> 127)
    sub = _bits(np.float32(a)) - np.int32(24 << 23)  # a * 2^-24: a as a float32 (exact), its exponent lowered by 24
    special = np.int32(0x7F800000) | ((a & 0x3FF) << 13) | ((a > 0x7C00) * np.int32(0x400000))  # inf, quiet NaN
    out = normal if a < 0x7C00 else special
    out = out if a >= 0x400 else (sub if a else np.int32(0))
    return ((h & 0x8000) << 16) | out


@njit(inline="always")  # (inlined into the entry points: one compilation each)
def _chunk(w: np.ndarray, lo: int, hi: int, edges: np.ndarray, acc: np.ndarray, state: np.ndarray) -> None:
    """Add the float32 bit patterns w[lo:hi] to a partial state: sum and sum of squares (acc), histogram, finite
    abs max and the counts inside the edges' keys (state). Three loops over the chunk, which stays in L1 cache."""
    hist = state[S_HIST:]
    hits = np.empty(N_EDGES, np.int64)  # values so far in each edge's key
    for e in range(N_EDGES):
        key = edges[e] >> 22
        hits[e] = hist[key] + hist[HIST_KEYS + key] + hist[2 * HIST_KEYS + key] + hist[3 * HIST_KEYS + key]
    i = lo
    while i + 4 <= hi:  # keys: the top 9 bits of |x|; four sub-histograms break the store-to-load chains
        hist[(w[i] & _MASK) >> 22] += 1
        hist[HIST_KEYS + ((w[i + 1] & _MASK) >> 22)] += 1
        hist[2 * HIST_KEYS + ((w[i + 2] & _MASK) >> 22)] += 1
        hist[3 * HIST_KEYS + ((w[i + 3] & _MASK) >> 22)] += 1
        i += 4
    while i < hi:
        hist[(w[i] & _MASK) >> 22] += 1
        i += 1
    s = q = 0.0
    m = np.int32(0)
    for i in range(lo, hi):  # vectorized: no stores, no branches
        u = w[i]
        b = u & _MASK  # |x| as bits: they order like |x|, finite < inf < NaN
        f = np.float64(_f32(u))
        s += f
        q += f * f
        m = max(m, b if b < _INF else np.int32(0))
    acc[0] += s
    acc[1] += q
    state[S_ABSMAX] = max(state[S_ABSMAX], m)
    # An edge's count is every value of the keys below its key (from the histogram) plus the values of its key at
    # or below it, counted here only for chunks that put values in that key: healthy tensors seldom do.
    for e in range(N_EDGES):
        key = edges[e] >> 22
        if hist[key] + hist[HIST_KEYS + key] + hist[2 * HIST_KEYS + key] + hist[3 * HIST_KEYS + key] == hits[e]:
            continue
        start = np.uint32(key << 22)
        span = np.uint32(edges[e]) - start
        c = np.int32(0)
        for i in range(lo, hi):  # (b - start) as uint32 <= span: start <= b <= edge, one comparison
            c = np.int32(c + np.int32(np.uint32(w[i] & _MASK) - start <= span))
        state[e] += c


@njit(inline="always")  # (inlined into the entry points: one compilation each)
def _run(
    addr: int,
    start: int,
    count: int,
    stride: int,
    kind: int,
    edges: np.ndarray,
    acc: np.ndarray,
    state: np.ndarray,
    scratch: np.ndarray,
) -> None:
    """count values from element ``start`` of the tensor at addr, ``stride`` elements apart."""
    for lo in range(0, count, CHUNK):
        k = min(CHUNK, count - lo)
        base = start + lo * stride
        if kind == F32 and stride == 1:  # read in place
            w = carray(_i32_at(addr + 4 * base), k)
        else:  # gathered, and widened to float32 bits, into the scratch chunk
            if kind == F32:
                src = _i32_at(addr)
                for j in range(k):
                    scratch[j] = src[base + j * stride]
            elif kind == BF16:
                h = _u16_at(addr)
                for j in range(k):
                    scratch[j] = _from_bf16(h[base + j * stride])
            else:
                h = _u16_at(addr)
                for j in range(k):
                    scratch[j] = _from_fp16(h[base + j * stride])
            w = carray(_i32_at(scratch.ctypes.data), k)
        _chunk(w, 0, k, edges, acc, state)


@njit(inline="always")  # (inlined into the entry points: one compilation each)
def _finish(acc: np.ndarray, state: np.ndarray, edges: np.ndarray, out: np.ndarray) -> None:
    s = q = 0.0
    m = 0
    for r in range(acc.shape[0]):
        s += acc[r, 0]
        q += acc[r, 1]
        m = max(m, state[r, S_ABSMAX])
    out[0] = s
    out[1] = np.sqrt(q)
    out[2 + N_EDGES] = _f32(np.int32(m))
    head = 3 + N_EDGES
    below = np.empty(HIST_KEYS + 1, np.int64)  # below[k]: values in keys < k
    below[0] = 0
    for k in range(HIST_KEYS):
        c = 0
        for r in range(state.shape[0]):
            c += (
                state[r, S_HIST + k]
                + state[r, S_HIST + HIST_KEYS + k]
                + state[r, S_HIST + 2 * HIST_KEYS + k]
                + state[r, S_HIST + 3 * HIST_KEYS + k]
            )
        out[head + k] = c
        below[k + 1] = below[k] + c
    for e in range(N_EDGES):
        c = below[edges[e] >> 22]
        for r in range(state.shape[0]):
            c += state[r, e]
        out[2 + e] = c


@_jit("void(float64[:, ::1], int64[:, ::1], int32[::1], float64[::1])")
def finish(acc: np.ndarray, state: np.ndarray, edges: np.ndarray, out: np.ndarray) -> None:
    """Merge partial states (rows) into a full-statistics vector: [sum, norm, edge counts, absmax, histogram]."""
    _finish(acc, state, edges, out)


@_jit("void(int64, int64, int64, int64[::1], int32[::1], float64[:, ::1], int64[:, ::1], float64[::1])")
def full(
    addr: int,
    count: int,
    kind: int,
    dims: np.ndarray,
    edges: np.ndarray,
    acc: np.ndarray,
    state: np.ndarray,
    out: np.ndarray,
) -> None:
    """Full statistics of the tensor at addr: ``count`` contiguous values (``dims`` empty), or a strided tensor
    (``dims``: its shape, then its strides in elements, the innermost dimension last). Written to ``out`` when
    ``acc`` has no rows; else added to the partial state acc[0], state[0] (``finish`` merges partial states)."""
    own = acc.shape[0] == 0
    if own:
        acc = np.zeros((1, 2))
        state = np.zeros((1, STATE_LEN), np.int64)
    scratch = np.empty(CHUNK, np.int32)
    d = len(dims) // 2
    inner, step = (dims[d - 1], dims[2 * d - 1]) if d else (count, 1)
    idx = np.zeros(max(d - 1, 0), np.int64)
    while True:
        off = 0
        for j in range(d - 1):
            off += idx[j] * dims[d + j]
        _run(addr, off, inner, step, kind, edges, acc[0], state[0], scratch)
        j = d - 2  # odometer over the outer dimensions
        while j >= 0:
            idx[j] += 1
            if idx[j] < dims[j]:
                break
            idx[j] = 0
            j -= 1
        if j < 0:
            break
    if own:
        _finish(acc, state, edges, out)


# -- the sentinel: global gradient norm and peak -------------------------------------------------------------------
NORM_CHUNK = 16384  # values per chunk of the sentinel's read (64 KB of float32 bits: the second loop finds it in L2)


@njit(inline="always")  # (inlined into norm_peak: one compilation)
def _sum_squares(w: np.ndarray) -> float:
    """Sum of the squares of float32 bit patterns, in float64 (each square exact). A loop of its own: next to the
    peak's it does not vectorize (measured: the one loop over both took twice the two)."""
    q = 0.0
    for i in range(len(w)):
        f = np.float64(_f32(w[i]))
        q += f * f
    return q


@njit(inline="always")  # (inlined into norm_peak: one compilation)
def _peak_bits(w: np.ndarray) -> np.int32:
    """The largest |x| bit pattern of float32 bit patterns (every cast spelled out: an int64 max does not vectorize)."""
    m = np.int32(0)
    for i in range(len(w)):
        m = np.int32(max(m, np.int32(w[i] & _MASK)))
    return m


@_jit("UniTuple(float64, 2)(int64[::1], int64[::1], int64[::1])")
def norm_peak(addrs: np.ndarray, counts: np.ndarray, kinds: np.ndarray) -> tuple[float, float]:
    """(L2 norm, largest |x|) over contiguous tensors (address, number of values, kind each), in one read from
    memory: chunk by chunk, the sum of squares in float64 and the peak as the largest |x| bit pattern, so that a NaN
    anywhere makes both NaN and an Inf (no NaN) both Inf. bf16 and fp16 values are widened to float32 bits in the
    one loop (a widened chunk stored first and read twice measured 20x slower for fp16)."""
    q = 0.0
    m = np.int32(0)
    for t in range(len(addrs)):
        n, kind, addr = counts[t], kinds[t], addrs[t]
        if kind == F32:  # chunks of NORM_CHUNK values: the peak's loop reads the chunk the squares' loop brought in
            lo = 0
            while lo < n:
                k = min(NORM_CHUNK, n - lo)
                w = carray(_i32_at(addr + 4 * lo), k)
                q += _sum_squares(w)
                m = np.int32(max(m, _peak_bits(w)))
                lo += k
        elif kind == BF16:
            h = carray(_u16_at(addr), n)
            for i in range(n):
                u = _from_bf16(h[i])
                f = np.float64(_f32(u))
                q += f * f
                m = max(m, u & _MASK)
        else:
            h = carray(_u16_at(addr), n)
            for i in range(n):
                u = _from_fp16(h[i])
                f = np.float64(_f32(u))
                q += f * f
                m = max(m, u & _MASK)
    peak = np.float64(_f32(m))  # (a NaN's bits exceed Inf's; its float is NaN)
    if peak != peak:
        return np.nan, np.nan
    return np.sqrt(q), peak
