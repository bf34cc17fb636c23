"""Tensor -> numbers: the full-statistics kernel, on the tensor's own device, no I/O and no host sync.

``full(x)`` returns FULL_LEN float64 values (layout in trace/vectors.py: sum, l2 norm, counts at the FP16/BF16
rounding edges, finite abs max, then a 512-key histogram of |x|'s top 9 float32 bits, read straight from the bit
pattern: no log2, no frexp), so that every value of a step can be concatenated and moved to the host in one
transfer (DESIGN principle 3). bf16 and fp16 tensors are widened to float32 first, which is exact; float64 tensors
are narrowed to float32 (a value within one float32 rounding of a threshold may then be counted on the other side
of it). Peaks ([min, max]) are one ``aminmax`` per tensor, taken in buffers.py.

Three implementations give the same vector: on the CPU the native one-pass kernel (kernels.py, numba: one read of
the tensor, contiguous or strided) once it is loaded, and until then, or without numba, ``_full_cpu`` (torch and
numpy passes); on an accelerator ``_full_device`` (device ops of fixed output sizes: no host read, no sync). Their
counts, histogram and abs max are identical; sum and norm agree to rounding (the native kernel sums in float64,
``_full_cpu`` in float32 where that cannot overflow).
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np
import torch

from ..trace.vectors import (
    EDGE_BITS,
    FULL_LEN,
    HEAD,
    HIST_KEYS,
    I_ABSMAX,
    I_EDGES,
    I_NORM,
    I_SUM,
    KEY_INF,
)
from ..trace.vectors import KEY_SHIFT as _SHIFT

_INF_BITS = 0x7F800000  # |x| bit patterns order like |x|: finite < inf < NaN


def _as_float32(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    if x.dtype != torch.float32:
        x = x.float()  # exact for fp16/bf16; fp64 values beyond float32 range become 0/Inf
    return x


# Values of CPU tensors are read on the host as soon as they are needed (no device to wait for); everything else stays
# on its device until the step's one transfer. Tests switch this off to run the accelerator path on the CPU.
HOST_READS = True


def on_host(t: torch.Tensor) -> bool:
    """Whether reading t's values now costs no device sync."""
    return HOST_READS and t.is_cpu  # (t.device makes a torch.device each call)


def full_host(x: torch.Tensor) -> np.ndarray | None:
    """``full(x)`` as a numpy array, for the common case of a debug step (a contiguous CPU tensor the native kernel
    reads in one call, once loaded); None otherwise (``full`` then serves)."""
    k = _kernels
    if k is None or not HOST_READS:
        return None
    try:
        if not x.is_cpu:
            return None
        kind = _KIND.get(x.dtype)
        n = x.numel()
        if kind is not None and 0 < n < PAR_MIN and x.is_contiguous() and not x.is_neg():
            out = np.empty(FULL_LEN)
            k.full(x.data_ptr(), n, kind, _CONTIGUOUS, _EDGES, _NO_ROWS, _NO_STATE, out)
            return out
    except Exception:  # a tensor the kernel cannot read through its pointer (a subclass): full() decides
        pass
    return None


def full(x: torch.Tensor) -> torch.Tensor:
    """Full statistics of x as FULL_LEN float64 values (see module docstring for the layout)."""
    out = full_host(x)  # the common case (a debug step calls this for every tensor it observes)
    if out is not None:
        return torch.from_numpy(out)
    k = _kernels
    if k is not None and HOST_READS and x.is_cpu:
        try:
            vec = _full_native(k, x)
        except Exception:  # a tensor the kernel cannot read through its pointer (a subclass): the torch passes
            vec = None
        if vec is not None:
            return vec
    x = x.detach()
    if not on_host(x):
        return _full_device(x.reshape(-1))
    if k is None:
        native()  # starts loading the kernels
    return _full_cpu(x.reshape(-1))


