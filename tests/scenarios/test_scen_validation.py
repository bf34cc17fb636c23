"""val-oscillation on a real run: BatchNorm running statistics kept in FP16 make the eval-mode validation loss swing
while the training loss (batch statistics) is fine; the same model with the BatchNorm in FP32 validates smoothly.

The model standardises raw tabular features (means 300-600, spread 1: years, prices, sensor counts) with an input
``BatchNorm1d(affine=False)``. In FP16 an ULP at 300-600 is 0.25-0.5, so each running-mean update
``(1-m)*r + m*batch`` (m = 0.1) that moves r by less than half an ULP rounds back to r: the running mean sticks up
to ULP/(2m) = 1.25-2.5 spreads away from the feature mean and jumps by whole ULPs when a batch pushes it, and eval
mode normalises with it. Training mode normalises with the batch's own statistics and does not see it.
"""

import math
import re

import fault_runs as F
import numpy as np
import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.rules import validation as V
from ampdoctor.rules.engine import Run

D_IN, OFFSET = 16, 300.0
STEPS, EVERY = 300, 4  # 75 validation points, 37 in the late half the rule judges


def tabular(n, batch=32, seed=2):
    """Regression on features with large means and unit spread."""
    gw = torch.Generator().manual_seed(3)
    w = torch.randn(D_IN, 1, generator=gw) / math.sqrt(D_IN)
    mu = OFFSET * (1 + torch.rand(D_IN, generator=gw))
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        z = torch.randn(batch, D_IN, generator=g)
        yield z + mu, z @ w + 0.1 * torch.randn(batch, 1, generator=g)


VAL = list(tabular(1, batch=256, seed=7))


def model(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.BatchNorm1d(D_IN, affine=False),
        nn.Linear(D_IN, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 1),
    )


def validate(input_dtype):
    """on_step: every EVERY steps the validation loss in eval mode (running statistics), logged as val/loss."""

    def on_step(step, m, doc):
        if step % EVERY:
            return
        m.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=input_dtype is not None):
            x, y = VAL[0]
            v = F.mse(m(x if input_dtype is None else x.to(input_dtype)), y).item()
        m.train()
        doc.log_metric("val/loss", v)

    return on_step


def fp16_run(path, m):
    """FP16 autocast + GradScaler; the features are fed in FP16 (what an FP16 BatchNorm requires)."""
    F.fit(
        m,
        tabular(STEPS),
        STEPS,
        path,
        precision="fp16",
        input_dtype=torch.float16,
        lr=0.05,
        on_step=validate(torch.float16),
    )


def batchnorm_in_fp16(path):
    m = model()
    m[0].half()  # the fault: the running mean/variance live in FP16
    fp16_run(path, m)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same model and data in FP32."""
    path = str(tmp_path_factory.mktemp("val") / "fp32.db")
    F.fit(model(), tabular(STEPS), STEPS, path, precision="fp32", lr=0.05, on_step=validate(None))
    return path


def test_fp16_batchnorm_statistics_make_validation_oscillate(reference, trace_path):
    batchnorm_in_fp16(trace_path)
    by_rule, found = F.diagnose(trace_path, reference=reference)
    assert set(by_rule) == {"val-oscillation"}, [(d.rule, d.summary) for d in found]
    d = by_rule["val-oscillation"]
    assert d.severity == "warning" and d.layers[0] == "0"
    assert ampdoctor.load(trace_path).sites("act").set_index("path").loc["0", "module_type"] == "BatchNorm1d"
    ev = d.evidence
    assert ev["metric"] == "val/loss" and ev["against"] == "reference"
    assert ev["dispersion_ratio"] >= 10 * V.MIN_RATIO and ev["fligner_p"] < V.ALPHA
    assert ev["sign_change_share"] >= V.MIN_SIGN_CHANGES
    assert d.steps == ev["late_steps"] and d.steps[1] == STEPS - EVERY
    # the training loss (batch statistics) did not show it: the run trains as well as the reference
    st, ref = ampdoctor.load(trace_path).steps(), ampdoctor.load(reference).steps()
    assert st["loss"].iloc[-50:].median() < 2 * ref["loss"].iloc[-50:].median()
    # without the reference nothing unrelated fires (the rule itself only on strong relative swings)
    assert {x.rule for x in F.diagnose(trace_path)[1]} <= {"val-oscillation"}


def test_reference_run_is_quiet(reference):
    assert F.diagnose(reference)[1] == []


def test_fp16_run_with_fp32_batchnorm_is_quiet(reference, trace_path):
    m = model()
    ampdoctor.keep_fp32(m, "0")  # the healthy allocation: autocast for the rest, normalisation in FP32
    fp16_run(trace_path, m)
    assert F.diagnose(trace_path, reference=reference)[1] == []
    assert F.diagnose(trace_path)[1] == []


def test_val_oscillation_fix(reference, trace_path, tmp_path):
    batchnorm_in_fp16(trace_path)
    d = F.diagnose(trace_path, reference=reference)[0]["val-oscillation"]
    code = d.recommendation.split(":\n", 1)[1]
    assert re.search(r'^handle = ampdoctor\.keep_fp32\(model, "0"\)', code, re.M)
    assert "model[0].float()" in code
    m = model()
    m[0].half()
    exec(code, {"model": m, "torch": torch, "ampdoctor": ampdoctor})
    assert m[0].running_mean.dtype == torch.float32
    fixed = str(tmp_path / "fixed.db")
    fp16_run(fixed, m)  # the loop unchanged: still feeds FP16 features
    assert F.diagnose(fixed, reference=reference)[1] == []
    assert F.diagnose(fixed)[1] == []


@pytest.mark.parametrize(
    "shape, oscillates",
    [
        ("noise", True),  # independent swings: about half the neighbours change sign
        ("alternating", True),
        ("decay", False),  # a smooth curve around a straight trend: a few sign changes
        ("line", False),
    ],
)
def test_residual_statistics(shape, oscillates):
    x = np.arange(0, 200, 4)
    rng = np.random.default_rng(0)
    base = 0.05 + 0.5 * np.exp(-x / 80.0)
    v = {
        "noise": base * np.exp(0.6 * rng.standard_normal(len(x))),
        "alternating": base * np.where(np.arange(len(x)) % 2, 1.5, 0.67),
        "decay": base,
        "line": 1.0 - 0.001 * x,
    }[shape]
    r = V.residuals(x, v)
    assert r["points"] == 25 and r["steps"] == [100, 196]
    assert (r["sign_changes"] >= V.MIN_SIGN_CHANGES) is oscillates
    if oscillates:
        assert r["log_dispersion"] >= V.MIN_DISPERSION


def test_noisy_metric_of_an_fp32_run_is_not_a_precision_fault(trace_path):
    """A validation loss that really swings in an FP32 run (measured on 8 fresh samples each time, so sampling
    noise dominates) has no half-precision layer to blame: the rule stays silent."""
    val = F.regression(100, batch=8, seed=9)

    def on_step(step, m, doc):
        x, y = next(val)
        with torch.no_grad():
            doc.log_metric("val/loss", F.mse(m(x), y).item())

    F.fit(F.mlp(width=32), F.regression(100), 100, trace_path, precision="fp32", on_step=on_step)
    r = V.residuals(*V._series(Run(ampdoctor.load(trace_path)), "val/loss"))
    assert r["sign_changes"] >= V.MIN_SIGN_CHANGES and r["log_dispersion"] >= V.MIN_DISPERSION  # it does swing
    assert "val-oscillation" not in F.diagnose(trace_path)[0]
