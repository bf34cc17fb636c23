"""A normalisation's eps lost to FP16: 0/0 on all-zero rows (padding), reported as an overflow before.

Reported: pytorch/pytorch#32137 "torch.nn.functional.normalize epsilon too small for half precision" (eps=1e-12 is 0
in FP16; NaN where the norm is 0; 1e-4 works, 1e-5 is too low for the backward) and huggingface/diffusers#13316
(F.normalize on zero-norm slices in FP16 gives 0/0; computed in FP32 instead); pytorch/pytorch#41527
"layer_norm returns nan for fp16 all 0 tensor" (eps=1e-12) with deepspeedai/DeepSpeed#581 (eps 1e-12 added to the
variance is lost in FP16: NaN for rows of padding zeros) and wenet-e2e/wenet#907 (eps 1e-12 -> 1e-5 for half).
Reproduced: token encoders whose padding rows are all zero, normalised in FP16 under autocast: F.normalize in a
module, and the hand-written BertLayerNorm of early BERT ports (eps 1e-12, FP32 weight: an FP32 output whose FP16
computation lost its eps).
"""

import models as M  # noqa: F401  (the shared set-up: one thread for torch)
import pytest
import torch
from script import SCALED, Script, code_parts, diagnose, run, serious
from torch import nn
from torch.nn import functional as F

V, D, T, C, STEPS = 50, 32, 12, 2, 40
SETUP = "optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)\nscaler = torch.amp.GradScaler('cpu')"


class L2Norm(nn.Module):
    def __init__(self, eps=1e-12):  # F.normalize's default
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return F.normalize(x, dim=-1, eps=self.eps)


class BertLayerNorm(nn.Module):
    """The hand-written LayerNorm of early BERT ports (TF-style, eps inside the square root)."""

    def __init__(self, d, eps=1e-12, fp32=False):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        self.variance_epsilon = eps
        self.fp32 = fp32  # DeepSpeed#581's answer: this part of the computation in FP32

    def forward(self, x):
        x = x.float() if self.fp32 else x
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return self.weight * ((x - u) / torch.sqrt(s + self.variance_epsilon)) + self.bias


class Encoder(nn.Module):
    def __init__(self, norm):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D, padding_idx=0)
        self.proj = nn.Linear(D, D, bias=False)  # padding rows stay all zero through it
        self.norm = norm
        self.head = nn.Linear(D, C)

    def forward(self, tokens):
        valid = (tokens > 0).unsqueeze(-1)
        h = self.norm(self.proj(self.emb(tokens))) * valid  # padding masked out after the normalisation
        return self.head(h.sum(1) / valid.sum(1))


def tokens(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        t = torch.randint(1, V, (16, T), generator=g)
        t[torch.arange(T)[None, :] >= torch.randint(4, T + 1, (16,), generator=g)[:, None]] = 0  # padding
        low, high = ((t > 0) & (t < V // 2)).sum(1), (t >= V // 2).sum(1)
        yield t, (low > high).long()  # which half of the vocabulary the sequence draws more tokens from


def ce(out, y):
    return F.cross_entropy(out.float(), y)


def fit(tmp, name, norm, script=None):
    path = str(tmp / f"{name}.db")
    return path, run(script or Script(SETUP), Encoder(norm), tokens(STEPS), STEPS, path, loss_fn=ce)


@pytest.mark.parametrize(
    "norm, out_dtype, eps_text",
    [(L2Norm, "float16", "F.normalize(x, dim=-1, eps=0.0001)"), (lambda: BertLayerNorm(D), "float32", "variance")],
    ids=["F.normalize", "BertLayerNorm"],
)
def test_zero_rows_divided_by_a_norm_rounded_to_zero(tmp, norm, out_dtype, eps_text):
    path, res = fit(tmp, f"norm-{out_dtype}", norm())
    assert not res.finite
    found = diagnose(path)[1]
    d = found[0]
    assert d.rule == "division-by-zero" and d.severity == "critical", [(x.rule, x.summary) for x in found]
    assert d.layers[:2] == ["norm", "proj"] and d.evidence["mechanism"] == "0/0"
    assert d.evidence["out_dtype"] == out_dtype and d.evidence["compute_dtype"] == "float16"
    assert d.evidence["nan"] == d.evidence["input_zeros"] > 0  # every NaN where its input held a padding zero
    assert "no overflow" in d.summary and "overflow" not in d.title.lower()
    assert {x.rule for x in found} == {"division-by-zero"}  # no forward-overflow, no loss-scale-collapse
    assert torch.tensor(1e-12, dtype=torch.float16).item() == 0.0  # the eps the text says FP16 loses (a real cast)
    assert eps_text in d.recommendation
    # the FP32 block, executed as printed on a fresh model before training: the run is healthy
    (fp32,) = code_parts(d)
    assert fp32.splitlines()[-1].startswith('handle = ampdoctor.keep_fp32(model, "norm")')
    fixed, res = fit(tmp, f"norm-{out_dtype}-fp32", norm(), Script(SETUP).with_fix(fp32, "setup"))
    assert res.finite and res.improved(0.9)
    assert serious(diagnose(fixed)[1]) == []


@pytest.mark.parametrize(
    "norm", [lambda: L2Norm(eps=1e-4), lambda: BertLayerNorm(D, fp32=True)], ids=["normalize-1e-4", "layernorm-fp32"]
)
def test_known_fix_control_is_quiet(tmp, norm, request):
    """The fixes the threads settled on: eps=1e-4 for F.normalize (FP16 holds it, and 1/eps fits its backward),
    the variance and division in FP32 for the LayerNorm."""
    path, res = fit(tmp, f"control-{request.node.callspec.id}", norm())
    assert res.finite and res.improved(0.9)
    assert serious(diagnose(path)[1]) == []


def test_eps_attribute_printed_for_torch_normalisations():
    """For torch's own normalisation layers the eps is an attribute: the printed line sets it, and runs."""
    from ampdoctor.rules import advice as A
    from ampdoctor.rules import division

    assert "LayerNorm" in division.NORM_TYPES and A.attr("norm") == "model.norm"
    model = Encoder(nn.LayerNorm(D, eps=1e-12))
    exec(f"{A.attr('norm')}.eps = {division.VARIANCE_EPS!r}", {"model": model})
    assert model.norm.eps == 1e-5 and torch.tensor(model.norm.eps, dtype=torch.float16).item() > 0
    assert SCALED  # the script's backward part: what the fixes above did not replace
