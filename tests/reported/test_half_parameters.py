"""Parameters stored in FP16 (``model.half()``, no autocast): fixes that fit that configuration.

Reported: NVIDIA/apex#240 "Nan Loss with O3 opt_level setting" and afiaka87/glide-finetune#6 "Fixed half precision
optimizer bug" (Adam's eps=1e-8 is 0 in FP16: NaN weights after the first step; eps=1e-4, or FP32 master weights,
mcarilli: use O1/O2); pytorch/pytorch#74739 "GradScaler support FP16 gradients?" and
Lightning-AI/pytorch-lightning#5140 "Attempting to unscale FP16 gradients" (a GradScaler on a half model raises
ValueError: the advice "add a GradScaler" crashes such a run). Reproduced: an FP16 MLP fed FP16 inputs, with Adam
(NaN weights) and with plain SGD on a small loss (gradients flushed, updates rounded away).
"""

import re

import models as M
import pytest
import torch
from script import PLAIN, Script, code_parts, diagnose, run, serious

STEPS = 30
HALF_STEP = "loss = loss_fn(model(x), y)"


def mse(out, y):
    return torch.nn.functional.mse_loss(out.float(), y)


def small_mse(out, y):  # a loss 1000x smaller: its gradients sit under FP16's normal range
    return 1e-3 * mse(out, y)


def data():
    for x, y in M.regression(STEPS):
        yield x.half(), y


def fit(tmp, name, script, loss_fn=mse, half=True):
    path = str(tmp / f"{name}.db")
    model = M.mlp(d_out=1)
    return path, run(script, model.half() if half else model, data(), STEPS, path, loss_fn=loss_fn)


def half_script(optimizer: str) -> Script:
    return Script(f"optimizer = {optimizer}", HALF_STEP, PLAIN)


ADAM = "torch.optim.Adam(model.parameters(), lr=1e-3)"
SGD = "torch.optim.SGD(model.parameters(), lr=0.1)"
MASTER = Script(
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\nscaler = torch.amp.GradScaler('cpu')"
)  # FP32 parameters, FP16 autocast, a GradScaler: the configuration the threads recommend


def test_adam_eps_lost_fix_as_printed(tmp):
    path, res = fit(tmp, "half-adam", half_script(ADAM))
    assert not res.finite
    found = diagnose(path)[1]
    d = found[0]
    assert d.rule == "weights-nonfinite" and d.severity == "critical", [x.rule for x in found]
    assert d.evidence["optimizer"] == "Adam" and d.evidence["eps_lost"] and d.evidence["param_dtype"] == "float16"
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0  # the eps FP16 loses, by a real cast
    master, eps = code_parts(d)
    # the master-weights block, pasted as printed: set-up before the loop, the step after its marker
    fixed, res = fit(tmp, "half-adam-master", half_script(ADAM).with_fix(master, "setup+step"))
    assert res.finite and all(p.dtype == torch.float32 for p in res.ns["model"].parameters())
    assert serious(diagnose(fixed)[1]) == []
    # the other block (keeping FP16 weights, an eps FP16 holds) removes the NaN as printed; what remains of FP16
    # weights is reported for what it is, never as NaN weights again
    fixed, res = fit(tmp, "half-adam-eps", half_script(ADAM).with_fix(eps, "setup"))
    assert res.finite and res.ns["optimizer"].param_groups[0]["eps"] == 1e-4
    assert "weights-nonfinite" not in {x.rule for x in diagnose(fixed)[1]}


def test_half_model_gets_no_gradscaler_it_would_refuse(tmp):
    path, res = fit(tmp, "half-sgd-small", half_script(SGD), small_mse)
    found = diagnose(path)[1]
    rules = [x.rule for x in found]
    assert rules[:2] == ["weight-update-lost", "grad-underflow"], rules
    # what a GradScaler does with this run's FP16 gradients: the crash the threads report
    model = M.mlp(d_out=1).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(mse(model(torch.randn(4, 32).half()), torch.zeros(4, 1))).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(opt)
    for d in found:
        for part in code_parts(d):
            if "GradScaler(" in part:  # every scaler printed for this run comes with FP32 parameters first
                assert part.index("model.float()") < part.index("GradScaler("), (d.rule, part)
    assert "Attempting to unscale FP16 gradients" in found[1].recommendation  # says why no GradScaler alone
    # each block of the two findings, pasted as printed, trains without a ValueError and leaves a healthy run (FP16
    # autocast with a GradScaler; the BF16 alternative without one)
    blocks = [(d.rule, i, p) for d in found[:2] for i, p in enumerate(code_parts(d)) if "# and in the loop:" in p]
    assert len(blocks) >= 3 and any("bfloat16" in p for _, _, p in blocks)
    for rule, i, block in blocks:
        fixed, res = fit(tmp, f"half-sgd-{rule}-{i}", half_script(SGD).with_fix(block, "setup+step"), small_mse)
        assert res.finite
        assert bool(re.search(r'GradScaler\("cpu"', block)) == ("torch.float16" in block)
        assert serious(diagnose(fixed)[1]) == [], (rule, block)


def test_known_fix_control_is_quiet(tmp):
    path, res = fit(tmp, "fp32-params-amp", MASTER, small_mse, half=False)
    assert res.finite
    assert serious(diagnose(path)[1]) == []
