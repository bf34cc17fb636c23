"""One real CPU training run per rule (small models, a few dozen steps), for the test that follows every rule's
finding from the overview to the view that proves it. Each entry: (directory, file, reference file or None, the
rules its diagnosis must hold). The makers are the fault scenarios' own (tests/scenarios) where they exist."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scenarios"))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "reported"))

import fault_runs as F  # noqa: E402
import probe_models as P  # noqa: E402
from runs import batches, mlp, train  # noqa: E402


def _overflow(p):
    """A layer whose FP16 output overflows on every forward pass, after a LayerNorm kept in FP16."""
    torch.manual_seed(0)
    big = torch.nn.Linear(32, 32)
    with torch.no_grad():
        big.weight.mul_(3e5)
    model = torch.nn.Sequential(
        collections.OrderedDict(
            [
                ("inp", torch.nn.Linear(32, 32)),
                ("norm", torch.nn.LayerNorm(32).half()),
                ("big", big),
                ("act", torch.nn.ReLU()),
                ("out", torch.nn.Linear(32, 1)),
            ]
        )
    )
    train(model, 6, precision="fp16", scaler=False, trace=p)


def _nan_batches(p):
    def data():
        for i, (x, y) in enumerate(F.regression(40)):
            if i >= 5:
                x = x.clone()
                x[0, 0] = float("nan")
            yield x, y

    F.fit(F.mlp(), data(), 40, p)


def _half_sgd(p):
    F.fit(
        F.mlp(width=64).half(),
        F.regression(30, scale=10),
        30,
        p,
        precision="fp32",
        scaler=False,
        input_dtype=torch.float16,
        lr=0.001,
    )


def _conv(p):
    m = F.CNN()
    with torch.no_grad():
        m.conv2.weight.mul_(3e3)
    F.fit(m, F.images(30), 30, p, precision="fp32", loss_fn=F.ce, optimizer="adam", lr=1e-3)


def _probe(p):
    P.train(
        P.standardize_model(),
        P.tabular(20),
        20,
        p,
        attach_options={"probe_every": 5, "every": 5, "hist_every": 5, "live": False},
    )


class Exp(torch.nn.Module):
    """Log-normal activations: exp(2.5 x) spans ~25 binades, more than FP8 E4M3's ~18."""

    def forward(self, x):
        return torch.exp(2.5 * x)


def _fp8(p):
    """tests/test_whatif.py's wide run: a layer whose values span more binades than E4M3 holds."""
    from ampdoctor import whatif

    torch.manual_seed(0)
    model = torch.nn.Sequential(Exp(), torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    with torch.no_grad():
        model[1].weight.mul_(1e-3)
    g = torch.Generator().manual_seed(1)
    n = whatif.MIN_HELD + 8
    data = [(torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)) for _ in range(n)]
    P.train(
        model,
        iter(data),
        n,
        p,
        lr=0.0,
        attach_options={"every": 1, "hist_every": 1, "live": False},
        scaler_options={"init_scale": 1024.0, "growth_interval": 2},
    )


def _late(p, precision="fp16", **kw):
    F.fit(
        F.mlp(width=64),
        F.regression(300, noise=0.0),
        300,
        p,
        precision=precision,
        optimizer="adam",
        lr=3e-3,
        loss_weight=3e-6,
        **kw,
    )


def _rank(path, rank, world, *, init_scale=2.0**10, slow=False, nan=False):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "TORCHELASTIC_RUN_ID": "job"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        model = mlp(width=32, depth=2, seed=0)
        if slow:
            model[1] = Slow()

        def data():
            for i, (x, y) in enumerate(batches(8, seed=1 + rank)):
                if nan and i >= 2:
                    x = x.clone()
                    x[0, 0] = float("nan")
                yield x, y

        train(
            model, 8, precision="fp16", init_scale=init_scale, trace=path, attach_options={"live": False}, data=data()
        )
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _validation():
    """tests/scenarios/test_scen_validation.py: BatchNorm running statistics in FP16 make validation oscillate."""
    import test_scen_validation

    return test_scen_validation


