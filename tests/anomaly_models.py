"""Models and loops for the anomaly-replay tests: faults made inside a module's own forward (not by a child), hit by
one outlier batch at a step that observes no site (neither a calibration step nor a sampled one)."""

from __future__ import annotations

import torch

import ampdoctor

OUTLIER_STEP = 37  # not a calibration step (< 10), not a sampled one (every 10th): the sentinel only


class ExpHead(torch.nn.Module):
    """A classifier head whose softmax is written by hand: exp(z) overflows FP16 above z = 11.09."""

    def __init__(self, d: int = 32, classes: int = 10):
        super().__init__()
        self.lin = torch.nn.Linear(d, classes)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        z = self.lin(x)
        e = torch.exp(z)
        return self.drop(e / e.sum(-1, keepdim=True))


class Gated(torch.nn.Module):
    """A gated product made in the module's own forward; its Dropout (1/(1-p) = 1.25) tips values near 65504 over."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.up = torch.nn.Linear(d, d)
        self.gate = torch.nn.Linear(d, d)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(self.up(x) * self.gate(x))


class Residual(torch.nn.Module):
    """x + inner(x): a BatchNorm on a side branch (its running statistics move; an outlier still gets through)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


def classifier(seed: int = 0, head: str = "exp", norm: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(16, 32), torch.nn.ReLU()] + ([Residual(torch.nn.BatchNorm1d(32))] if norm else [])
    if head == "exp":
        layers.append(ExpHead())
    else:
        layers += [Gated(), torch.nn.Linear(32, 10), torch.nn.LogSoftmax(-1)]
    return torch.nn.Sequential(*layers)


def batches(steps: int, outlier: dict | None = None, seed: int = 1):
    """(x, y) per step; ``outlier``: step -> factor its inputs are multiplied by."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(32, 16, generator=g)
        y = torch.randint(0, 10, (32,), generator=g)
        if outlier and step in outlier:
            x = x * outlier[step]
        yield x, y


def loss_of(model, out, y):
    if isinstance(model[-1], torch.nn.LogSoftmax):
        return torch.nn.functional.nll_loss(out.float(), y)
    # the probabilities against one-hot targets (bounded gradients: the loss scale has no reason to fall)
    return torch.nn.functional.mse_loss(out.float(), torch.nn.functional.one_hot(y, out.shape[-1]).float())


def train(
    model,
    steps: int,
    *,
    outlier=None,
    precision: str = "fp16",
    trace: str | None = None,
    lr: float = 0.05,
    optimizer: str = "sgd",
    clip: float | None = None,
    before=None,
    lr_spike: dict | None = None,
    guard=None,
    **options,
):
    """FP16 + GradScaler (or bf16 / fp32 autocast-free); returns (model, losses, scaler). ``lr_spike``: step ->
    factor the learning rate is multiplied by for that step only (a scheduler's bug); ``guard(x)``: a batch it
    refuses is skipped (the loop's own data check)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}[precision]
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    if before is not None:
        before(model)
    doctor = ampdoctor.attach(model, optimizer=opt, scaler=scaler, trace=trace, **options) if trace else None
    losses = []
    base_lr = lr
    try:
        for step, (x, y) in enumerate(batches(steps, outlier)):
            if guard is not None and not guard(x):
                continue
            for group in opt.param_groups:
                group["lr"] = base_lr * (lr_spike or {}).get(step, 1.0)
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = loss_of(model, model(x), y)
            if doctor is not None and precision != "fp16":
                doctor.log_loss(loss)  # (with a GradScaler, scaler.scale(loss) reads it)
            opt.zero_grad()
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss.detach()))
    finally:
        if doctor is not None:
            doctor.close()
    return model, losses, scaler
