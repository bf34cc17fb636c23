"""Models, data and the training loop of benchmarks/device_check.py, for any device.

The faults here do not depend on the CPU's autocast lists: a Linear (``addmm``, computed in the autocast dtype on every
device) whose FP16 output exceeds 65504, an initial loss scale too high, a one-off outlier batch into such a Linear.
(On CUDA, autocast computes exp, softmax, log, pow and layer_norm in FP32, so a fault that relies on an FP16 exp, as
several CPU tests do, does not happen there.)
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import ampdoctor

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from demo import backward_and_step  # (the end of a step as the demo, examples/demo.py, writes it)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}
OUTLIER_STEP = 37  # neither a calibration step (< 10) nor a sampled one (every 10th): a sentinel-only step
OUTLIER = 512.0  # the outlier batch's factor: the big Linear's usual peak (256) times this overflows FP16 twice over
BIG = "4"  # the path of Net's big Linear


class Residual(nn.Module):
    """x + inner(x): a BatchNorm on a side branch (its running statistics move; an outlier still gets through)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


def net(seed: int = 0, d_in: int = 16, width: int = 32, classes: int = 10, norm: bool = True) -> nn.Sequential:
    """A classifier with BatchNorm and Dropout; its Linear ``BIG`` is followed by a LayerNorm (so that keeping it in
    FP32 is a fix: its FP32 output is normalised before the next FP16 matmul), or with ``norm=False`` by nothing (an
    outlier batch then makes the loss and the gradients spike)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, width),
        nn.ReLU(),
        Residual(nn.BatchNorm1d(width)),
        nn.Dropout(0.1),
        nn.Linear(width, width),  # BIG
        nn.LayerNorm(width) if norm else nn.Identity(),
        nn.ReLU(),
        nn.Linear(width, classes),
    )


def scale_output_peak(model: nn.Module, path: str, peak: float, x: torch.Tensor) -> nn.Module:
    """Scale the Linear at ``path`` so that its output peaks at ``peak`` on the batch ``x`` (in FP32, eval mode)."""
    layer = model.get_submodule(path)
    seen: list[float] = []
    handle = layer.register_forward_hook(lambda m, a, o: seen.append(float(o.detach().abs().max())))
    was = model.training
    model.eval()
    with torch.no_grad():
        model(x)
        handle.remove()
        layer.weight.mul_(peak / seen[0])
        if layer.bias is not None:
            layer.bias.mul_(peak / seen[0])
    model.train(was)
    return model


def classes(
    n: int, batch: int = 32, d_in: int = 16, k: int = 10, seed: int = 1, outlier: dict | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) per step, drawn on the CPU (the same batches on every device); ``outlier``: step -> factor."""
    g = torch.Generator().manual_seed(seed)
    for step in range(n):
        x = torch.randn(batch, d_in, generator=g)
        y = torch.randint(0, k, (batch,), generator=g)
        if outlier and step in outlier:
            x = x * outlier[step]
        yield x, y


def regression(n: int, batch: int = 32, d_in: int = 32, seed: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, 1, generator=g) / math.sqrt(d_in)
    for _ in range(n):
        x = torch.randn(batch, d_in, generator=g)
        yield x, x @ w + 0.1 * torch.randn(batch, 1, generator=g)


def mlp(width: int = 64, depth: int = 3, d_in: int = 32, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    d = d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    return nn.Sequential(*layers, nn.Linear(d, 1))


def ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float(), y)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


@dataclass
class Run:
    model: nn.Module
    losses: list[float]
    scaler: torch.amp.GradScaler | None
    trace: str | None
    doctor_path: str | None = None
    extra: dict = field(default_factory=dict)


def train(
    model: nn.Module,
    data: Iterable,
    *,
    device: str,
    precision: str = "fp16",
    loss_fn: Callable = ce,
    trace: str | None = None,
    attach: dict | None = None,
    optimizer: str = "sgd",
    lr: float = 0.05,
    scaler_kw: dict | None = None,
    setup: Callable | None = None,
    on_step: Callable[[int], None] | None = None,
    item_every: int | None = None,
    forward: Callable | None = None,
) -> Run:
    """A plain loop on ``device``: autocast in ``precision`` (FP16 with a GradScaler), ampdoctor attached when ``trace``
    is given (``attach``: its options; the live rules off unless asked for). The batches are moved to the device
    before the loop and the losses are read once at the end, so the loop itself never syncs unless ``item_every``
    asks for a ``loss.item()`` every so many steps (as logging loops do). ``setup(ns)`` may replace ns["model"],
    ns["optimizer"], ns["scaler"] (how a printed fix is applied as printed); ``on_step(step)`` runs before each step
    and once after the last (step = the number of steps); ``forward(model, x, y)``, when given, returns the loss."""
    model = model.to(device)
    batches = [(x.to(device), y.to(device)) for x, y in data]
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    dtype = DTYPES[precision]
    scaler = torch.amp.GradScaler(device, **(scaler_kw or {})) if precision == "fp16" else None
    ns = {"model": model, "optimizer": opt, "scaler": scaler, "torch": torch, "ampdoctor": ampdoctor, "math": math}
    if setup is not None:
        setup(ns)
    model, opt, scaler = ns["model"], ns["optimizer"], ns["scaler"]
    options = {"live": False, **(attach or {})}  # (the checks diagnose the trace afterwards)
    doctor = ampdoctor.attach(model, optimizer=opt, scaler=scaler, trace=trace, **options) if trace else None
    losses = []
    with doctor if doctor is not None else contextlib.nullcontext():
        for step, (x, y) in enumerate(batches):
            if on_step is not None:
                on_step(step)
            with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = forward(model, x, y) if forward is not None else loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            if scaler is None and doctor is not None:
                doctor.log_loss(loss)
            backward_and_step(loss, opt, scaler)
            losses.append(loss.detach())
            if item_every and step % item_every == item_every - 1:
                loss.item()
        if on_step is not None:
            on_step(len(batches))  # (the loop's end: close() and the losses read below)
    values = torch.stack(losses).double().cpu().tolist() if losses else []
    return Run(model, values, scaler, doctor.path if doctor is not None else None)


# -- Hugging Face: a tiny GPT-2 from a config (no download) ----------------------------------------------------------
VOCAB, SEQ, BATCH = 128, 8, 4
HF_CADENCE = {"every": 2, "hist_every": 2, "weight_every": 2}  # dense cadence for short runs (as tests/hf does)


def gpt2(seed: int = 0, **over: Any) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(GPT2Config(**{**cfg, **over}))


def tokens(n: int, seed: int = 1, batch: int = BATCH, seq: int = SEQ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
        yield ids, ids.clone()


def hf_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM computes its own loss."""
    return model(input_ids=ids, labels=labels).loss
