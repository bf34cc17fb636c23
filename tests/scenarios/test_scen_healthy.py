"""Healthy runs (FP16 + GradScaler, BF16, FP32; MLP, CNN, small transformer): no warning, no critical."""

import fault_runs as F
import pytest

RUNS = {
    "fp16-mlp": lambda p: F.fit(F.mlp(), F.regression(60), 60, p),
    "fp16-mlp-layernorm": lambda p: F.fit(F.mlp(width=96, norm=True), F.regression(40), 40, p),
    "fp16-cnn": lambda p: F.fit(F.CNN(), F.images(40), 40, p, loss_fn=F.ce),
    "fp16-transformer": lambda p: F.fit(F.Transformer(), F.tokens(40), 40, p, loss_fn=F.ce, optimizer="adam", lr=1e-3),
    "bf16-transformer": lambda p: F.fit(
        F.Transformer(d=48), F.tokens(40), 40, p, precision="bf16", loss_fn=F.ce, optimizer="adam", lr=1e-3
    ),
    "bf16-cnn": lambda p: F.fit(F.CNN(), F.images(40), 40, p, precision="bf16", loss_fn=F.ce),
    "bf16-mlp-wide": lambda p: F.fit(F.mlp(width=256, depth=4), F.regression(40), 40, p, precision="bf16"),
    "fp32-cnn": lambda p: F.fit(F.CNN(), F.images(40), 40, p, precision="fp32", loss_fn=F.ce),
    "fp32-mlp-default-cadence": lambda p: F.fit(
        F.mlp(norm=True),
        F.regression(40),
        40,
        p,
        precision="fp32",
        attach_options={"every": 10, "hist_every": 20, "weight_every": 20},
    ),
    "fp32-transformer": lambda p: F.fit(
        F.Transformer(), F.tokens(30), 30, p, precision="fp32", loss_fn=F.ce, optimizer="adam", lr=1e-3
    ),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_healthy_run_has_no_warning(name, trace_path):
    RUNS[name](trace_path)
    _, found = F.diagnose(trace_path)
    assert not F.serious(found), [(d.rule, d.severity, d.summary) for d in found]
