"""Models and a training loop for the fault-injection scenarios: real CPU runs with ampdoctor attached.

FP16 models stay <= 128 wide (CPU FP16 is slow). Every run records full statistics often enough for the rules to
see evidence in a few dozen steps (the defaults are tuned for long runs).
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
from torch import nn

import ampdoctor

torch.set_num_threads(1)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}
FAST: dict = {}   # the scenarios record with the defaults (sentinel, sampled sites, calibration, flight recorder)


# -- models ------------------------------------------------------------------------------------------------------
def mlp(width=64, depth=3, d_in=32, d_out=1, seed=0, norm=False):
    torch.manual_seed(seed)
    layers, d = [], d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width)] + ([nn.LayerNorm(width)] if norm else []) + [nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, d_out))
    return nn.Sequential(*layers)


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
            q = q / math.sqrt(q.shape[-1])     # before the product: q @ k^T itself can overflow
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


def fit(model, data, steps, trace, *, precision="fp16", scaler=None, init_scale=2.0 ** 16, growth_interval=2000,
        lr=0.01, optimizer="sgd", loss_fn=mse, loss_weight=1.0, input_dtype=None, attach_options=None,
        on_step=None, attach=True):
    """Train for ``steps`` optimizer steps with ampdoctor attached; returns (model, losses).

    ``scaler``: None = a GradScaler exactly for FP16 autocast; True/False force it on/off.
    ``on_step(step, model, doctor)``: called after each step (e.g. to log validation metrics).
    """
    opt = (torch.optim.SGD(model.parameters(), lr=lr) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=lr))
    use_scaler = precision == "fp16" if scaler is None else scaler
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval) if use_scaler else None
    dtype = DTYPES[precision]
    opts = dict(FAST, **(attach_options or {}))
    doc = ampdoctor.attach(model, optimizer=opt, scaler=sc, trace=trace, **opts) if attach else None
    losses = []
    try:
        it = iter(data)
        for step in range(steps):
            x, y = next(it)
            if input_dtype is not None and x.is_floating_point():
                x = x.to(input_dtype)
            opt.zero_grad(set_to_none=True)
            ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
            with ctx:
                out = model(x)
            loss = loss_fn(out, y) * loss_weight
            losses.append(float(loss.detach().float()))
            if sc is not None:
                sc.scale(loss).backward()
                sc.step(opt)
                sc.update()
            else:
                loss.backward()
                if doc is not None:
                    doc.log_loss(loss)
                opt.step()
            if on_step is not None:
                on_step(step, model, doc)
    finally:
        if doc is not None:
            doc.close()
    return model, losses


def diagnose(trace, **kw):
    """Findings as {rule: Diagnosis} (first of each rule) plus the list."""
    found = ampdoctor.diagnose(trace, **kw)
    return {d.rule: d for d in reversed(found)}, found


def serious(found):
    return [d for d in found if d.severity in ("warning", "critical")]
