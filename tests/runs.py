"""Small real training runs on the CPU, shared by the tests (FP16 models stay <= 128 wide: CPU FP16 is slow)."""

from __future__ import annotations

import contextlib

import torch

import ampdoctor

AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}


def mlp(width=64, depth=3, d_in=32, d_out=1, seed=0, norm=False):
    torch.manual_seed(seed)
    layers, d = [], d_in
    for _ in range(depth):
        layers += [torch.nn.Linear(d, width)] + ([torch.nn.LayerNorm(width)] if norm else []) + [torch.nn.ReLU()]
        d = width
    layers.append(torch.nn.Linear(d, d_out))
    return torch.nn.Sequential(*layers)


def every_table_trace(path: str) -> str:
    """A real FP16 + GradScaler run that leaves a row in every table of the trace at ``path``: the scale starts too
    high (skipped steps, non-finite events), full statistics and histograms every other step, a logged metric; the
    file checkpointed (no -wal beside it)."""
    import sqlite3

    model = mlp(width=16, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    with ampdoctor.attach(
        model, optimizer=opt, scaler=scaler, trace=path, every=2, hist_every=2, weight_every=2, live=False
    ) as doc:
        for i, (x, y) in enumerate(batches(6)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
            scaler.step(opt)
            scaler.update()
            doc.log_metric("val/acc", 0.5 + i / 100)
    c = sqlite3.connect(path)
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.close()
    return path


def batches(n, batch=32, d_in=32, d_out=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, d_out, generator=g)
    for _ in range(n):
        x = torch.randn(batch, d_in, generator=g)
        yield x, x @ w + 0.1 * torch.randn(batch, d_out, generator=g)


def train(
    model,
    steps=20,
    *,
    precision="fp16",
    scaler=None,
    init_scale=2.0**16,
    growth_interval=2000,
    lr=0.01,
    optimizer="sgd",
    trace=None,
    attach_options=None,
    loss_weight=1.0,
    data=None,
    accumulation=1,
    loss_fn=None,
    input_dtype=None,
    on_step=None,
):
    """Train ``model`` for ``steps`` optimizer steps; with ``trace`` set, ampdoctor is attached.

    Returns (model, optimizer, scaler, losses). ``precision``: fp16 | bf16 | fp32 (autocast dtype or none).
    ``scaler``: None = a GradScaler exactly for FP16 autocast; True/False force it on/off; or a GradScaler to use.
    ``optimizer``: "sgd", "adam", or an optimizer over ``model``'s parameters (e.g. made by a printed fix).
    ``input_dtype``: floating inputs cast to it. ``on_step(step, model, doctor)``: called after each step (e.g. to
    log validation metrics).
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    else:
        opt = (
            torch.optim.SGD(model.parameters(), lr=lr)
            if optimizer == "sgd"
            else torch.optim.Adam(model.parameters(), lr=lr)
        )
    if isinstance(scaler, torch.amp.GradScaler):
        sc = scaler
    else:
        use_scaler = precision == "fp16" if scaler is None else scaler
        sc = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval) if use_scaler else None
    dtype = AUTOCAST[precision]
    data = data if data is not None else batches(steps * accumulation)
    loss_fn = loss_fn or (lambda out, y: torch.nn.functional.mse_loss(out.float(), y))
    doc = (
        ampdoctor.attach(model, optimizer=opt, scaler=sc, trace=trace, **(attach_options or {}))
        if trace is not None
        else None
    )
    losses = []
    with doc if doc is not None else contextlib.nullcontext():
        it = iter(data)
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            for _ in range(accumulation):
                x, y = next(it)
                if input_dtype is not None and x.is_floating_point():
                    x = x.to(input_dtype)
                ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
                with ctx:
                    out = model(x)
                loss = loss_fn(out, y) * loss_weight / accumulation
                losses.append(loss.item())
                if sc is not None:
                    sc.scale(loss).backward()
                else:
                    loss.backward()
                    if doc is not None:
                        doc.log_loss(loss)
            if sc is not None:
                sc.step(opt)
                sc.update()
            else:
                opt.step()
            if on_step is not None:
                on_step(step, model, doc)
    return model, opt, sc, losses


def live_tensors(before=()) -> list:
    """The tensors alive now (after a collection), less those in ``before`` (tensors, held by the caller so that
    their ids cannot be reused by new ones meanwhile)."""
    import gc
    import warnings
    import weakref

    gc.collect()
    old = {id(t) for t in before}
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore")
        # (a dead weak proxy some library left in gc's lists raises on isinstance: a proxy is not a tensor)
        objs = [o for o in gc.get_objects() if not isinstance(o, weakref.ProxyTypes)]
        return [o for o in objs if isinstance(o, torch.Tensor) and id(o) not in old]


# the steps table's wall clocks, which differ between any two runs
WALL_CLOCKS = ["time", "data_time", "step_time", "observer_time", "samples_per_s"]


def comparable(path):
    """(steps, events) of a trace as two runs of the same training write them alike: the steps table without its
    wall clocks, and each event's step, kind, path, phase and message (two ways of recording one run compare
    equal)."""
    t = ampdoctor.load(path)
    return t.steps().drop(columns=WALL_CLOCKS), t.events()[["step", "kind", "path", "phase", "message"]]
