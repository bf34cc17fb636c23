"""ampdoctor.keep_fp32: chosen modules compute in FP32 inside autocast; the handle undoes it exactly."""

import copy
import math
import subprocess
import sys

import pytest
import torch
from runs import mlp, train

import ampdoctor

AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _capture(model, paths):
    """Forward hooks recording (input, output) of the modules at ``paths``; returns (records, handles)."""
    rec, handles = {}, []
    for p in paths:

        def hook(mod, args, out, p=p):
            rec[p] = (args[0].detach().clone(), out.detach().clone())

        handles.append(model.get_submodule(p).register_forward_hook(hook))
    return rec, handles


def _run(model, x, dtype):
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    out.float().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_kept_module_computes_fp32_and_others_are_unchanged(precision):
    dtype = AUTOCAST[precision]
    model, x = mlp(width=32), torch.randn(16, 32)
    rec, hooks = _capture(model, ["0", "2", "4"])
    plain_out, _ = _run(model, x, dtype)
    plain = dict(rec)
    with ampdoctor.keep_fp32(model, "2"):
        kept_out, _ = _run(model, x, dtype)
    for h in hooks:
        h.remove()
    inp, out = rec["2"]
    assert inp.dtype == dtype and out.dtype == torch.float32  # called with half input, output left FP32
    lin = model[2]  # the FP32 computation on the same input
    assert torch.equal(out, torch.nn.functional.linear(plain["2"][0].float(), lin.weight, lin.bias))
    assert plain["2"][1].dtype == dtype
    assert torch.equal(rec["0"][1], plain["0"][1]) and rec["0"][1].dtype == dtype  # before: untouched
    assert rec["4"][1].dtype == dtype  # after: autocast again
    assert kept_out.dtype == plain_out.dtype == dtype


def test_remove_restores_bit_identical_forward_and_backward():
    model, x = mlp(width=32), torch.randn(16, 32)
    before = _run(model, x, torch.float16)
    handle = ampdoctor.keep_fp32(model, "0", "4", "(model)")
    assert all("forward" in model.get_submodule(p).__dict__ for p in ("0", "4")) and "forward" in model.__dict__
    kept = _run(model, x, torch.float16)
    assert not torch.equal(kept[0], before[0])
    handle.remove()
    handle.remove()  # idempotent
    assert not any("forward" in m.__dict__ for m in model.modules())
    after = _run(model, x, torch.float16)
    assert torch.equal(after[0], before[0]) and all(torch.equal(a, b) for a, b in zip(after[1], before[1]))


def test_outside_autocast_nothing_changes():
    model, x = mlp(width=32), torch.randn(16, 32)
    ref = model(x)
    with ampdoctor.keep_fp32(model, "2"):
        assert torch.equal(model(x), ref)


def test_an_own_forward_and_stacked_handles_are_restored_in_any_order():
    model, x = mlp(width=32), torch.randn(8, 32)
    lin = model[2]
    own = lin.forward  # an instance-level forward set by someone else
    lin.forward = own
    a = ampdoctor.keep_fp32(model, "2")
    b = ampdoctor.keep_fp32(model, "2")
    a.remove()  # b is on top: it stays in force
    with torch.autocast("cpu", dtype=torch.float16):
        assert lin(x.half()).dtype == torch.float32
    b.remove()
    assert lin.__dict__["forward"] is own


def test_nested_inputs_are_cast_and_integers_kept():
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, pair, extra=None, index=None):
            a, b = pair
            assert a.dtype == b.dtype == extra["w"].dtype == torch.float32 and index.dtype == torch.int64
            return self.lin(a + b) * extra["w"]

    model = torch.nn.Sequential()
    model.add_module("pair", Pair())
    with ampdoctor.keep_fp32(model, "pair"), torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(2, 4).bfloat16()
        out = model.pair((x, x), extra={"w": torch.ones(1, dtype=torch.float16)}, index=torch.arange(2))
    assert out.dtype == torch.float32


