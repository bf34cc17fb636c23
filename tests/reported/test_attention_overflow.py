"""Attention scores overflow FP16: q @ k^T leaves the range before the 1/sqrt(d) that follows it.

Reported: plemeri/InSPyReNet#36 "Overflow NaN can be happen in training" (query and key are not normalised and the
bmm gives inf with float16), and lucidrains/imagen-pytorch#69 "Numerical stability of attention layers" (loss
explosions in FP16; fixed by scaling q before the product, the scale split between q and k, and the softmax in
FP32). Mechanism: a forward overflow inside the attention module (its own output stays small, its scores do not);
loss scaling cannot help, FP32 for that module or the scale applied before the product removes it. Reproduced: a
token classifier whose embeddings are scaled up (no norm before attention) and whose attention scales the product.
"""

import models as M
import pytest
import torch
from script import Script, code_parts, diagnose, run, serious

STEPS = 30
SETUP = "optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)\nscaler = torch.amp.GradScaler('cpu')"


def ce(out, y):
    return torch.nn.functional.cross_entropy(out.float(), y)


def fit(tmp, name, scale, script=None):
    path = str(tmp / f"{name}.db")
    model = M.TokenClassifier(scale=scale, emb_scale=90.0)
    return path, run(script or Script(SETUP), model, M.token_classes(STEPS), STEPS, path, loss_fn=ce)


@pytest.fixture(scope="module")
def faulty(tmp):
    return fit(tmp, "scores-overflow", "after")


def test_overflow_in_the_attention_module(faulty):
    path, res = faulty
    assert not res.finite
    found = diagnose(path)[1]
    d = found[0]
    assert d.rule == "forward-overflow" and d.severity == "critical" and d.layers[0] == "attn"
    assert d.evidence["module_type"] == "Attention" and d.evidence["value"] == "nan"
    assert "scale the attention scores by 1/sqrt(d)" in d.recommendation  # the cause named, in the text
    assert {x.rule for x in found} == {"forward-overflow", "loss-scale-collapse"}


def test_keep_fp32_as_printed_is_healthy(faulty, tmp):
    d = diagnose(faulty[0])[1][0]
    keep = code_parts(d)[0]
    assert keep.startswith('handle = ampdoctor.keep_fp32(model, "attn")')
    fixed, res = fit(tmp, "scores-fp32", "after", Script(SETUP).with_fix(keep, "setup"))
    assert res.finite and res.improved(0.95)
    assert serious(diagnose(fixed)[1]) == []


def test_known_fix_control_is_quiet(tmp):
    """imagen-pytorch's fix: scale q before the product."""
    path, res = fit(tmp, "scores-scaled-first", "before")
    assert res.finite and res.improved(0.95)
    assert serious(diagnose(path)[1]) == []
