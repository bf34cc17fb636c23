"""The statistics kernels against a plain numpy re-implementation (Cockpit-style reference tests)."""

import math

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
