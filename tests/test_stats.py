"""The statistics kernels against a plain numpy re-implementation (Cockpit-style reference tests)."""
import math

import numpy as np
import pytest
import torch

from ampdoctor import formats
from ampdoctor.collect import stats as K


def reference(x: np.ndarray) -> dict:
    """Straightforward definitions, one pass per statistic, in float64."""
    x = x.astype(np.float64).ravel()
    a = np.abs(x)
    finite = np.isfinite(x)
    nz = finite & (a > 0)
    fa = a[finite]
    return {
        "numel": x.size, "nan": int(np.isnan(x).sum()), "inf": int(np.isinf(x).sum()), "zeros": int((x == 0).sum()),
        "absmax": float(fa.max()) if fa.size else 0.0,
        "minabs_binade": math.floor(math.log2(a[nz].min())) if nz.any() else None,
        "fp16_over": int((finite & (a > 65504)).sum()),
        "fp16_sub": int((nz & (a >= 2.0**-24) & (a < 2.0**-14)).sum()),
        "fp16_flush": int((nz & (a < 2.0**-24)).sum()),
        "bf16_sub": int((nz & (a < 2.0**-126)).sum()),
        "hist": np.bincount(np.floor(np.log2(a[nz & (a >= 2.0**-126)])).astype(int) + 127, minlength=255),
    }


def planted(dtype, n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 18, (n,), generator=g).float())
    x[:7] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 65504.0, 2.0**-14])
    x[7:10] = torch.tensor([2.0**-24, 3e-8, 70000.0])   # smallest FP16 subnormal, below it, above the FP16 max
    return x.to(dtype)


# _full_device is what runs on an accelerator (no host reads); its ops run on the CPU as well, so both are checked.
@pytest.mark.parametrize("kernel", [K._full_cpu, K._full_device])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_full_statistics_match_reference(dtype, kernel):
    x = planted(dtype)
    ref = reference(x.float().numpy())
    vec = kernel(x).numpy()
    st, bins = K.derive(vec, x.numel())
    for f in ("numel", "nan", "inf", "zeros", "fp16_over", "fp16_sub", "fp16_flush", "bf16_sub"):
        assert st[f] == ref[f], f
    assert st["absmax"] == ref["absmax"]
    assert math.floor(math.log2(st["minabs"])) == ref["minabs_binade"]
    assert np.array_equal(bins[1:], ref["hist"][1:])
    assert st["mean"] != st["mean"]          # the tensor holds a NaN: mean is NaN, not a silent number
    # every element is accounted for exactly once
    assert bins.sum() + st["zeros"] + st["nan"] + st["inf"] == x.numel()


def test_mean_rms_and_bf16_counts_on_finite_tensor():
    x = torch.linspace(-3, 5, 1001)
    st, _ = K.derive(K.full(x).numpy(), x.numel())
    assert st["mean"] == pytest.approx(x.double().mean().item(), rel=1e-6)
    assert st["rms"] == pytest.approx(x.double().pow(2).mean().sqrt().item(), rel=1e-6)
    assert st["bf16_over"] == 0 and st["bf16_flush"] == 0 and st["bf16_sub"] == 0


def test_fp32_subnormals_counted_for_bf16_and_flush_unknown():
    x = torch.tensor([1e-40, 1.0, 0.0])          # 1e-40 is an FP32 subnormal (< 2^-126)
    st, bins = K.derive(K.full(x).numpy(), 3)
    assert st["zeros"] == 1 and st["bf16_sub"] == 1 and st["fp16_flush"] == 1
    assert math.isnan(st["bf16_flush"])          # not resolvable from the histogram: unknown, never a guess


def test_peak_propagates_nan_and_inf():
    assert K.peak(torch.tensor([1.0, -7.0])).tolist() == [-7.0, 1.0]
    assert math.isnan(K.peak(torch.tensor([1.0, float("nan")]))[1].item())
    assert K.peak(torch.tensor([1.0, float("inf")]))[1].item() == math.inf


def test_merge_combines_calls():
    a, b = torch.randn(100), torch.randn(50) * 3
    merged = K.merge([K.full(a).numpy(), K.full(b).numpy()])
    st, _ = K.derive(merged, 150)
    both = torch.cat([a, b]).double()
    assert st["absmax"] == both.abs().max().item()
    assert st["rms"] == pytest.approx(both.pow(2).mean().sqrt().item(), rel=1e-6)
    assert st["mean"] == pytest.approx(both.mean().item(), rel=1e-5, abs=1e-7)


def test_format_table():
    assert formats.FP16.max == 65504 and formats.FP16.subnormal_exp == -24 and formats.FP16.normal_exp == -14
    assert formats.BF16.normal_exp == -126 and formats.get("torch.bfloat16") is formats.BF16
    assert formats.FP8_E4M3.max == 448 and formats.FP8_E5M2.max == 57344
    assert formats.FP16.ulp(1.0) == 2.0**-10
    assert torch.finfo(torch.float16).max == formats.FP16.max
    assert torch.finfo(torch.bfloat16).max == formats.BF16.max
    with pytest.raises(ValueError, match="Unknown numeric format"):
        formats.get("fp12")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_of_huge_values_is_finite(dtype):
    """BF16 and FP32 hold values whose squares overflow a float32 sum: the rms must still be right."""
    x = torch.full((1000,), 3e30).to(dtype)
    x[::2] *= -1
    st, _ = K.derive(K.full(x).numpy(), x.numel())
    assert st["rms"] == pytest.approx(abs(x[0].item()), rel=1e-6) and st["mean"] == 0.0
