"""Models and a training loop for the fault-injection scenarios: real CPU runs with ampdoctor attached.

FP16 models stay <= 128 wide (CPU FP16 is slow). Every run records full statistics often enough for the rules to
see evidence in a few dozen steps (the defaults are tuned for long runs).
"""

from __future__ import annotations

import math
import time

import torch
from runs import mlp, train  # noqa: F401  (mlp: the scenarios' model too)
from torch import nn

import ampdoctor

torch.set_num_threads(1)

FAST: dict = {}  # the scenarios record with the defaults (sentinel, sampled sites, calibration, flight recorder)


# -- models ------------------------------------------------------------------------------------------------------
class CNN(nn.Module):
    def __init__(self, classes=10, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.head(self.pool(x).flatten(1))


class Attention(nn.Module):
    def __init__(self, d, scaled=True):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.scaled = scaled

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.scaled:
            q = q / math.sqrt(q.shape[-1])  # before the product: q @ k^T itself can overflow
        s = q @ k.transpose(-2, -1)
        return self.o(torch.softmax(s, dim=-1) @ v)


class Block(nn.Module):
    def __init__(self, d, scaled=True, prenorm=True):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, scaled)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.prenorm = prenorm

    def forward(self, x):
        x = x + self.attn(self.ln1(x) if self.prenorm else x)
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """A tiny causal-free sequence classifier: embedding, blocks, mean pool, head."""

    def __init__(self, vocab=50, d=32, depth=2, classes=4, scaled=True, emb_scale=1.0, prenorm=True, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.emb_scale = emb_scale
        self.blocks = nn.Sequential(*[Block(d, scaled, prenorm) for _ in range(depth)])
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        x = self.emb(tokens) * self.emb_scale
        return self.head(self.blocks(x).mean(dim=1))


# -- data --------------------------------------------------------------------------------------------------------
def regression(n, batch=32, d_in=32, d_out=1, seed=1, scale=1.0, noise=0.1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, d_out, generator=g) / math.sqrt(d_in)
    for _ in range(n):
        x = torch.randn(batch, d_in, generator=g)
        yield x, (x @ w + noise * torch.randn(batch, d_out, generator=g)) * scale


def images(n, batch=16, classes=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        y = torch.randint(0, classes, (batch,), generator=g)
        x = torch.randn(batch, 1, 12, 12, generator=g) * 0.5 + y.view(-1, 1, 1, 1).float() / classes
        yield x, y


def tokens(n, batch=16, seq=12, vocab=50, classes=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        yield x, (x[:, 0] % classes)


class Slow:
    """A data source that waits ``delay`` seconds per batch, like an un-parallelised decoding pipeline."""

    def __init__(self, data, delay):
        self.data, self.delay = data, delay

    def __iter__(self):
        for b in self.data:
            time.sleep(self.delay)
            yield b


# -- the loop ----------------------------------------------------------------------------------------------------
def mse(out, y):
    return nn.functional.mse_loss(out.float(), y)


def ce(out, y):
    return nn.functional.cross_entropy(out.float(), y)


def fit(model, data, steps, trace, *, attach=True, attach_options=None, loss_fn=mse, **kw):
    """runs.train with the scenarios' dense cadence (FAST); returns (model, losses). ``attach=False``: no ampdoctor
    (the same run unobserved)."""
    model, _, _, losses = train(
        model,
        steps,
        data=data,
        trace=trace if attach else None,
        loss_fn=loss_fn,
        attach_options=dict(FAST, **(attach_options or {})),
        **kw,
    )
    return model, losses


def diagnose(trace, **kw):
    """Findings as {rule: Diagnosis} (first of each rule) plus the list."""
    found = ampdoctor.diagnose(trace, **kw)
    return {d.rule: d for d in reversed(found)}, found


def serious(found):
    return [d for d in found if d.severity in ("warning", "critical")]
