"""The statistics kernels against a plain numpy re-implementation (Cockpit-style reference tests)."""

import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ampdoctor import formats
from ampdoctor.collect import stats as K
from ampdoctor.trace import vectors as V


def _cast_counts(x32: torch.Tensor, dtype) -> dict:
    """What a real cast to ``dtype`` does to each finite non-zero value: flushed to zero, rounded to a non-zero
    subnormal (below torch.finfo's smallest normal), or overflowed to inf."""
    c = x32.to(dtype).float()
    live = torch.isfinite(x32) & (x32 != 0)
    return {
        "flush": int((live & (c == 0)).sum()),
        "over": int((live & torch.isinf(c)).sum()),
        "sub": int((live & (c != 0) & (c.abs() < torch.finfo(dtype).smallest_normal)).sum()),
    }


def reference(x: torch.Tensor) -> dict:
    """Straightforward definitions in float64, and the FP16/BF16 counts from real casts (``x.half()``,
    ``x.bfloat16()``), not from ampdoctor's limits."""
    x32 = x.float().reshape(-1)
    a = x32.double().abs().numpy()
    finite = np.isfinite(a)
    nz = finite & (a > 0)
    fa = a[finite]
    out = {
        "numel": a.size,
        "nan": int(np.isnan(a).sum()),
        "inf": int(np.isinf(a).sum()),
        "zeros": int((a == 0).sum()),
        "absmax": float(fa.max()) if fa.size else 0.0,
        "minabs_binade": math.floor(math.log2(a[nz].min())) if nz.any() else None,
        "hist": np.bincount(np.floor(np.log2(a[nz & (a >= 2.0**-126)])).astype(int) + 127, minlength=255),
    }
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        out.update({f"{name}_{k}": v for k, v in _cast_counts(x32, dtype).items()})
    return out


def _midpoints(dtype) -> list[float]:
    """The rounding midpoints of ``dtype`` that decide flush / subnormal / overflow, found with torch.nextafter
    (half the smallest subnormal, between the largest subnormal and the smallest normal, and above the max)."""
    zero, one = torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype)
    tiny = torch.nextafter(zero, one).double()
    normal = torch.tensor(torch.finfo(dtype).smallest_normal, dtype=dtype)
    top_sub = torch.nextafter(normal, zero).double()
    big = torch.tensor(torch.finfo(dtype).max, dtype=dtype).double()
    below_big = torch.nextafter(big.to(dtype), zero).double()
    return [float(tiny / 2), float((top_sub + normal.double()) / 2), float(big + (big - below_big) / 2)]


def boundary_values() -> torch.Tensor:
    """Every FP16/BF16 rounding midpoint, its float32 neighbours, a few float32 steps either side, and signs."""
    vals = []
    for dtype in (torch.float16, torch.bfloat16):
        for m in _midpoints(dtype):
            t = torch.tensor(m, dtype=torch.float32)
            assert t.item() == m  # every midpoint is a float32: it can be planted exactly
            lo, hi = t.clone(), t.clone()
            vals.append(t)
            for _ in range(3):
                lo, hi = torch.nextafter(lo, torch.tensor(0.0)), torch.nextafter(hi, torch.tensor(math.inf))
                vals += [lo, hi]
            vals += [t * 1.001, t * 0.999]
    v = torch.stack(vals)
    return torch.cat([v, -v])


def planted(dtype, n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 18, (n,), generator=g).float())
    x[:7] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 65504.0, 2.0**-14])
    x[7:10] = torch.tensor([2.0**-24, 3e-8, 70000.0])  # smallest FP16 subnormal, below it, above the FP16 max
    edge = boundary_values()
    x[10 : 10 + len(edge)] = edge
    x[200:300] = torch.randn(100, generator=g) * 1e-40  # FP32 subnormals: BF16 flush and subnormal counts
    x[300:400] = (torch.rand(100, generator=g) + 1) * 2.0**-26  # around FP16's flush midpoint 2^-25
    x[400:500] = (torch.rand(100, generator=g) * 2e-3 + 65504 / 65536) * 65536.0  # 65504 .. 65635
    return x.to(dtype)


