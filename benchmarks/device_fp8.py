"""Section 6 of device_check.py: the format what-if (ampdoctor.whatif) against real casts on the device.

1. The cast boundaries, value by value: values around every edge of FP16, BF16, E4M3 and E5M2 (and a log-uniform
   spread) cast on the device; each value is lost (overflowed or saturated; flushed to zero) exactly where
   ``whatif.lost`` says. The device's casts are also compared with the CPU's bit for bit (information).
2. The shares from histograms: a short FP16 + GradScaler run on the device records every step's histograms of a layer
   with log-normal activations (exp(2.5 x): ~25 binades) and of its output gradients (stored scaled); our own hooks
   capture the same tensors. For each histogram step and format, the count a real cast of the captured tensor loses
   lies within ampdoctor's [lo, hi] (FP8 at the delayed-scaling recipe's scale, output gradients unscaled first).
(tests/test_whatif.py checks the same on the CPU, with this module's casts, values, model and comparison.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

import ampdoctor
from ampdoctor import whatif as W

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BITS = {1: torch.uint8, 2: torch.int16}


def real_loss(y: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(overflowed or saturated, flushed) masks of a real cast of float32 ``y`` to the format, on y's device. An E4M3
    cast (no Inf) either saturates to 448 or gives NaN (torch's conversions have done both): a value is lost when its
    cast is NaN, or is the max and differs from the cast at a 16x lower exponent (scaling by 16 is exact, and rounds
    the same where no range limit applies)."""
    dt = DTYPES[name]
    c = y.to(dt).float()
    flushed = (c == 0) & (y != 0)
    if name == "e4m3":
        lower = (y / 16).to(dt).float() * 16
        over = (torch.isnan(c) & ~torch.isnan(y)) | ((c.abs() == torch.finfo(dt).max) & (c != lower))
    else:
        over = torch.isinf(c) & ~torch.isinf(y)
    return over, flushed


def boundary_values(name: str) -> torch.Tensor:
    """float32 values around every boundary a cast to the format has (and a log-uniform spread)."""
    fmt = W.FORMATS[name]
    e = W.edges(fmt)
    pts = np.array([e.overflow, e.flush, fmt.max, fmt.min_subnormal, fmt.min_normal], dtype=np.float32)
    with np.errstate(over="ignore"):
        near = [pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0)), pts * 1.5, pts * 0.75]
    g = np.random.default_rng(0)
    lo, hi = np.log2(fmt.min_subnormal) - 3, min(np.log2(fmt.max) + 3, 127.9)
    spread = np.exp2(g.uniform(lo, hi, 20000)).astype(np.float32)
    v = np.concatenate(near + [spread])
    v = v[np.isfinite(v)]
    return torch.from_numpy(np.concatenate([v, -v]))


class Exp(nn.Module):
    """Log-normal activations: exp(2.5 x) spans ~25 binades, more than E4M3's ~18 (float32 on every device: its
    input is float32, and CUDA autocast computes exp in float32 anyway)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(2.5 * x)


def wide_model(
    steps: int,
) -> tuple[nn.Module, list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The wide run's model (log-normal activations into a layer whose outputs, and so gradients, are of order 1),
    ``steps`` batches, and the lists our own hooks fill with layer 0's activations and layer 1's output gradients
    (tests/test_whatif.py trains the same on the CPU)."""
    torch.manual_seed(0)
    model = nn.Sequential(Exp(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    with torch.no_grad():
        model[1].weight.mul_(1e-3)  # outputs (and so gradients) of order 1: no step overflows
    acts: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda m, a, o: acts.append(o.detach().clone()))

    def on_output(m: nn.Module, a: tuple, o: torch.Tensor) -> None:
        o.register_hook(lambda g: grads.append(g.detach().clone()))

    model[1].register_forward_hook(on_output)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)) for _ in range(steps)]
    return model, acts, grads, data


