"""A learning rate too high for the model, read as what it is even when the loss never rises before the NaN.

Reported: facebookresearch/fairseq#282 "bigger learning rate leads to reach minimum loss scale" (FP16 training stops
with "Minimum loss scale reached"; the loss explodes with lr 0.001: lower the learning rate), and
pytorch/pytorch#40497 "Mixed precision causes NaN loss" (a transformer with Adam NaNs under autocast only, "big
lrate ... cause nan earlier"). Mechanism: the updates, not the format, take the values out of range; a wider format
only moves the NaN, a keep_fp32 or a lower loss scale cannot help. Reproduced twice, each a case whose loss never
rises before the NaN: a causal LM at chance (random tokens) whose Adam updates inflate its weights until attention
overflows FP16 at step ~35, and an MLP whose first Adam step (lr=10) ruins the weights so that the next forward
overflows.
"""

import math

import models as M
import numpy as np
import pytest
from script import SCALED, Script, code_parts, diagnose, run, serious

import ampdoctor
from ampdoctor.rules.engine import Run

LM_STEPS = 45
FWD32 = "loss = loss_fn(model(x), y)"


def lm_script(lr: float, precision: str = "fp16") -> Script:
    setup = f"optimizer = torch.optim.Adam(model.parameters(), lr={lr})\n" + (
        "scaler = torch.amp.GradScaler('cpu')\n" if precision == "fp16" else ""
    )
    setup += "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))"  # warm-up
    if precision == "fp16":
        return Script(setup, after="scheduler.step()")
    return Script(setup, FWD32, "loss.backward()\noptimizer.step()", "scheduler.step()")


def lm_fit(tmp, name, script):
    path = str(tmp / f"{name}.db")
    return path, run(script, M.LM(), M.noise_tokens(LM_STEPS), LM_STEPS, path, loss_fn=M.lm_loss)


@pytest.fixture(scope="module")
def lm(tmp):
    return lm_fit(tmp, "lm-lr", lm_script(0.35))


def test_lm_at_chance_is_divergence_not_an_attention_overflow(lm):
    path, res = lm
    assert not res.finite and max(v for v in res.losses if math.isfinite(v)) < 1.5 * res.losses[0]  # never rose
    found = diagnose(path)[1]
    d = found[0]
    assert [x.rule for x in found] == ["divergence"], [(x.rule, x.summary) for x in found]
    assert d.severity == "critical" and d.evidence["loss_made_no_progress"]
    assert d.evidence["activation_growth_binades"] >= 6 and "never left its start" in d.evidence["decided_by"]
    # the cut is sized by the update measured (step 0, at the warm-up's 1/20 of the rate): ~1% of the weights a step
    assert d.evidence["lr"] == pytest.approx(0.35) and 1e-4 <= d.evidence["suggested_lr"] <= 0.035
    # the competing explanation was computed, and is what the suppression hides: a forward overflow
    others = Run(ampdoctor.load(path))
    assert others.findings_of("forward-overflow") or others.findings_of("loss-scale-collapse")


def test_lm_fix_as_printed_is_healthy(lm, tmp):
    d = diagnose(lm[0])[1][0]
    lr_part = code_parts(d)[0]
    assert f'group["lr"] = group["initial_lr"] = {d.evidence["suggested_lr"]:g}' in lr_part and "LambdaLR" in lr_part
    # pasted after the script's own set-up (it replaces the user's warm-up scheduler, whose step() the loop calls)
    fixed, res = lm_fit(tmp, "lm-lr-fixed", lm_script(0.35).with_fix(lr_part, "setup"))
    assert res.finite
    assert serious(diagnose(fixed)[1]) == []


def test_lm_in_fp32_grows_the_same_activations(tmp):
    """ "In FP32 or BF16 it would not learn either": the same updates in FP32 grow the same activations by many
    binades (no NaN only because FP32's range is wider)."""
    path, res = lm_fit(tmp, "lm-lr-fp32", lm_script(0.35, "fp32"))
    tr = ampdoctor.load(path)
    col = list(tr.sites("act")["path"]).index("blocks.0.mlp.2")
    peaks = tr.records("peak", "act")[:, col]
    seen = peaks[np.isfinite(peaks)]
    assert math.log2(seen.max() / seen[0]) >= 6
    assert min(res.losses) > 0.9 * res.losses[0]  # and it did not learn


def test_lm_known_fix_control_is_quiet(tmp):
    path, res = lm_fit(tmp, "lm-lr-ok", lm_script(3e-3))
    assert res.finite
    assert serious(diagnose(path)[1]) == []


# -- the first Adam step ruins the weights ---------------------------------------------------------------------------
MLP_STEPS = 30


def mlp_fit(tmp, name, setup, precision="fp16"):
    path = str(tmp / f"{name}.db")
    s = Script(setup) if precision == "fp16" else Script(setup, FWD32, "loss.backward()\noptimizer.step()")
    model = M.mlp(width=128)
    return path, run(s, model, M.classes(MLP_STEPS), MLP_STEPS, path, loss_fn=ce)


def ce(out, y):
    import torch

    return torch.nn.functional.cross_entropy(out.float(), y)


ADAM = "optimizer = torch.optim.Adam(model.parameters(), lr={lr})\nscaler = torch.amp.GradScaler('cpu')"


@pytest.fixture(scope="module")
def adam(tmp):
    return mlp_fit(tmp, "adam-lr10", ADAM.format(lr=10.0))


def test_first_step_that_ruins_the_weights(adam):
    path, res = adam
    assert math.isfinite(res.losses[0]) and not any(math.isfinite(v) for v in res.losses[1:])  # NaN at once
    found = diagnose(path)[1]
    assert [x.rule for x in found] == ["divergence"], [(x.rule, x.summary) for x in found]
    d = found[0]
    assert d.evidence["update_step"] == 0 and d.evidence["update_to_weight_ratio"] >= 50  # ~lr x sqrt(fan_in)
    assert d.evidence["jump_step"] == 1 and d.evidence["one_step_jump_binades"] >= 15  # 17 binades, then inf
    assert "went non-finite at once" in d.evidence["decided_by"]
    # the cut is sized by the update measured (to ~1% of the weights per step), not one decade (lr=1 still ruins)
    assert d.evidence["suggested_lr"] <= 1e-3


def test_first_step_fix_as_printed_trains(adam, tmp):
    d = diagnose(adam[0])[1][0]
    fixed, res = mlp_fit(tmp, "adam-lr10-fixed", ADAM.format(lr=10.0) + "\n" + code_parts(d)[0])
    assert res.finite and res.improved(1.0)  # (slowly: the printed warm-up ramps the rate over 100 steps)
    assert serious(diagnose(fixed)[1]) == []


def test_first_step_in_fp32_does_not_learn_either(tmp):
    _, res = mlp_fit(tmp, "adam-lr10-fp32", "optimizer = torch.optim.Adam(model.parameters(), lr=10.0)", "fp32")
    # no NaN in FP32: a loss blown up by orders of magnitude that never comes back to where it started
    assert max(res.losses) > 1e3 * res.losses[0] and min(res.losses[1:]) > res.losses[0]


def test_first_step_known_fix_control_is_quiet(tmp):
    path, res = mlp_fit(tmp, "adam-ok", ADAM.format(lr=1e-3))
    assert res.improved(0.95)
    assert serious(diagnose(path)[1]) == []
    assert SCALED in Script("").backward  # the fixes above replaced no part of the step: set-up only