# _full_device is what runs on an accelerator (no host reads); its ops run on the CPU as well, so both are checked.
@pytest.mark.parametrize("kernel", [K._full_cpu, K._full_device])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_full_statistics_match_reference(dtype, kernel):
    x = planted(dtype)
    ref = reference(x)
    vec = kernel(x).numpy()
    st, bins = V.derive(vec, x.numel())
    for f in (
        "numel",
        "nan",
        "inf",
        "zeros",
        "fp16_over",
        "fp16_sub",
        "fp16_flush",
        "bf16_over",
        "bf16_sub",
        "bf16_flush",
    ):
        assert st[f] == ref[f], f
    assert st["absmax"] == ref["absmax"]
    # to the binade; an FP32 subnormal (binade < -126) reads as the smallest subnormal
    assert math.floor(math.log2(st["minabs"])) == (ref["minabs_binade"] if ref["minabs_binade"] >= -126 else -149)
    assert np.array_equal(bins[1:], ref["hist"][1:])
    assert st["mean"] != st["mean"]  # the tensor holds a NaN: mean is NaN, not a silent number
    # every element is accounted for exactly once
    assert bins.sum() + st["zeros"] + st["nan"] + st["inf"] == x.numel()
    if dtype == torch.float32:  # the planted boundaries make every count non-trivial
        assert min(ref[f] for f in ref if f.startswith(("fp16_", "bf16_"))) > 0


@pytest.mark.parametrize("kernel", [K._full_cpu, K._full_device])
def test_issue_example_rounds_like_half(kernel):
    """x.half() of these gives 2 zeros and 1 inf: 1.01 * 2^-25 and 3e-8 round up to 2^-24, 65510 and 65519 down
    to 65504; exactly 2^-25 is a tie that goes to the even 0, 65520 one that goes to inf."""
    x = torch.tensor([3e-8, 1.01 * 2**-25, 2**-25, 0.99 * 2**-25, 65510, 65519, 65520])
    st, _ = V.derive(kernel(x).numpy(), x.numel())
    h = x.half()
    assert (st["fp16_flush"], st["fp16_over"]) == (int((h == 0).sum()), int(torch.isinf(h).sum())) == (2, 1)


@pytest.mark.parametrize("kernel", [K._full_cpu, K._full_device])
def test_edge_counts_of_dense_random_values_near_the_midpoints(kernel):
    """Many values within a few float32 steps of each midpoint (the CPU kernel decides per key whether it must
    look at the values; the device kernel always does): both agree with the real casts."""
    g = torch.Generator().manual_seed(3)
    mids = torch.tensor([m for d in (torch.float16, torch.bfloat16) for m in _midpoints(d)])
    steps = torch.randint(-40, 41, (len(mids), 500), generator=g)
    bits = mids.view(torch.int32)[:, None] + steps
    x = bits.reshape(-1).view(torch.float32)
    ref = reference(x)
    st, _ = V.derive(kernel(x).numpy(), x.numel())
    for f in ("fp16_over", "fp16_sub", "fp16_flush", "bf16_over", "bf16_sub", "bf16_flush"):
        assert st[f] == ref[f], f


def _full_device_bincount(x: torch.Tensor) -> torch.Tensor:
    """The device kernel as it was before its histograms got a fixed size (``torch.bincount``, which syncs on CUDA):
    the reference its counts must equal bit for bit."""
    xf = x.detach().float()
    bits = xf.view(torch.int32) & 0x7FFFFFFF
    hist = torch.bincount(bits >> V.KEY_SHIFT, minlength=V.HIST_KEYS)
    finite = torch.where(bits < 0x7F800000, bits, 0)
    absmax = finite.amax().view(torch.float32) if bits.numel() else xf.new_zeros(())
    e = torch.frexp(absmax)[1].clamp(min=-126)
    xs = xf * torch.ldexp(torch.ones_like(absmax), -e)
    sum_norm = torch.stack((xs.sum(), torch.linalg.vector_norm(xs))).double() * torch.exp2(e.double())
    idx = torch.bucketize(bits, torch.tensor(V.EDGE_BITS, dtype=torch.int32), out_int32=True)
    edges = torch.bincount(idx, minlength=len(V.EDGE_BITS) + 1)[:-1].cumsum(0)
    head = torch.cat((sum_norm, edges.to(torch.float64), absmax.to(torch.float64).reshape(1)))
    return torch.cat((head, hist.to(torch.float64)))


