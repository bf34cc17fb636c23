"""Softmax, then log, then NLL in FP16: the loss function makes the Inf/NaN, not the model.

Reported: NVIDIA/apex#379 "Log function causes floating point underflow/ gradient overflow" (softmax -> log ->
nll_loss instead of CrossEntropyLoss; under FP16 "sudden gradient overflows and skip all steps"; ptrblck: use
F.log_softmax instead of torch.log(F.softmax())). Mechanism: log's gradient 1/p, times the loss scale, overflows FP16
for a small probability (and p rounded to 0 gives -inf); the GradScaler skips, halves, and skips again as the model
grows confident. Reproduced: an MLP classifier with 10% noisy labels, SGD, FP16 autocast (CPU autocast keeps softmax
and log in FP16, as the FP16 model of the report did) + GradScaler.
"""

import models as M
import pytest
import torch
from script import Script, code_parts, diagnose, run, serious
from torch.nn import functional as F

STEPS = 60
SETUP = "optimizer = torch.optim.SGD(model.parameters(), lr=0.5)\nscaler = torch.amp.GradScaler('cpu')"


def log_of_softmax(out, y):
    return F.nll_loss(torch.log(torch.softmax(out, -1)), y)


def log_softmax(out, y):  # the maintainers' advice
    return F.nll_loss(F.log_softmax(out, -1), y)


def data():
    for x, y in M.classes(STEPS, k=8, noise=0.1):
        yield 3 * x, y


def fit(tmp, name, loss_fn, script=None):
    path = str(tmp / f"{name}.db")
    return path, run(script or Script(SETUP), M.mlp(d_out=8), data(), STEPS, path, loss_fn=loss_fn)


@pytest.fixture(scope="module")
def faulty(tmp):
    return fit(tmp, "log-softmax", log_of_softmax)


def test_the_loss_function_is_named_not_exploding_gradients(faulty):
    path, res = faulty
    assert res.finite  # the loss itself stays finite: the NaN is in its gradient
    found = diagnose(path)[1]
    d = found[0]
    assert d.rule == "loss-nonfinite", [(x.rule, x.summary) for x in found]
    assert len(d.evidence["output_gradient_steps"]) >= 2 and d.evidence["output_dtype"] == "float16"
    assert "Softmax and log in float16" in d.summary and "log's gradient" in d.summary
    assert d.layers == ["4"]  # the model's output layer, whose output gradient it was
    # neither "clip the exploding gradients" nor "lower the initial scale" is printed for it
    assert all(x.rule not in ("loss-scale-collapse", "init-scale-too-high") for x in found)
    assert "clip_grad_norm_" not in d.recommendation


def test_the_printed_cross_entropy_trains_healthy(faulty, tmp):
    d = diagnose(faulty[0])[1][0]
    ce, fp32 = code_parts(d)
    assert "cross_entropy(logits.float(), y)" in ce and "loss_fn(out.float(), y)" in fp32
    fixed, res = fit(tmp, "cross-entropy-as-printed", log_of_softmax, Script(SETUP).with_fix(ce, "forward"))
    assert res.improved(0.85)
    assert serious(diagnose(fixed)[1]) == []
    # the second block, the user's own loss function in FP32, works as printed too
    fixed, res = fit(tmp, "loss-in-fp32-as-printed", log_of_softmax, Script(SETUP).with_fix(fp32, "forward"))
    assert res.improved(0.85)
    assert serious(diagnose(fixed)[1]) == []


def test_known_fix_control_is_quiet(tmp):
    path, res = fit(tmp, "log-softmax-fused", log_softmax)
    assert res.improved(0.85)
    assert serious(diagnose(path)[1]) == []