def wide_run(device: str, path: str) -> tuple[list, list]:
    """FP16 autocast + GradScaler growing its scale every 2 steps (lr 0: the tensors keep their distribution),
    histograms at every step; the activations of layer 0 and the output gradients of layer 1, captured."""
    import device_models as M

    model, acts, grads, data = wide_model(W.MIN_HELD + 8)
    M.train(
        model,
        data,
        device=device,
        precision="fp16",
        loss_fn=M.mse,
        lr=0.0,
        trace=path,
        attach={"every": 1, "hist_every": 1},
        scaler_kw={"init_scale": 1024.0, "growth_interval": 2},
    )
    return acts, grads


def compare(df: Any, tensors: list, stored: np.ndarray, name: str) -> tuple[int, int, int, list]:
    """Per histogram step, the saturated and flushed counts of real casts against ampdoctor's [lo, hi]: (compared,
    exact intervals, values really lost in all, misses)."""
    compared = exact = lost = 0
    misses = []
    for row in df.itertuples():
        x = tensors[row.step].float()
        x = x[torch.isfinite(x)]  # an Inf/NaN is not in the histogram: lost before any cast
        s = getattr(row, f"{name}_scale") if name in W.FP8 else 1.0
        y = (x / float(stored[row.step])) * s if name in W.FP8 else x
        over, flushed = real_loss(y.float(), name)
        nz = float((x != 0).sum())
        for what, real in (("sat", over), ("flush", flushed)):
            lo, hi = getattr(row, f"{name}_{what}_lo") * nz, getattr(row, f"{name}_{what}_hi") * nz
            got = float(real.sum())
            compared += 1
            exact += lo == hi
            lost += got
            if not lo - 1e-6 <= got <= hi + 1e-6:
                misses.append(f"step {row.step} {what}: {got:g} not in [{lo:g}, {hi:g}]")
    return compared, exact, int(lost), misses


def section(s: Any, sec: Any) -> None:
    """The section (``s``: device_check's Setup, ``sec`` its Section)."""
    device = s.device
    for name, dt in DTYPES.items():
        y = boundary_values(name)
        over, flushed = real_loss(y.to(device), name)
        w_over, w_flush = W.lost(y.numpy(), W.FORMATS[name])
        ok = np.array_equal(w_over, over.cpu().numpy()) and np.array_equal(w_flush, flushed.cpu().numpy())
        bits = BITS[torch.finfo(dt).bits // 8]
        on_device = y.to(device).to(dt).cpu().view(bits)
        differ = int((on_device != y.to(dt).view(bits)).sum())
        sec.check(
            f"{name}: {len(y)} values at and around its edges, lost exactly where whatif.lost says",
            ok,
            f"{int(over.sum())} overflowed/saturated, {int(flushed.sum())} flushed; "
            f"{'the same bits as' if not differ else f'{differ} values differ from'} the CPU's cast",
        )
    path = s.trace("fp8-whatif")
    acts, grads = wide_run(device, path)
    tr = ampdoctor.load(path)
    steps = tr.steps()
    ones = np.ones(len(steps))
    ls = steps["loss_scale"].to_numpy(float)
    plan = [
        ("0", "act", acts, ones, ("e4m3", "e5m2", "fp16", "bf16")),
        ("1", "grad_out", grads, ls, ("e5m2",)),
        ("1", "grad_out", grads, ones, ("fp16",)),
    ]
    for site, kind, tensors, stored, names in plan:
        df = W.site_whatif(tr, site, kind)
        for name in names:
            n, exact, lost, misses = compare(df, tensors, stored, name)
            what = f"{site} ({kind}) in {name}" + (
                " at the recorded loss scale" if kind == "grad_out" and name == "fp16" else ""
            )
            sec.check(
                f"{what}: {len(df)} histogram steps, real casts within ampdoctor's shares",
                not misses and n > 0,
                "; ".join(misses[:5]) or f"{n} counts, {exact} exact, {lost} values lost",
            )
            sec.data[f"{site}-{kind}-{name}"] = {"compared": n, "exact": exact, "lost": lost, "misses": misses}
    lost_e4m3 = sec.data["0-act-e4m3"]["lost"]
    sec.check(
        "the comparison has something to compare: E4M3 loses values of these activations",
        lost_e4m3 > 0,
        f"{lost_e4m3} values",
    )
