"""Gradient clipping applied to the scaled gradients (no ``scaler.unscale_(optimizer)`` before ``clip_grad_norm_``).

Reported: pytorch/pytorch#40907 "Gradient clipping with torch.cuda.amp" (with ``clip_grad_norm_(model.parameters(),
12)`` the loss does not decrease; mcarilli: unscale first, as amp_examples shows), and Lightning-AI/pytorch-lightning
#9599 "Clip norm after scaler.unscale_ in native fp16 training" (a very flat learning curve; fixed in 1.4.9).
Mechanism: the clip cuts the scaled norm to max_norm, the scaler then divides by the scale, so every update is
max_norm / scale: SGD stalls with no NaN. Reproduced: an MLP classifier, SGD, FP16 autocast + GradScaler.
"""

import math

import models as M
import pytest
import torch
from script import PLAIN, Script, code_parts, diagnose, run, serious

import ampdoctor
from ampdoctor.rules.engine import Run

STEPS = 40
BAD = "scaler.scale(loss).backward()\ntorch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n" + (
    "scaler.step(optimizer)\nscaler.update()"
)
GOOD = (
    "scaler.scale(loss).backward()\nscaler.unscale_(optimizer)\n"
    "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\nscaler.step(optimizer)\nscaler.update()"
)


def script(growth_interval: int, backward: str) -> Script:
    setup = (
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.5)\n"
        f'scaler = torch.amp.GradScaler("cpu", growth_interval={growth_interval})'
    )
    return Script(setup, backward=backward)


def fit(tmp, name, s, **kw):
    path = str(tmp / f"{name}.db")
    return path, run(
        s,
        M.mlp(),
        M.classes(STEPS),
        STEPS,
        path,
        loss_fn=lambda o, y: torch.nn.functional.cross_entropy(o.float(), y),
        **kw,
    )


@pytest.fixture(scope="module")
def clipped(tmp):
    # growth_interval=10: the scale doubles every 10 clean steps, and the applied norm follows 1/scale
    return fit(tmp, "clipped", script(10, BAD))


def test_named_with_the_unscale_fix_that_trains(clipped, tmp):
    path, res = clipped
    assert res.finite and not res.improved(0.9)  # no NaN, and no learning either
    found = diagnose(path)[1]
    d = found[0]
    assert d.rule == "clip-before-unscale" and d.severity == "critical", [(x.rule, x.summary) for x in found]
    assert d.evidence["max_norm"] == pytest.approx(1.0, rel=1e-4)  # the setting, recovered from norm x scale
    assert d.evidence["scale_changes_followed"] and d.evidence["scales_seen"] >= 3
    assert "Decided by: the scale took" in d.summary
    # the printed step, pasted in place of the script's backward part, exactly as printed
    (step,) = code_parts(d)
    assert "scaler.unscale_(optimizer)" in step.splitlines()[1] and "max_norm=1.0" in step
    fixed, res = fit(tmp, "clipped-fixed", script(10, BAD).with_fix(step, "backward"))
    assert res.improved(0.8), res.losses
    assert serious(diagnose(fixed)[1]) == []


def test_constant_scale_is_reported_with_its_doubt(tmp):
    """At the default growth_interval the scale never changes in 40 steps: the norms alone cannot rule out a
    max_norm of 1.5e-5 on unscaled gradients. The finding says so and is a warning, not critical."""
    path, _ = fit(tmp, "clipped-constant", script(2000, BAD))
    found = diagnose(path)[1]
    d = found[0]
    assert d.rule == "clip-before-unscale" and d.severity == "warning"
    assert not d.evidence["scale_changes_followed"] and "the scale never changed" in d.summary
    assert d.evidence["applied_norm_median"] == pytest.approx(1.0 / 65536, rel=1e-3)


def test_known_fix_control_is_quiet(tmp):
    path, res = fit(tmp, "unscaled-first", script(10, GOOD))
    assert res.improved(0.8)
    assert serious(diagnose(path)[1]) == []


def test_slow_convergence_does_not_prescribe_a_higher_learning_rate(clipped, tmp):
    """Against an FP32 reference the stalled run converges far slower; a higher learning rate would not undo
    1/scale, so slow-convergence is suppressed by the finding that names the cause."""
    ref = str(tmp / "fp32.db")
    run(
        Script(
            "optimizer = torch.optim.SGD(model.parameters(), lr=0.5)",
            forward="loss = loss_fn(model(x), y)",
            backward=PLAIN,
        ),
        M.mlp(),
        M.classes(STEPS),
        STEPS,
        ref,
        loss_fn=lambda o, y: torch.nn.functional.cross_entropy(o.float(), y),
    )
    rules = [d.rule for d in diagnose(clipped[0], reference=ref)[1]]
    assert rules[0] == "clip-before-unscale" and "slow-convergence" not in rules
    # it is computed (and would fire): the suppression, not a missing comparison, keeps it out

    r = Run(ampdoctor.load(clipped[0]), Run(ampdoctor.load(ref)))
    assert [x.rule for x in r.findings_of("slow-convergence")] == ["slow-convergence"]
    assert math.isfinite(r.findings_of("slow-convergence")[0].evidence["ratio"])