# -- the native kernels (kernels.py, numba) ------------------------------------------------------------------------
# Loaded on first use in a background thread: numba compiles them (7-9 s of CPU the first time on a machine, then
# cached on disk) or loads them from its cache (1.0-1.4 s of CPU, most of it importing numba), while the torch/numpy
# kernels serve. AMPDOCTOR_NATIVE=0 keeps them off. Their results are checked against _full_cpu once after loading;
# a kernel that disagrees is never used.
NATIVE = os.environ.get("AMPDOCTOR_NATIVE", "1") != "0"
_kernels: ModuleType | None = None
_load_lock = threading.Lock()
_load_thread: threading.Thread | None = None
load_info: dict[str, Any] = {}  # how the load went: seconds, error (for tests, the benchmark and the docs)

_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # kernels.F32, BF16, F16
_EDGES = np.array(EDGE_BITS, dtype=np.int32)
# A contiguous tensor of at least PAR_MIN values is split in two halves, one read on a helper thread (the kernels
# release the GIL), meant for an idle second core. On the shared 2-core machine of session 8 it did not pay at 0.5M-8M
# values (the other core was busy); an idle machine to measure the threshold on was not available.
PAR_MIN = 1 << 21
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def native(wait: bool = False) -> ModuleType | None:
    """The native kernels once loaded, else None; the first call starts loading them in a background thread
    (``wait``: block until it is done)."""
    global _load_thread
    if _kernels is not None or not NATIVE or (_load_thread is not None and not wait):
        return _kernels
    with _load_lock:
        if _load_thread is None:
            # not a daemon: a script that ends while the kernels compile waits for them (seconds, once) instead of
            # the interpreter tearing down LLVM mid-compilation ("terminate called without an active exception")
            _load_thread = threading.Thread(target=_load, name="ampdoctor-kernels", daemon=False)
            _load_thread.start()
    if wait:
        _load_thread.join()
    return _kernels


def _load() -> None:
    global _kernels
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        from . import kernels

        _self_check(kernels)
    except Exception as e:  # no numba, or it cannot compile here: the torch/numpy kernels go on serving
        load_info["error"] = f"{type(e).__name__}: {e}"
    else:
        _kernels = kernels
    load_info["seconds"] = time.perf_counter() - t0
    load_info["cpu_seconds"] = time.thread_time() - c0


def _self_check(k: ModuleType) -> None:
    """The native vector of a few values of each kind, compared with _full_cpu's (counts exactly, sums to 1e-6)."""
    x = torch.tensor([0.0, -1e-40, 3e-8, 2.0**-25, 1.5, -65519.0, 70000.0, 3.4e38, math.inf, math.nan] * 50)
    for dtype in _KIND:
        t = x.to(dtype)
        vec = _full_native(k, t)
        assert vec is not None  # (every kind it checks is one it reads)
        got, want = vec.numpy(), _full_cpu(t).numpy()
        if not np.array_equal(got[I_EDGES:], want[I_EDGES:]) or not np.allclose(
            got[:I_EDGES], want[:I_EDGES], rtol=1e-6, equal_nan=True
        ):
            raise RuntimeError(f"native kernel disagrees with the torch passes on {dtype}")


def _full_native(k: ModuleType, x: torch.Tensor) -> torch.Tensor | None:
    """The native kernel's vector of a CPU tensor (None: a dtype it does not read)."""
    kind = _KIND.get(x.dtype)
    if kind is None or x.is_neg():  # (a negative-bit view: its memory holds -x)
        if x.dtype != torch.float64:
            return None
        x, kind = x.float(), 0
    n = x.numel()
    out = np.zeros(FULL_LEN)
    if not n:
        return torch.from_numpy(out)
    if not x.is_contiguous():
        k.full(x.data_ptr(), n, kind, _strided_dims(x), _EDGES, _NO_ROWS, _NO_STATE, out)
    elif n < PAR_MIN:
        k.full(x.data_ptr(), n, kind, _CONTIGUOUS, _EDGES, _NO_ROWS, _NO_STATE, out)
    else:
        _full_split(k, x, kind, out)
    return torch.from_numpy(out)