def _every_float32_edge_pattern() -> torch.Tensor:
    """FP32 bit patterns at every place a count changes: both zeros, the smallest and largest subnormals, the
    smallest normal, the largest finite value, inf, NaNs (quiet, signalling, all-ones payload), every rounding edge
    ampdoctor counts at and its neighbours, the first and last pattern of every histogram key; with either sign."""
    pats = [0, 1, 2, 0x007FFFFF, 0x00800000, 0x00800001, 0x7F7FFFFE, 0x7F7FFFFF, 0x7F800000]
    pats += [0x7F800001, 0x7FA00000, 0x7FC00000, 0x7FFFFFFF]
    pats += [b + d for b in V.EDGE_BITS for d in (-2, -1, 0, 1, 2) if 0 <= b + d <= 0x7FFFFFFF]
    pats += [k << V.KEY_SHIFT for k in range(V.HIST_KEYS)] + [((k + 1) << V.KEY_SHIFT) - 1 for k in range(V.HIST_KEYS)]
    g = torch.Generator().manual_seed(5)
    pats += torch.randint(0, 2**31, (20000,), generator=g).tolist()  # random patterns, every key and sign
    a = np.array(pats, dtype=np.int64)
    return torch.from_numpy(np.concatenate([a, a | 0x80000000]).astype(np.uint32).view(np.int32).copy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_device_kernel_counts_equal_bincount_bit_for_bit(dtype):
    """The device kernel's fixed-size histograms (no host sync on CUDA) against torch.bincount's and numpy's: the
    same vector element for element, NaN where NaN, for every 16-bit pattern of FP16 / BF16 (subnormals, zeros, inf,
    NaNs) and for FP32 patterns at every edge and key boundary; also a 0-d, an empty and a strided tensor."""
    if dtype == torch.float32:
        x = _every_float32_edge_pattern().view(torch.float32)
    else:
        x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    cases = [x, x[::3], x.reshape(-1, 2).t(), x[7], x[:0], planted(dtype)]
    for t in cases:
        got, want = K._full_device(t.reshape(-1)).numpy(), _full_device_bincount(t.reshape(-1)).numpy()
        assert got.dtype == want.dtype and got.shape == want.shape == (V.FULL_LEN,)
        assert np.array_equal(got, want, equal_nan=True)
        bits = t.float().reshape(-1).numpy().view(np.int32) & 0x7FFFFFFF  # numpy: |x|'s float32 bit patterns
        hist = np.bincount(bits >> V.KEY_SHIFT, minlength=V.HIST_KEYS)
        assert np.array_equal(got[V.HEAD :], hist) and hist.sum() == t.numel()
        edges = [np.count_nonzero(bits <= b) for b in V.EDGE_BITS]
        assert np.array_equal(got[V.I_EDGES : V.I_EDGES + len(edges)], edges)
    if dtype == torch.float32:
        assert K._full_device(x).numpy()[V.HEAD :].min() > 0  # every key was hit


def test_mean_rms_and_bf16_counts_on_finite_tensor():
    x = torch.linspace(-3, 5, 1001)
    st, _ = V.derive(K.full(x).numpy(), x.numel())
    assert st["mean"] == pytest.approx(x.double().mean().item(), rel=1e-6)
    assert st["rms"] == pytest.approx(x.double().pow(2).mean().sqrt().item(), rel=1e-6)
    assert st["bf16_over"] == 0 and st["bf16_flush"] == 0 and st["bf16_sub"] == 0


def test_fp32_subnormals_counted_for_bf16_exactly():
    """1e-40 is an FP32 subnormal that BF16 keeps as a subnormal; 3e-41 is below half BF16's smallest subnormal."""
    x = torch.tensor([1e-40, 3e-41, 1.0, 0.0])
    b = x.bfloat16().float()
    assert b[0] != 0 and b[1] == 0
    st, _bins = V.derive(K.full(x).numpy(), 4)
    assert st["zeros"] == 1 and st["bf16_sub"] == 1 and st["bf16_flush"] == 1 and st["fp16_flush"] == 2


def test_merge_combines_calls():
    a, b = torch.randn(100), torch.randn(50) * 3
    merged = V.merge_rows(np.stack([K.full(a).numpy(), K.full(b).numpy()]), np.array([0]))
    st, _ = V.derive(merged[0], 150)
    both = torch.cat([a, b]).double()
    assert st["absmax"] == both.abs().max().item()
    assert st["rms"] == pytest.approx(both.pow(2).mean().sqrt().item(), rel=1e-6)
    assert st["mean"] == pytest.approx(both.mean().item(), rel=1e-5, abs=1e-7)


def test_format_table():
    assert formats.FP16.max == 65504 and formats.FP16.subnormal_exp == -24 and formats.FP16.normal_exp == -14
    assert formats.BF16.normal_exp == -126 and formats.get("torch.bfloat16") is formats.BF16
    assert formats.FP16.ulp(1.0) == 2.0**-10
    with pytest.raises(ValueError, match="Unknown numeric format"):
        formats.get("fp12")


FORMAT_DTYPES = [
    (formats.FP16, torch.float16),
    (formats.BF16, torch.bfloat16),
    (formats.FP8_E4M3, torch.float8_e4m3fn),
    (formats.FP8_E5M2, torch.float8_e5m2),
]


def _all_values(dtype) -> torch.Tensor:
    """Every finite non-negative value of an 8- or 16-bit dtype, sorted (float64), from all its bit patterns."""
    bits = torch.arange(2 ** torch.finfo(dtype).bits, dtype=torch.int32)
    every = (bits.to(torch.uint8) if torch.finfo(dtype).bits == 8 else bits.to(torch.int16)).view(dtype).double()
    return torch.unique(every[torch.isfinite(every) & (every >= 0)])


@pytest.mark.parametrize("fmt, dtype", FORMAT_DTYPES, ids=[f.name for f, _ in FORMAT_DTYPES])
def test_format_limits_are_torch_s(fmt, dtype):
    fi = torch.finfo(dtype)
    pos = _all_values(dtype)[1:]
    assert (fmt.max, fmt.min_normal, fmt.min_subnormal) == (fi.max, fi.smallest_normal, pos.min().item())


@pytest.mark.parametrize("fmt, dtype", FORMAT_DTYPES, ids=[f.name for f, _ in FORMAT_DTYPES])
def test_format_rounding_matches_real_casts(fmt, dtype):
    """Every rounding midpoint of the format (between each pair of neighbouring values, found by enumerating all
    bit patterns), the float32 values either side of it, and random values: flushes / subnormal / overflows
    agree with a real cast (``x.half()``, ``x.bfloat16()``, ``x.to(torch.float8_e4m3fn)``, ...)."""
    fi = torch.finfo(dtype)
    pos = _all_values(dtype)
    mids = torch.cat([(pos[1:] + pos[:-1]) / 2, (pos[-1] + (pos[-1] - pos[-2]) / 2).reshape(1)]).float()
    assert torch.equal(mids.double(), torch.cat([(pos[1:] + pos[:-1]) / 2, (pos[-1:] * 1.5 - pos[-2:-1] / 2)]))
    up, down = torch.nextafter(mids, torch.tensor(math.inf)), torch.nextafter(mids, torch.tensor(0.0))
    g = torch.Generator().manual_seed(0)
    rnd = torch.exp2(torch.rand(20000, generator=g) * 300 - 150)
    x = torch.cat([mids, up, down, rnd, pos.float() * 1.5, torch.tensor([fi.max * 4.0, 1e38])])
    c = x.to(dtype).float()
    a = x.double().abs().numpy()
    assert np.array_equal(fmt.flushes(a), ((c == 0) & (x != 0)).numpy())
    assert np.array_equal(fmt.subnormal(a), ((c != 0) & (c.abs() < fi.smallest_normal)).numpy())
    if fmt.saturates:  # torch clamps E4M3 to +-448 (no inf): a value overflows when the same cast one binade
        real = (x / 2).to(dtype).float() * 2 > fi.max  # lower (exact power-of-two scaling) rounds above max/2
    else:
        real = torch.isinf(c)
    assert np.array_equal(fmt.overflows(a), real.numpy())
    assert np.array_equal(a > fmt.finite_limit, real.numpy())
    assert fmt.flushes(a).any() and fmt.subnormal(a).any() and real.any()


@pytest.mark.parametrize("host", [True, False], ids=["cpu-kernel", "device-kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e38, 3e30, 2e19, 1.0, 1e-25, 1e-40])
def test_mean_and_rms_agree_between_the_kernels(monkeypatch, dtype, magnitude, host):
    """BF16 and FP32 hold values whose squares overflow (or vanish in) a float32 sum: the rms must still be right,
    on the accelerator kernel (run on the CPU with HOST_READS off) as on the CPU one."""
    monkeypatch.setattr(K, "HOST_READS", host)
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(1000, generator=g) + 0.5) * magnitude
    x[::2] *= -1
    x = x.to(dtype)
    st, _ = V.derive(K.full(x).numpy(), x.numel())
    d = x.double()
    assert st["rms"] == pytest.approx(d.pow(2).mean().sqrt().item(), rel=1e-5)
    assert st["mean"] == pytest.approx(d.mean().item(), rel=1e-4, abs=1e-6 * magnitude)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_kernel_skips_only_the_passes_the_dtype_settles(dtype):
    """The CPU kernel looks at the values near a rounding edge only when the input dtype can hold values on both
    sides of it inside the edge's histogram key: checked against every value of the dtype."""
    vals = _all_values(dtype)[1:].float()  # every positive finite value
    bits = vals.view(torch.int32)
    for (key, settled), edge in zip(K._settled(dtype), K.EDGE_BITS):
        inside = bits[(bits >> 22) == key]
        if edge == 0 or not len(inside) or (inside <= edge).all():
            expected = True
        else:
            expected = False if (inside > edge).all() else None
        assert settled is expected, (key, edge)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_scratch_buffers_change_nothing(dtype, monkeypatch):
    """The CPU kernel's reused temporaries: a smaller tensor after a larger one, a larger one after (the buffers
    grow), and a tensor past SCRATCH_MAX (allocated as it goes) all give what a fresh call gives."""
    x = planted(dtype)
    first = K._full_cpu(x).numpy()
    K._full_cpu(torch.randn(3 * x.numel()).to(dtype))
    assert np.array_equal(K._full_cpu(x).numpy(), first, equal_nan=True)
    monkeypatch.setattr(K, "SCRATCH_MAX", x.numel() // 2)
    assert np.array_equal(K._full_cpu(x).numpy(), first, equal_nan=True)
    ref = reference(x)
    st, _ = V.derive(first, x.numel())
    assert all(st[f] == ref[f] for f in ("zeros", "fp16_flush", "fp16_sub", "fp16_over", "bf16_flush", "bf16_sub"))


# -- the native one-pass kernel (collect/kernels.py) ---------------------------------------------------------------
def _kernels():
    """The native kernels, loaded now; a skip only where numba is not installed (a dependency: CI has it)."""
    k = K.native(wait=True)
    if k is None:
        if importlib.util.find_spec("numba") is None:
            pytest.skip("numba is not installed")
        pytest.fail(f"numba is installed but the native kernels did not load: {K.load_info}")
    return k


def native_full(x: torch.Tensor) -> torch.Tensor:
    return K._full_native(_kernels(), x)


def _float64_sums(x: torch.Tensor) -> tuple[float, float, float]:
    """Exact references: the float64 sum (math.fsum: correctly rounded), the L2 norm from the correctly rounded
    sum of squares (float32 squares are exact in float64), and sum |x| (for the error bounds)."""
    v = x.float().reshape(-1).double().numpy()
    if not np.isfinite(v).all():
        return math.nan, math.nan, math.inf
    return math.fsum(v), math.sqrt(math.fsum(v * v)), math.fsum(np.abs(v))


U64, U32 = 2.0**-53, 2.0**-24  # unit roundoffs


def assert_same_vector(native: np.ndarray, x: torch.Tensor) -> None:
    """What every caller of full() relies on, on the native vector: the counts, histogram and abs max exactly those
    of the torch passes (_full_cpu) and of real casts; sum and norm within float64 rounding of the exact values
    (recursive summation of n exact terms: |error| <= n u64 sum|terms|), hence within the torch passes' float32
    bound of their values."""
    passes = K._full_cpu(x.contiguous().reshape(-1)).numpy()
    assert np.array_equal(native[V.I_EDGES :], passes[V.I_EDGES :])
    n = x.numel()
    s, norm, s_abs = _float64_sums(x)
    if not math.isfinite(s_abs):  # NaN/Inf: they propagate as in a float64 sum
        ref = x.double().sum().item(), torch.linalg.vector_norm(x.double()).item()
        assert np.allclose(native[: V.I_EDGES], ref, equal_nan=True) and np.isnan(native[:2]).tolist() == [
            math.isnan(r) for r in ref
        ]
        return
    assert abs(native[V.I_SUM] - s) <= n * U64 * s_abs
    assert abs(native[V.I_NORM] - norm) <= n * U64 * norm
    # the torch passes sum in float32 (or float64 where that could overflow)
    assert abs(native[V.I_SUM] - passes[V.I_SUM]) <= n * (U32 + U64) * s_abs
    assert abs(native[V.I_NORM] - passes[V.I_NORM]) <= n * (U32 + U64) * norm


LAYOUTS = {
    "contiguous": lambda t: t,
    "transposed": lambda t: t.reshape(64, -1).t(),
    "sliced rows": lambda t: t.reshape(64, -1)[:, 3:-5],
    "every third": lambda t: t[::3],
    "permuted 4-d": lambda t: t.reshape(4, 8, 16, -1).permute(2, 0, 3, 1)[1:, :, ::2],
    "broadcast": lambda t: t[:64].reshape(8, 1, 8).expand(8, 5, 8),
    "0-d": lambda t: t[5],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_kernel_gives_the_same_vector(dtype, layout):
    """Planted values at every rounding edge, NaN/Inf, zeros, FP32 subnormals, read in place through the strides
    (no copy): the same vector as the torch passes and the counts of real casts."""
    x = LAYOUTS[layout](planted(dtype))
    assert not x.is_contiguous() or layout in ("contiguous", "0-d")
    vec = native_full(x).numpy()
    assert_same_vector(vec, x)
    ref = reference(x)
    st, bins = V.derive(vec, x.numel())
    for f in ("nan", "inf", "zeros", "fp16_over", "fp16_sub", "fp16_flush", "bf16_over", "bf16_sub", "bf16_flush"):
        assert st[f] == ref[f], f
    assert np.array_equal(bins[1:], ref["hist"][1:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_kernel_reads_every_16_bit_pattern_as_torch_widens_it(dtype):
    """All 65,536 bit patterns of bf16 / fp16 (subnormals, both zeros, inf, quiet and signalling NaNs): the native
    kernel widens them in integers; its histogram and counts equal those of torch's ``.float()`` of the same
    tensor, pattern by pattern (one pattern per call) and all at once."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    assert_same_vector(native_full(x).numpy(), x)
    finite = x[torch.isfinite(x)]
    assert_same_vector(native_full(finite).numpy(), finite)
    k = _kernels()
    for pattern in x[:: 2**15 // 512 + 1].tolist() + [x[i].item() for i in (31744, 31745, 32256, 64513, 0, 32768)]:
        one = torch.tensor([pattern], dtype=dtype)
        assert np.array_equal(
            K._full_native(k, one).numpy()[V.I_EDGES :], K._full_cpu(one).numpy()[V.I_EDGES :], equal_nan=True
        ), pattern


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("magnitude", [3e38, 1e30, 2e19, 1.0, 1e-25, 1e-40])
def test_native_sum_and_norm_within_float64_rounding(dtype, magnitude):
    """Magnitudes whose float32 squares overflow (above ~1.8e19) or vanish (below ~1e-23), mixed signs, 100k
    values: sum and norm within float64 rounding of the exact values (fp16 holds neither end: its casts are
    inf/0, counted as such)."""
    g = torch.Generator().manual_seed(2)
    x = (
        (torch.rand(100_000, generator=g) + 0.5)
        * magnitude
        * torch.where(torch.rand(100_000, generator=g) < 0.3, -1, 1)
    )
    assert_same_vector(native_full(x.to(dtype)).numpy(), x.to(dtype))


def test_native_non_finite_sums_propagate_like_float64():
    for vals in ([1.0, math.nan, 2.0], [1.0, math.inf], [-math.inf, 1.0], [math.inf, -math.inf], [math.nan, math.inf]):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.tensor(vals * 3000, dtype=dtype)  # more than one chunk
            assert_same_vector(native_full(x).numpy(), x)


def test_native_kernel_on_large_tensors_and_the_two_thread_split(monkeypatch):
    """A tensor past PAR_MIN is read by two threads, half each: the same vector as one thread, and as the torch
    passes; so is a tensor whose length is no multiple of the chunk, and one of a single value."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3_000_001, generator=g) * torch.exp2(torch.randint(-40, 40, (3_000_001,), generator=g).float())
    x[::1000] = 0.0
    x[7] = 70000.0
    monkeypatch.setattr(K, "PAR_MIN", 1 << 40)
    one = native_full(x).numpy()
    monkeypatch.setattr(K, "PAR_MIN", 1000)
    split = native_full(x).numpy()
    assert_same_vector(split, x)
    assert np.array_equal(one[V.I_EDGES :], split[V.I_EDGES :])
    for n in (1, 4099):
        assert_same_vector(native_full(x[:n]).numpy(), x[:n])


def test_native_kernel_reads_without_writing():
    x = planted(torch.float32).reshape(64, 64)
    before = x.clone()
    for t in (x, x.t(), x.bfloat16(), x.half()[:, ::2]):
        native_full(t)
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))


def test_full_uses_the_native_kernel_once_loaded_and_the_torch_passes_otherwise(monkeypatch):
    _kernels()
    x = planted(torch.float32)
    calls = []
    real = K._kernels.full
    monkeypatch.setattr(K._kernels, "full", lambda *a: calls.append(a) or real(*a))
    native = K.full(x).numpy()
    assert len(calls) == 1
    monkeypatch.setattr(K, "_kernels", None)
    monkeypatch.setattr(K, "NATIVE", False)  # AMPDOCTOR_NATIVE=0
    passes = K.full(x).numpy()
    assert len(calls) == 1 and K.native() is None
    assert np.array_equal(native[V.I_EDGES :], passes[V.I_EDGES :])


def test_a_native_kernel_that_disagrees_is_never_used(monkeypatch):
    """The check run once after loading: a kernel whose counts differ from the torch passes' raises (and the
    loader then keeps the torch passes)."""
    k = _kernels()

    def off_by_one(*args):
        k.full(*args)
        args[-1][V.HEAD + 300] += 1

    broken = type(k)("broken")
    broken.__dict__.update(vars(k))
    broken.full = off_by_one
    with pytest.raises(RuntimeError, match="disagrees"):
        K._self_check(broken)


_SUBPROCESS = """
import os, sys, time
import torch
from ampdoctor.collect import stats as K
x = torch.randn(10_000)
first = K.full(x).numpy()  # served by the torch passes while the kernels load
loading = K._kernels is None and K._load_thread is not None and K._load_thread.is_alive()
k = K.native(wait=True)
second = K.full(x).numpy()
import numpy as np
same = bool(np.array_equal(first[2:], second[2:]))
jitted = [k.full, k.finish, k.norm_peak]
print(loading, k is not None, same, K.load_info.get("error"), sum(f.stats.cache_hits.total() for f in jitted))
"""


def _run_fresh(env: dict) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "Fatal" not in out.stderr, out.stderr
    return out.stdout.split()


@pytest.mark.slow
def test_kernels_load_in_the_background_and_cache_on_disk(tmp_path):
    """A fresh process: the first call returns at once from the torch passes while the kernels compile in the
    background (the process may end before they are done); they are then cached on disk, and the next process
    loads them from there (no compilation)."""
    cache = {"NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    assert _run_fresh(cache) == ["True", "True", "True", "None", "0"]
    assert list((tmp_path / "numba-cache").rglob("kernels.full-*.nbi"))
    assert _run_fresh(cache)[1:] == ["True", "True", "None", "3"]


def test_kernels_compile_in_memory_where_no_cache_is_writable(monkeypatch):
    """A read-only install with no writable home: numba finds no cache location and refuses ``cache=True``; the
    kernels' decorator then compiles without a cache (here a small function, through the same decorator)."""
    _kernels()
    from numba import njit
    from numba.core import config

    from ampdoctor.collect import kernels

    monkeypatch.setattr(config, "CACHE_LOCATOR_CLASSES", "test_stats.NoCacheLocator")  # NUMBA_CACHE_LOCATOR_CLASSES
    with pytest.raises(RuntimeError, match="no locator"):
        njit("int64(int64)", cache=True)(lambda v: v)

    @kernels._jit("int64(int64)")
    def twice(v):
        return 2 * v

    assert twice(21) == 42 and twice._cache.__class__.__name__ == "NullCache"


class NoCacheLocator:
    """A numba cache locator that finds no place, as on a read-only install without a writable home."""

    @classmethod
    def from_function(cls, py_func, py_file):
        return None


# -- the sentinel's one-read gradient figures (buffers.GradFigures) ------------------------------------------------
@pytest.fixture(params=["numba", "C++"])
def reader(request, monkeypatch):
    """Each read of the figures: the numba kernel (the C++ extension kept off), and the C++ extension (compiled.py;
    make install builds it, so a build that fails here fails the test, with the build's error)."""
    from ampdoctor.collect import compiled

    if request.param == "numba":
        monkeypatch.setattr(compiled, "ENABLED", False)
        monkeypatch.setattr(compiled, "_ext", None)
    elif compiled.wait() is None:
        pytest.fail(f"the C++ extension did not load: {compiled.info}")
    return request.param


def _grad_params(dtype) -> list:
    """Gradients the sentinel meets: a weight, a bias, a transposed (dense, permuted) one, a channels-last conv
    weight, a slice with gaps (copied before reading), an empty one; float32 ones at magnitudes whose float32
    squares overflow (1e30) or vanish (1e-30)."""
    g = torch.Generator().manual_seed(6)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    grads = [
        randn(300, 70),
        randn(70, scale=1e-3),
        randn(40, 30).t(),
        randn(8, 3, 5, 5).to(memory_format=torch.channels_last),
        randn(50, 40)[:, ::3],
        randn(0),
    ]
    if dtype == torch.float32:
        grads += [randn(1000, scale=1e30), randn(1000, scale=1e-30)]
    params = []
    for i, grad in enumerate(grads):
        p = torch.nn.Parameter(torch.zeros(grad.shape, dtype=dtype))
        p.grad = grad
        params.append((f"p{i}", p))
    return params


def _float64_figures(params) -> tuple[float, float]:
    flat = torch.cat([p.grad.double().reshape(-1) for _, p in params])
    if torch.isnan(flat).any():
        return math.nan, math.nan
    return math.sqrt(math.fsum((flat * flat).tolist())), flat.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sentinel_reads_every_gradient_once_natively(dtype, reader, monkeypatch):
    """The global norm and peak in one native call over all gradients (the numba kernel's, or the C++ extension's,
    which then leaves the kernel alone), against float64 references: the norm within float64 rounding (the float32
    squares of 1e30 / 1e-30 overflow / vanish, not here), the peak exact; NaN anywhere makes both NaN, an Inf both
    Inf; the torch path they replace agrees within float32 rounding."""
    from ampdoctor.collect import compiled
    from ampdoctor.collect.buffers import GradFigures

    k = _kernels()
    calls = []
    real = k.norm_peak
    monkeypatch.setattr(k, "norm_peak", lambda *a: calls.append(a) or real(*a))
    params = _grad_params(dtype)
    assert not params[4][1].grad.is_contiguous() and not K._dense(params[4][1].grad)
    assert K._dense(params[2][1].grad) and K._dense(params[3][1].grad)
    figures = GradFigures()
    n = sum(p.numel() for _, p in params)
    norm, peak = figures(params)
    ref_norm, ref_peak = _float64_figures(params)
    kernel_calls = 1 if reader == "numba" else 0
    assert len(calls) == kernel_calls and isinstance(norm, float) and isinstance(peak, float)
    assert abs(norm - ref_norm) <= n * U64 * ref_norm and peak == ref_peak
    with monkeypatch.context() as off:
        off.setattr(K, "_kernels", None)
        off.setattr(K, "NATIVE", False)
        off.setattr(compiled, "ENABLED", False)
        off.setattr(compiled, "_ext", None)
        torch_norm, torch_peak = GradFigures()(params)
    assert torch_norm == pytest.approx(ref_norm, rel=n * U32) and torch_peak == ref_peak
    for bad, expect in ((math.inf, math.inf), (-math.inf, math.inf), (math.nan, math.nan)):
        params[0][1].grad[7, 3] = bad
        got = figures(params)
        assert all(v == expect or (math.isnan(v) and math.isnan(expect)) for v in got), (bad, got)
        assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(got, _float64_figures(params)))
        params[0][1].grad[7, 3] = 0.0
    assert len(calls) == 4 * kernel_calls


def test_sentinel_native_figures_of_sparse_and_mixed_gradients(reader):
    """A sparse embedding gradient (its stored values) next to dense ones of two dtypes: one native read (the C++
    extension leaves a sparse gradient to the numba kernel), equal to the float64 figures of the dense gradients."""
    from ampdoctor.collect.buffers import GradFigures

    _kernels()
    emb = torch.nn.Embedding(100, 16, sparse=True)
    lin = torch.nn.Linear(16, 4).to(torch.bfloat16)
    x = torch.tensor([[1, 5, 5, 7]])
    out = lin(emb(x).to(torch.bfloat16)).float().square().sum()
    out.backward()
    params = list(emb.named_parameters()) + list(lin.named_parameters())
    norm, peak = GradFigures()(params)
    dense = torch.cat([(p.grad.to_dense() if p.grad.is_sparse else p.grad).double().reshape(-1) for _, p in params])
    assert norm == pytest.approx(dense.norm().item(), rel=1e-12) and peak == dense.abs().max().item()


def test_sentinel_checks_dtype_and_device_on_every_step(reader):
    """The kernel reads numel values of the planned kind from each pointer: a gradient whose dtype changes between
    steps (model.half()) is read as what it now is, and one the kernel does not read (float64) goes to the torch
    path, never through the native read."""
    from ampdoctor.collect.buffers import GradFigures

    _kernels()
    params = _grad_params(torch.float32)[:2]
    figures = GradFigures()
    assert figures(params) == pytest.approx(_float64_figures(params), rel=1e-12)
    for _, p in params:  # what model.half() does to a parameter and its gradient
        grad = p.grad.half()
        p.grad = None
        p.data = p.data.half()
        p.grad = grad
    assert figures(params) == pytest.approx(_float64_figures(params), rel=1e-12)
    for _, p in params:
        grad = p.grad.double() * 1e200
        p.grad = None
        p.data = p.data.double()
        p.grad = grad
    assert K.grad_norm_peak(K.native(), [p.grad for _, p in params]) is None
    assert figures(params) == pytest.approx(_float64_figures(params), rel=1e-6)