def _val_reference(p):
    v = _validation()
    F.fit(v.model(), v.tabular(v.STEPS), v.STEPS, p, precision="fp32", lr=0.05, on_step=v.validate(None))


def _outlier(p):
    """tests/test_anomaly_rules.py's run: one batch 16x the usual peak overflows an exp in FP16."""
    from anomaly_models import OUTLIER_STEP, classifier
    from anomaly_models import train as train_anomaly

    train_anomaly(classifier(), 50, outlier={OUTLIER_STEP: 16.0}, trace=p, live=False)


def _spike(p):
    """tests/test_anomaly_rules.py's run: a batch whose targets are 1000x off at step 43 (a finite loss spike)."""
    import test_anomaly_rules

    test_anomaly_rules._regression(p, 43)


def _healed(p):
    """tests/test_anomaly.py's run: an outlier every 7 steps, heal=True keeps the exp head in FP32."""
    from anomaly_models import classifier
    from anomaly_models import train as train_anomaly

    train_anomaly(classifier(), 80, outlier={s: 28.0 for s in range(15, 80, 7)}, trace=p, heal=True, live=False)


def _division(p):
    """tests/reported/test_normalisation_eps.py: F.normalize's eps rounded to 0 in FP16, padding rows 0/0."""
    import test_normalisation_eps as m
    from script import Script, run

    run(Script(m.SETUP), m.Encoder(m.L2Norm()), m.tokens(m.STEPS), m.STEPS, p, loss_fn=m.ce)


def _loss_overflow(p):
    """tests/reported/test_loss_overflow.py: a Dice loss summed in FP16 overflows from finite outputs."""
    import models
    import test_loss_overflow as m
    from script import Script, run

    run(Script(m.SETUP), models.PixelSegmenter(), models.masks(m.STEPS), m.STEPS, p, loss_fn=m.dice)


def _clip(p):
    """tests/reported/test_clip_before_unscale.py: clip_grad_norm_ on the scaled gradients (no unscale_)."""
    import models
    import test_clip_before_unscale as m
    from script import run

    loss = lambda o, y: torch.nn.functional.cross_entropy(o.float(), y)  # noqa: E731
    run(m.script(10, m.BAD), models.mlp(), models.classes(m.STEPS), m.STEPS, p, loss_fn=loss)


_BACKGROUND: dict = {}  # directory -> the torchrun process writing it