# (read-only constants passed to the kernel: no dimensions, no partial state)
_CONTIGUOUS = np.zeros(0, dtype=np.int64)
_NO_ROWS = np.zeros((0, 2))
_NO_STATE = np.zeros((0, 0), dtype=np.int64)


def _full_split(k: ModuleType, x: torch.Tensor, kind: int, out: np.ndarray) -> None:
    """One large contiguous tensor read by two threads, half each, their partial states merged."""
    global _pool, _pool_pid
    n, addr = x.numel(), x.data_ptr()
    half = n // 2
    acc, state = np.zeros((2, 2)), np.zeros((2, k.STATE_LEN), dtype=np.int64)
    if _pool is None or _pool_pid != os.getpid():  # (a forked child has the pool object but not its thread)
        _pool, _pool_pid = ThreadPoolExecutor(1, thread_name_prefix="ampdoctor-stats"), os.getpid()
    second = addr + half * x.element_size()
    other = _pool.submit(k.full, second, n - half, kind, _CONTIGUOUS, _EDGES, acc[1:], state[1:], out)
    k.full(addr, half, kind, _CONTIGUOUS, _EDGES, acc[:1], state[:1], out)
    other.result()
    k.finish(acc, state, _EDGES, out)


def _strided_dims(x: torch.Tensor) -> np.ndarray:
    """Shape then strides, in elements, of x's dimensions of size > 1, ordered outermost first (largest stride;
    broadcast dimensions, stride 0, outside all) and merged where they are contiguous together, so that the
    innermost loop runs along the smallest stride."""
    dims = sorted(((st if st else math.inf, sz, st) for sz, st in zip(x.shape, x.stride()) if sz != 1), reverse=True)
    merged: list[list[int]] = []
    for _, sz, st in dims:
        if merged and merged[-1][1] == st * sz:  # the outer dimension steps over exactly this one: one dimension
            merged[-1] = [merged[-1][0] * sz, st]
        else:
            merged.append([sz, st])
    if not merged:
        merged = [[1, 1]]
    return np.array([m[0] for m in merged] + [m[1] for m in merged], dtype=np.int64)


def grad_norm_peak(k: ModuleType, grads: list[torch.Tensor]) -> tuple[float, float] | None:
    """(global L2 norm, largest |g|) of CPU gradients in one native read; None where one is of a dtype the kernel
    does not read (or not on the CPU). Dtype, device and layout are checked on every call, as the kernel reads
    numel values from each data pointer: a gradient whose values are not one dense block (a strided view) is
    copied first (norm and peak do not depend on the order of the values)."""
    if not all([g.is_cpu for g in grads]):
        return None
    dtypes = [g.dtype for g in grads]
    counts = [g.numel() for g in grads]
    if not all([g.is_contiguous() for g in grads]):
        grads = [g if g.is_contiguous() or _dense(g) else g.contiguous() for g in grads]  # (kept alive until read)
    addrs = np.array([g.data_ptr() for g in grads], dtype=np.int64)
    # The dtypes and counts of a run's gradients repeat every step: their arrays are made again only when they
    # change. (one tuple, read and replaced whole: another thread's run never mixes its counts with these pointers)
    plan = _LAST_PLAN[0]
    if plan is None or plan[0] != dtypes or plan[2] != counts:
        kinds = [_KIND.get(d, -1) for d in dtypes]
        if -1 in kinds:
            return None
        plan = _LAST_PLAN[0] = (dtypes, np.array(kinds, dtype=np.int64), counts, np.array(counts, dtype=np.int64))
    norm_peak: tuple[float, float] = k.norm_peak(addrs, plan[3], plan[1])
    return norm_peak


_LAST_PLAN: list[Any] = [None]  # (dtypes, the kernel's kinds of them, counts, their array) of the last call


def _dense(g: torch.Tensor) -> bool:
    """Whether g's values fill one block of memory exactly, in some order of dimensions (channels-last)."""
    size = 1
    for st, sz in sorted((st, sz) for sz, st in zip(g.shape, g.stride()) if sz != 1):
        if st != size:
            return False
        size *= sz
    return True


