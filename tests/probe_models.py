"""Real models with one numerically fragile layer (catastrophic cancellation in half precision), their healthy
counterparts, and the data they train on. Shared by tests/test_probe.py and notebooks/precision_budget.ipynb."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

import ampdoctor

D_IN = 16
OFFSET = 100.0  # raw features around 100 with unit spread: x^2 ~ 1e4, where an FP16 ULP is 8
RBF_OFFSET = 30.0  # |x|^2 over 16 features ~ 1.4e4 (at 100 it would pass 65504)


class FastStandardize(nn.Module):
    """Per-sample standardisation with the one-pass variance var = E[x^2] - E[x]^2 (the fragile part: in FP16,
    E[x^2] ~ 1e4 is known to +-4, the variance it should give is ~1)."""

    def __init__(self, eps=0.1):  # a wrong (even negative) variance gives wrong features, not overflowing ones
        super().__init__()
        self.eps = eps

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - m * m
        return (x - m) / torch.sqrt(var.clamp_min(0) + self.eps)


class RBF(nn.Module):
    """Gaussian radial-basis features with the expanded distance |x|^2 + |c|^2 - 2 x.c (the fragile part: with
    features around 30, |x|^2 ~ 1.4e4 carries an ULP of 8 in FP16 while the distances are ~30)."""

    def __init__(self, d_in, centers, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.centers = nn.Parameter(RBF_OFFSET + torch.randn(centers, d_in, generator=g))
        self.log_width = nn.Parameter(torch.full((centers,), math.log(2.0 * d_in)))

    def forward(self, x):
        d2 = (x * x).sum(-1, keepdim=True) + (self.centers * self.centers).sum(-1) - 2 * x @ self.centers.t()
        return torch.exp(-d2.clamp_min(0) / self.log_width.exp())


def standardize_model(fragile=True, seed=1, width=64, dropout=0.0):
    torch.manual_seed(seed)
    return nn.Sequential(
        FastStandardize() if fragile else nn.LayerNorm(D_IN),
        nn.Linear(D_IN, width),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(width, 1),
    )


def rbf_model(seed=1, centers=32):
    torch.manual_seed(seed)
    return nn.Sequential(RBF(D_IN, centers, seed=seed), nn.Linear(centers, 32), nn.GELU(), nn.Linear(32, 1))


def tabular(n, batch=32, seed=2, offset=OFFSET):
    """Regression on features with large means and unit spread, fed in FP16 (as a half-precision pipeline does)."""
    gw = torch.Generator().manual_seed(3)
    w = torch.randn(D_IN, 1, generator=gw) / math.sqrt(D_IN)
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        z = torch.randn(batch, D_IN, generator=g)
        yield (offset + z).half(), z @ w + 0.05 * torch.randn(batch, 1, generator=g)


def mse(out, y):
    return nn.functional.mse_loss(out.float(), y)


def cnn(seed=0, classes=4):
    """A healthy convolutional classifier with BatchNorm (running statistics) and dropout."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.GELU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, classes),
    )


def images(n, batch=16, classes=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        y = torch.randint(0, classes, (batch,), generator=g)
        yield torch.randn(batch, 1, 10, 10, generator=g) * 0.5 + y.view(-1, 1, 1, 1).float() / classes, y


def ce(out, y):
    return nn.functional.cross_entropy(out.float(), y)


def train(
    model,
    data,
    steps,
    trace=None,
    *,
    precision="fp16",
    lr=0.02,
    attach_options=None,
    on_step=None,
    loss_fn=mse,
    scaler_options=None,
):
    """SGD on ``data`` for ``steps`` steps: FP16 autocast + GradScaler (or FP32 on float32 inputs), ampdoctor
    attached when ``trace`` is given. Returns the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    fp16 = precision == "fp16"
    scaler = torch.amp.GradScaler("cpu", **(scaler_options or {})) if fp16 else None
    doc = ampdoctor.attach(model, opt, scaler, trace, **(attach_options or {})) if trace else contextlib.nullcontext()
    losses = []
    with doc:
        for step, (x, y) in zip(range(steps), data):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss = loss_fn(model(x if fp16 else x.float()), y)
            losses.append(loss.item())
            if fp16:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
                if trace:
                    doc.log_loss(loss)
            if on_step is not None:
                on_step(step, model, doc)
    return losses