def test_deepcopy_of_a_kept_model_runs_the_copy_weights():
    model, x = mlp(width=32), torch.randn(8, 32)
    ampdoctor.keep_fp32(model, "2")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[2].weight.zero_()
        twin[2].bias.zero_()
    with torch.autocast("cpu", dtype=torch.float16):
        inner = twin[1](twin[0](x))
        assert torch.count_nonzero(twin[2](inner)) == 0  # the copy's own (zeroed) weights
        assert torch.count_nonzero(model[2](inner)) > 0


@pytest.mark.parametrize(
    "args, exc, message",
    [
        ((3, "0"), TypeError, "Argument model should be of type torch.nn.Module, but given <class 'int'>"),
        (("model", "blocks.1.atn"), ValueError, "no module 'blocks.1.atn' in Net; did you mean 'blocks.1.attn'"),
        (("model", "nothing.like.it"), ValueError, "see model.named_modules()"),
        (("model", 1), TypeError, "Argument module_paths should be module paths (str)"),
        (("model",), ValueError, "at least one module path"),
    ],
)
def test_arguments_are_validated_eagerly(args, exc, message):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.Linear(2, 2)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

    net = Net()
    args = tuple(net if a == "model" else a for a in args)
    with pytest.raises(exc) as info:
        ampdoctor.keep_fp32(*args)
    assert message in str(info.value)
    assert not any("forward" in m.__dict__ for m in net.modules())  # nothing half-applied


def test_import_ampdoctor_does_not_import_torch_and_names_stay_functions():
    code = (
        "import sys, ampdoctor; assert 'torch' not in sys.modules\n"
        "import ampdoctor.islands, ampdoctor.lossscale, ampdoctor.rules\n"
        "assert callable(ampdoctor.keep_fp32) and callable(ampdoctor.replay) and callable(ampdoctor.diagnose)\n"
        "import ampdoctor.rules as r; assert r.RULES  # the subpackage, not the function\n"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the real scenarios: a module that overflows FP16 in forward -----------------------------------------------------
class Attention(torch.nn.Module):
    """Single-head self-attention without the 1/sqrt(d) on the scores: q.k grows past 65504 in FP16."""

    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return scores.softmax(-1) @ self.v(x)


def attention_model(d=32, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, d), Attention(d), torch.nn.Linear(d, 1))
    with torch.no_grad():  # large q/k weights: scores ~1e5 in FP16 -> inf -> NaN softmax
        model[1].q.weight.mul_(160)
        model[1].k.weight.mul_(160)
    return model, "1"


def wide_linear_model(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    )
    with torch.no_grad():  # outputs ~1e5: inf in FP16; LayerNorm (FP32 under autocast) tames them
        model[0].weight.mul_(3e4)
    return model, "0"


def sequences(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(8, 12, 16, generator=g)
        yield x, x[..., :1]


@pytest.mark.parametrize("build", [attention_model, wide_linear_model])
def test_keep_fp32_cures_a_forward_overflow(build, tmp_path):
    steps = 6
    model, culprit = build()
    train(model, steps, data=sequences(steps), lr=1e-3, trace=str(tmp_path / "sick.db"))
    sick = ampdoctor.load(str(tmp_path / "sick.db"))
    first = sick.events("nonfinite").iloc[0]
    assert first["phase"] == "fwd" and (first["path"] == culprit or first["path"].startswith(culprit + "."))
    assert sick.steps()["loss"].isna().all() or not sick.steps()["loss"].map(math.isfinite).all()

    model, culprit = build()
    handle = ampdoctor.keep_fp32(model, culprit)
    _, _, scaler, losses = train(model, steps, data=sequences(steps), lr=1e-3, trace=str(tmp_path / "cured.db"))
    assert all(math.isfinite(v) for v in losses)
    cured = ampdoctor.load(str(tmp_path / "cured.db"))
    assert not len(cured.events("nonfinite").query("phase == 'fwd'"))
    assert cured.sites("act").set_index("path").loc[culprit, "dtype"] == "float32"
    handle.remove()
    assert scaler.get_scale() >= 1.0
