"""FP16 autocast without a GradScaler: gradients under 2^-14 lose bits, under 2^-24 flush to zero.

Reported: engichang1467/Open-Rig3R#35 "autocast defaults to fp16 with no GradScaler — gradients can silently
underflow to zero" (no error, no NaN, the loss flattens early; fix: a GradScaler, or BF16 where supported).
Reproduced: a regression MLP whose loss is small (a weighted term, as the report's bounded cosine terms), FP16
autocast, no scaler.
"""

import models as M
import pytest
import torch
from script import PLAIN, Script, code_parts, diagnose, run, serious

STEPS = 40
SGD = "optimizer = torch.optim.SGD(model.parameters(), lr=0.05)"


def small_mse(out, y):
    return 1e-4 * torch.nn.functional.mse_loss(out.float(), y)


def fit(tmp, name, script):
    path = str(tmp / f"{name}.db")
    return path, run(script, M.mlp(d_out=1), M.regression(STEPS), STEPS, path, loss_fn=small_mse)


@pytest.fixture(scope="module")
def faulty(tmp):
    return fit(tmp, "fp16-no-scaler", Script(SGD, backward=PLAIN))


def test_underflow_without_a_scaler(faulty):
    path, res = faulty
    assert res.finite  # no NaN: the fault is silent
    found = diagnose(path)[1]
    d = found[0]
    assert d.rule == "grad-underflow" and d.severity in ("warning", "critical"), [x.rule for x in found]
    assert d.evidence["scale_in_force"] == 1.0 and "no loss scaler lifts them" in d.summary
    assert torch.tensor(2.0**-25, dtype=torch.float16).item() == 0.0  # below half the smallest subnormal: flushed


def test_printed_scaler_and_bf16_fixes_are_healthy(faulty, tmp):
    d = diagnose(faulty[0])[1][0]
    parts = code_parts(d)
    scaler = next(p for p in parts if "GradScaler(" in p)
    fixed, res = fit(tmp, "fp16-scaler-as-printed", Script(SGD, backward=PLAIN).with_fix(scaler, "setup+backward"))
    assert res.finite and res.ns["scaler"].is_enabled()
    assert serious(diagnose(fixed)[1]) == []
    bf16 = next(p for p in parts if "bfloat16" in p)  # offered: the recorded device (CPU) supports BF16
    fixed, res = fit(tmp, "bf16-as-printed", Script(SGD, backward=PLAIN).with_fix(bf16, "step"))
    assert res.finite
    assert serious(diagnose(fixed)[1]) == []


def test_known_fix_control_is_quiet(tmp):
    path, res = fit(tmp, "fp16-default-scaler", Script(SGD + "\nscaler = torch.amp.GradScaler('cpu')"))
    assert res.finite
    assert serious(diagnose(path)[1]) == []