@functools.cache
def _edge_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(EDGE_BITS, dtype=torch.int32, device=device)


def _counts(keys: torch.Tensor, size: int) -> torch.Tensor:
    """How many of ``keys`` (int64, each in [0, size)) equal each of 0..size-1, as int64: a histogram of fixed size.
    Not ``torch.bincount``, which sizes its output from the values (on CUDA it reads the keys' min and max on the host:
    a device sync per call). Integer atomics add exactly, in any order, and torch keeps them under
    ``use_deterministic_algorithms`` for integer tensors (no sort-based fallback)."""
    out = torch.zeros(size, dtype=torch.int64, device=keys.device)
    return out.scatter_add_(0, keys, torch.ones((), dtype=torch.int64, device=keys.device).expand(keys.shape))


def _edge_counts(bits: torch.Tensor) -> torch.Tensor:
    """How many |x| (float32 bit patterns) lie at or below each edge: one bucketize pass (exact, NaN-safe)."""
    idx = torch.bucketize(bits, _edge_table(bits.device))  # edge[i-1] < bits <= edge[i]: 0..len(EDGE_BITS)
    return _counts(idx, len(EDGE_BITS) + 1)[:-1].cumsum(0)


def _full_device(x: torch.Tensor) -> torch.Tensor:
    """Accelerator version: a fixed sequence of device ops of fixed output sizes, no value read on the host (no
    sync)."""
    xf = _as_float32(x)
    bits = xf.view(torch.int32) & 0x7FFFFFFF  # |x| as float32 bits
    # keys 0..511: bits is non-negative below 2^31, so bits >> 22 (the top 9 bits) is below HIST_KEYS
    hist = _counts((bits >> _SHIFT).long(), HIST_KEYS)
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


@functools.cache
def _settled(dtype: torch.dtype) -> tuple[tuple[int, bool | None], ...]:
    """For each edge, the key holding it and whether the input dtype settles it without looking at values: every
    value of that dtype inside the key lies at or below the edge (True), above it (False), or either (None). An
    FP16 tensor has no value between 65504 and 65520, so its overflow count is 0 without a pass."""
    out: list[tuple[int, bool | None]] = []
    for b in EDGE_BITS:
        key = b >> _SHIFT
        if b == 0:
            out.append((key, True))
            continue
        # the smallest non-zero and the largest value of the dtype inside the key (python floats: a torch
        # comparison with a python float would round the float to the dtype first)
        lo, hi = (
            float(v)
            for v in np.array([max(key << _SHIFT, 1), ((key + 1) << _SHIFT) - 1], dtype=np.int32).view(np.float32)
        )
        first, last = torch.tensor([lo, hi]).to(dtype)
        if first.item() < lo:
            first = torch.nextafter(first, first.new_tensor(math.inf))
        if last.item() > hi:
            last = torch.nextafter(last, last.new_tensor(0.0))
        edge = float(np.array([b], dtype=np.int32).view(np.float32)[0])
        if first.item() > hi or last.item() < lo or last.item() <= edge:  # none in the key, or all below
            out.append((key, True))
        else:
            out.append((key, False if first.item() > edge else None))
    return tuple(out)


# The CPU kernel's temporaries (the bit patterns, the keys, a comparison mask) are kept between calls, per thread, for
# tensors up to SCRATCH_MAX values: torch's CPU allocator caches nothing, and a fresh buffer of a few hundred kB is
# mapped and faulted in page by page on every call. Larger tensors allocate as they go (their passes dominate).
SCRATCH_MAX = 1 << 22  # 4M values: at most 36 MB kept (two int32 buffers and a bool mask)
_scratch = threading.local()


def _buffers(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    if n > SCRATCH_MAX:
        return None
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None or len(bufs[0]) < n:
        size = min(max(n, 2 * len(bufs[0]) if bufs is not None else 0), SCRATCH_MAX)
        bufs = _scratch.bufs = (np.empty(size, np.int32), np.empty(size, np.int32), np.empty(size, bool))
    return bufs[0][:n], bufs[1][:n], bufs[2][:n]


def release_scratch() -> None:
    """Drop this thread's temporaries and the helper thread (Doctor.close(): nothing of ampdoctor stays in memory
    after it; the native kernels stay loaded, like any imported module)."""
    global _pool
    _scratch.bufs = None
    pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=False)


