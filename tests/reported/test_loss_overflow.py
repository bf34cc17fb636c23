"""A loss whose sums overflow FP16: a Dice loss computed on the FP16 output, over every pixel.

Reported: qubvel-org/segmentation_models.pytorch#463 "Mixed Precision (float16) lead to nan loss (soft_dice_score is
inf)" (a 512x512 output summed in FP16: 262144 > 65504, intersection inf, the Dice loss NaN; computed in FP32 it is
fine). Mechanism: the loss function's own arithmetic overflows from finite outputs (each below 1, their sum not);
not the model, not the scale. Reproduced: a per-pixel segmenter ending in a Sigmoid, FP16 autocast + GradScaler, a
Dice loss that casts the target to the output's dtype as the report's does.
"""

import models as M
import pytest
from script import Script, code_parts, diagnose, run, serious

import ampdoctor

STEPS = 12
SETUP = "optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)\nscaler = torch.amp.GradScaler('cpu')"


def dice(p, t):
    t = t.type_as(p)
    inter = (p * t).sum()
    return 1 - 2 * inter / (p.sum() + t.sum())


def dice_fp32(p, t):  # the known fix: the sums in FP32
    return dice(p.float(), t)


def fit(tmp, name, loss_fn, script=None):
    path = str(tmp / f"{name}.db")
    return path, run(script or Script(SETUP), M.PixelSegmenter(), M.masks(STEPS), STEPS, path, loss_fn=loss_fn)


@pytest.fixture(scope="module")
def faulty(tmp):
    return fit(tmp, "dice-fp16", dice)


def test_the_loss_sum_overflow_is_named(faulty):
    path, res = faulty
    assert not res.finite
    found = diagnose(path)[1]
    d = found[0]
    assert d.rule == "loss-nonfinite" and d.severity == "critical", [(x.rule, x.summary) for x in found]
    assert d.evidence["loss_dtype"] == "float16" and d.evidence["loss_value_steps"][:3] == [0, 1, 2]
    assert "A sum over the model's output in float16 overflows" in d.summary and d.layers == ["sigmoid"]
    n = 64 * 4096
    assert f"{n} elements" in d.summary and n > 65504  # the thread's arithmetic: more ones than FP16 holds
    # the loss dtype is also, separately, what precision-policy says; nothing blames the model or the scale
    assert {x.rule for x in found} == {"loss-nonfinite", "precision-policy"}
    assert ampdoctor.load(path).meta["config"]["loss_dtype"] == "float16"


def test_loss_in_fp32_as_printed_is_healthy(faulty, tmp):
    d = diagnose(faulty[0])[1][0]
    (block,) = code_parts(d)
    assert block.splitlines()[-1].startswith("loss = loss_fn(out.float(), y)")
    fixed, res = fit(tmp, "dice-fixed", dice, Script(SETUP).with_fix(block, "forward"))
    assert res.finite and res.improved(0.95)
    assert serious(diagnose(fixed)[1]) == []


def test_known_fix_control_is_quiet(tmp):
    path, res = fit(tmp, "dice-fp32", dice_fp32)
    assert res.finite and res.improved(0.95)
    assert serious(diagnose(path)[1]) == []