def _launch_fsdp(out: str) -> subprocess.Popen:
    """tests/distributed/fsdp_train.py under torchrun, 2 ranks (gloo): FSDP2 reducing in BF16 (phase bf16) and
    computing in FP16 without a ShardedGradScaler (phase fp16); {phase}-{rank}.db in ``out``."""
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    script = os.path.join(HERE, "..", "distributed", "fsdp_train.py")
    args = ["--out", out, "--steps", "6", "--phases", "bf16", "fp16"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([*cmd, script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def start_background(root: str) -> None:
    """Start the slow runs (torchrun's) at once, so that they train while the other tests run."""
    d = os.path.join(root, "fsdp")
    if d not in _BACKGROUND and not os.path.exists(os.path.join(d, "fp16-1.db")):
        _BACKGROUND[d] = _launch_fsdp(d)


def _settle(directory: str) -> None:
    proc = _BACKGROUND.pop(directory, None)
    if proc is not None:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]


def _fsdp(p):
    d = os.path.dirname(p)
    _BACKGROUND.setdefault(d, _launch_fsdp(d))
    _settle(d)


class Slow(torch.nn.Module):
    def forward(self, x):
        time.sleep(0.1)
        return torch.relu(x)


# (directory, file, maker, reference (file, maker) or None, rules)
RUNS = [
    (
        "single",
        "init.db",
        lambda p: F.fit(F.mlp(), F.regression(40), 40, p, init_scale=2.0**30),
        None,
        ["init-scale-too-high"],
    ),
    (
        "single",
        "under.db",
        lambda p: F.fit(F.mlp(width=64), F.regression(40), 40, p, precision="fp16", scaler=False, loss_weight=1e-4),
        None,
        ["grad-underflow"],
    ),
    ("single", "overflow.db", _overflow, None, ["forward-overflow", "precision-policy", "weights-nonfinite"]),
    ("single", "collapse.db", _nan_batches, None, ["loss-scale-collapse"]),
    ("single", "halfsgd.db", _half_sgd, None, ["weight-update-lost"]),
    ("single", "conv.db", _conv, None, ["grad-range-anomaly", "fp16-readiness"]),
    ("single", "fp8.db", _fp8, None, ["fp8-readiness"]),
    (
        "single",
        "inactive.db",
        lambda p: F.fit(F.mlp(width=64), F.regression(30), 30, p, precision="fp32", scaler=True),
        None,
        ["amp-inactive"],
    ),
    (
        "single",
        "slowdata.db",
        lambda p: F.fit(F.mlp(width=64), F.Slow(F.regression(20), 0.02), 20, p, precision="bf16"),
        None,
        ["input-pipeline-bound"],
    ),
    ("single", "diverge.db", lambda p: F.fit(F.mlp(), F.regression(20), 20, p, lr=2.0), None, ["divergence"]),
    ("single", "probe.db", _probe, None, ["precision-loss"]),
    (
        "late",
        "late.db",
        lambda p: _late(p, init_scale=1.0),
        ("late_fp32.db", lambda p: _late(p, "fp32")),
        ["late-degradation"],
    ),
    (
        "slow",
        "slow.db",
        lambda p: F.fit(F.mlp(width=64), F.regression(80), 80, p, precision="fp16", optimizer="adam", lr=1e-3),
        (
            "slow_fp32.db",
            lambda p: F.fit(F.mlp(width=64), F.regression(80), 80, p, precision="fp32", optimizer="adam", lr=1e-2),
        ),
        ["slow-convergence"],
    ),
    (
        "val",
        "val.db",
        lambda p: _validation().batchnorm_in_fp16(p),
        ("val_fp32.db", lambda p: _val_reference(p)),
        ["val-oscillation"],
    ),
    ("anomaly", "outlier.db", _outlier, None, ["outlier-batch"]),
    ("anomaly", "spike.db", _spike, None, ["loss-spike"]),
    ("anomaly", "healed.db", _healed, None, ["healed"]),
    ("reported", "division.db", _division, None, ["division-by-zero"]),
    ("reported", "dice.db", _loss_overflow, None, ["loss-nonfinite"]),
    ("reported", "clipped.db", _clip, None, ["clip-before-unscale"]),
    ("fsdp", "bf16-1.db", _fsdp, None, ["fsdp-reduce-dtype"]),
    ("fsdp", "fp16-1.db", _fsdp, None, ["fsdp-fp16-scaler"]),
    (
        "ranks-nan",
        "r-1.db",
        lambda p: [_rank(p.replace("r-1", "r-{rank}"), r, 2, nan=r == 1) for r in (0, 1)],
        None,
        ["rank-nonfinite"],
    ),
    (
        "ranks-scale",
        "m-1.db",
        lambda p: [
            _rank(p.replace("m-1", "m-{rank}"), r, 3, init_scale=2.0**12 if r == 1 else 2.0**10) for r in (0, 1, 2)
        ],
        None,
        ["rank-scale-divergence"],
    ),
    (
        "ranks-slow",
        "s-1.db",
        lambda p: [_rank(p.replace("s-1", "s-{rank}"), r, 2, slow=r == 1) for r in (0, 1)],
        None,
        ["rank-straggler"],
    ),
]


def build(root: str, only=None) -> dict:
    """Train every run under ``root``: {rule: (directory, file, reference path or None)}."""
    out = {}
    for directory, name, make, ref, rules in RUNS:
        if only is not None and not set(rules) & set(only):
            continue
        d = os.path.join(root, directory)
        os.makedirs(d, exist_ok=True)
        ref_path = None
        if ref is not None:
            os.makedirs(os.path.join(root, directory + "-ref"), exist_ok=True)
            ref_path = os.path.join(root, directory + "-ref", ref[0])
            if not os.path.exists(ref_path):
                ref[1](ref_path)
        path = os.path.join(d, name)
        _settle(d)  # a run started in the background ends first
        if not os.path.exists(path):
            make(path)
        for rule in rules:
            out[rule] = (d, name, ref_path)
    return out