def _abs_bits(xf: torch.Tensor, out: np.ndarray | None) -> np.ndarray:
    """|x| as float32 bit patterns (int32; they order like |x|)."""
    return np.bitwise_and(xf.numpy().view(np.int32), 0x7FFFFFFF, out=out)


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
    scratch = _buffers(n)
    if x.dtype == torch.bfloat16:  # bf16 is float32's top half: the same key from half the bytes
        k16 = scratch[1].view(np.int16)[:n] if scratch else None
        k16 = np.bitwise_and(x.view(torch.int16).numpy(), 0x7FFF, out=k16)
        key = torch.from_numpy(np.right_shift(k16, _SHIFT - 16, out=k16))
        xf = x.float()
    else:  # numpy for the integer passes: ~2x torch's speed on a CPU
        xf = _as_float32(x)
        bits = _abs_bits(xf, scratch[0] if scratch else None)
        key = torch.from_numpy(np.right_shift(bits, _SHIFT, out=scratch[1] if scratch else None))  # top 9 bits
    hist = torch.bincount(key, minlength=HIST_KEYS).numpy()
    mn, mx = torch.aminmax(xf)
    absmax = max(-mn.item(), mx.item())
    if hist[KEY_INF:].any():  # the head's abs max is over finite values
        absmax = torch.nan_to_num(xf, 0.0, 0.0, 0.0).abs().amax().item()
    if hist[0] and bits is None:
        bits = _abs_bits(xf, scratch[0] if scratch else None)
    # key 0: zeros and the smallest subnormals (bits, when it holds any, was computed just above)
    zeros = n - np.count_nonzero(bits) if hist[0] and bits is not None else 0
    below = np.concatenate(([0], np.cumsum(hist)))  # below[k]: values in keys < k
    edges = np.empty(len(EDGE_BITS))
    for i, (k, settled) in enumerate(_settled(x.dtype)):
        key_zeros = zeros if k == 0 else 0
        if EDGE_BITS[i] == 0:
            edges[i] = zeros
        elif settled or hist[k] == key_zeros:  # every value of the edge's key is at or below it
            edges[i] = below[k] + hist[k]
        elif settled is False:  # every non-zero value of the key is above it
            edges[i] = below[k] + key_zeros
        else:  # values on both sides of the edge may be there
            if bits is None:  # (bf16: its key came from the top halves)
                bits = _abs_bits(xf, scratch[0] if scratch else None)
            edges[i] = np.count_nonzero(np.less_equal(bits, EDGE_BITS[i], out=scratch[2] if scratch else None))
    out = np.empty(FULL_LEN)
    out[I_SUM], out[I_NORM], out[I_ABSMAX] = _sum_cpu(xf, absmax), _norm_cpu(xf, absmax), absmax
    out[I_EDGES:I_ABSMAX] = edges
    out[HEAD:] = hist
    return torch.from_numpy(out)


def _sum_cpu(xf: torch.Tensor, absmax: float) -> float:
    """Sum in float32 where it cannot overflow, else in float64 (NaN/Inf propagate as in torch.sum)."""
    if absmax * xf.numel() < 2.0**127:
        return xf.sum().item()
    return xf.sum(dtype=torch.float64).item()


def _norm_cpu(xf: torch.Tensor, absmax: float) -> float:
    """L2 norm: one float32 dot product where its sum of squares can neither overflow nor lose the small values
    (absmax in [2^-40, 2^63 / sqrt(n)]), else in float64. NaN/Inf when the tensor holds one, as a norm would be."""
    if absmax >= 2.0**-40 and absmax * absmax * xf.numel() < 2.0**126:
        return math.sqrt(torch.dot(xf, xf).item())
    return float(torch.linalg.vector_norm(xf, dtype=torch.float64).item())
