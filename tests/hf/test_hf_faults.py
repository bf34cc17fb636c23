"""Hugging Face models (GPT-2, BERT, T5 from tiny configs, random weights, CPU) in a plain loop, each with one fault
of those users meet: the right rule, the right layer, numbers that agree across findings and with the replay, and
the printed fix, applied as printed, leaves a healthy run (or the finding says only a change of model can)."""

import importlib
import math
import re

import hf_runs as R
import numpy as np
import pytest
import torch
from hf_runs import run, serious

import ampdoctor
from ampdoctor import cli, formats

replay = importlib.import_module("ampdoctor.lossscale")


def _code(rec, *patterns):
    """The lines of a recommendation that match the patterns, with the indented lines that follow each."""
    out, keep = [], False
    for line in rec.splitlines():
        if any(re.match(p, line) for p in patterns):
            keep = True
            out.append(line)
        elif keep and line.startswith("    "):
            out.append(line)
        else:
            keep = False
    return "\n".join(out)


def _apply(code):
    """A setup that executes printed code against the run's own model, optimizer and scaler."""

    def setup(ns):
        exec(code, ns)

    return setup


def _scales_agree(path, found):
    """Every scale a finding suggests is the replay's suggestion for the same trace."""
    best = replay.suggest(path).settings["init_scale"]
    quoted = [d.evidence[k] for d in found for k in ("suggested_init_scale", "suggested_scale") if k in d.evidence]
    assert all(q == best for q in quoted), (quoted, best)
    return best


# -- healthy stock models: no warning, so `diagnose --fail-on warning` passes a CI gate --------------------------
@pytest.mark.parametrize("name", ["gpt2", "bert", "t5"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_healthy_models_pass_the_ci_gate(name, precision, tmp, capsys):
    path, losses = run(tmp, f"healthy-{name}-{precision}", name, precision=precision, steps=8)
    assert all(math.isfinite(x) for x in losses)
    assert cli.main(["diagnose", path, "--fail-on", "warning"]) == 0, capsys.readouterr().out
    _scales_agree(path, ampdoctor.diagnose(path))


def test_stock_bert_fp16_subnormal_gradients_are_advice_not_a_warning(tmp, capsys):
    # a stock BERT at 16 tokens x 8: its attention gradients keep ~1% of their elements in FP16's subnormal range at
    # the default scale, nothing flushed, with room to grow the scale: advice, not a failed CI gate
    path, _ = run(tmp, "bert-fp16-subnormal", "bert", steps=12, size=8, seq=16)
    d = {x.rule: x for x in ampdoctor.diagnose(path)}["grad-underflow"]
    assert d.severity == "info" and d.evidence["flushed_share_worst"] < 0.01
    assert max(d.evidence["underflow_share"].values()) >= 0.01
    assert d.evidence["reachable_scale"] > d.evidence["scale_in_force"]
    assert cli.main(["diagnose", path, "--fail-on", "warning"]) == 0, capsys.readouterr().out
    _scales_agree(path, [d])


# -- 1. a model that returns its own loss: its gradient w.r.t. itself is not a gradient -------------------------
def test_returned_loss_seed_is_not_the_largest_gradient(tmp):
    path, _ = run(tmp, "gpt2-init", "gpt2", init_scale=2.0**24, steps=12)
    found = ampdoctor.diagnose(path)
    d = {x.rule: x for x in found}["init-scale-too-high"]
    peaks = replay.gradient_peaks(ampdoctor.load(path))
    st = ampdoctor.load(path).steps()
    clean = ~st["skipped"].to_numpy() & ~peaks.nonfinite
    # one definition: the rule's largest unscaled gradient is the replay's, and it is not the loss's seed of 1
    assert d.evidence["max_unscaled_grad"] == pytest.approx(float(np.nanmax(peaks.fp16_equivalent[clean])))
    assert d.evidence["max_unscaled_grad"] < 1.0
    best = _scales_agree(path, found)
    assert best > formats.FP16.max / (8 * 1.0)  # not the 4096 that a gradient of 1 would allow
    assert d.evidence["suggested_init_scale"] == best and f"init_scale={best!r}" in d.recommendation
    # the scale the rule suggests never overflowed in the run itself
    assert best < st.loc[st["skipped"], "loss_scale"].min()
    fixed, _ = run(
        tmp,
        "gpt2-init-fixed",
        "gpt2",
        steps=12,
        setup=_apply(_code(d.recommendation, r"^scaler = torch\.amp\.GradScaler\(")),
    )
    assert serious(fixed) == []
    assert not ampdoctor.load(fixed).steps()["skipped"].any()


def test_bf16_run_readiness_quotes_the_replays_scale(tmp):
    path, _ = run(tmp, "gpt2-bf16-ready", "bert", precision="bf16", steps=12)
    found = ampdoctor.diagnose(path)
    ready = [d for d in found if d.rule == "fp16-readiness"]
    best = _scales_agree(path, found)
    assert best > 4096.0
    for d in ready:
        assert d.evidence["max_grad"] < 1.0 and f"init_scale={best!r}" in d.recommendation


# -- 2. divergence (learning rate far too high) told from a scale problem ---------------------------------------
@pytest.fixture(scope="module")
def diverged(tmp):
    return run(tmp, "gpt2-lr1", "gpt2", lr=1.0, steps=12)[0]


def test_divergence_is_not_read_as_a_scaling_problem(diverged, tmp):
    found = ampdoctor.diagnose(diverged)
    rules = [d.rule for d in found]
    assert rules[0] == "divergence", rules
    assert not {"loss-scale-collapse", "init-scale-too-high", "grad-underflow"} & set(rules), rules
    d = found[0]
    assert d.severity == "critical" and d.evidence["optimizer"] == "AdamW" and d.evidence["lr"] == 1.0
    assert d.evidence["loss_rise"] >= 1.5
    losses = ampdoctor.load(diverged).steps()["loss"].to_numpy()
    assert d.evidence["loss_peak"] == pytest.approx(np.nanmax(losses[: d.evidence["first_nonfinite_step"] + 11]))
    assert "does not help AdamW" in d.recommendation and "clip_grad_norm_" not in d.recommendation
    # an FP32 reference that diverges as well confirms it
    ref, _ = run(tmp, "gpt2-lr1-fp32", "gpt2", lr=1.0, steps=12, precision="fp32")
    with_ref = {x.rule: x for x in ampdoctor.diagnose(diverged, reference=ref)}
    assert with_ref["divergence"].evidence["reference_diverged"] is True
    # the FP32 run itself: diverged without a non-finite value (FP32 holds the blown-up loss), not "FP16-unready"
    fp32 = ampdoctor.diagnose(ref)
    assert [x.rule for x in fp32] == ["divergence"] and fp32[0].evidence["nonfinite_steps"] == 0
    assert fp32[0].evidence["loss_rise"] >= 4 and "loss scale" not in fp32[0].recommendation


def test_divergence_fix_as_printed_trains(diverged, tmp):
    d = ampdoctor.diagnose(diverged)[0]
    code = _code(d.recommendation, r"^for group in optimizer", r"^scheduler = ")
    # at least a decade lower; sized by the update measured (the first AdamW step moved the weights by their own
    # scale), so about 1% of the weights per step
    assert d.evidence["suggested_lr"] <= 0.1 and d.evidence["update_to_weight_ratio"] >= 1.0
    assert f'group["lr"] = group["initial_lr"] = {d.evidence["suggested_lr"]:g}' in code
    fixed, losses = run(tmp, "gpt2-lr1-fixed", "gpt2", lr=1.0, steps=12, setup=_apply(code))
    assert all(math.isfinite(x) for x in losses)
    assert serious(fixed) == []


def test_a_healthy_reference_says_it_is_not_divergence(diverged, tmp):
    # the same trace against a reference that trains fine: the reference's evidence rules divergence out
    ref, _ = run(tmp, "gpt2-ref-ok", "gpt2", steps=12, precision="fp32")
    assert "divergence" not in {x.rule for x in ampdoctor.diagnose(diverged, reference=ref)}


# -- 3. optimizer-made NaN weights: .half() + AdamW (eps=1e-8 is 0 in FP16) -------------------------------------
@pytest.fixture(scope="module")
def half_adamw(tmp):
    return run(tmp, "bert-half", "bert", half=True, precision="fp32", scaler=False, steps=6)


def test_half_weights_adamw_nan_is_critical(half_adamw, capsys):
    path, losses = half_adamw
    assert math.isfinite(losses[0]) and all(math.isnan(x) for x in losses[1:])
    found = ampdoctor.diagnose(path)
    d = found[0]
    assert d.rule == "weights-nonfinite" and d.severity == "critical", [x.rule for x in found]
    assert d.evidence["eps"] == 1e-8 and d.evidence["eps_in_format"] == 0.0 and d.evidence["gradients_finite"]
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0  # what the evidence says, by a real cast
    assert "bert.embeddings.word_embeddings" in d.layers
    # the LayerNorms in FP16 are true too, and said once (not once per module)
    policy = {x.rule: x for x in found}["precision-policy"]
    assert policy.severity == "warning" and policy.summary.count("LayerNorm keeps") == 1
    # info tells the same story: the loss is not finite after step 0
    assert cli.main(["info", path]) == 0
    out = capsys.readouterr().out
    assert "not finite at 5 step(s): 1-5" in out and "-> " not in next(
        ln for ln in out.splitlines() if ln.startswith("loss ")
    )


def test_half_weights_fix_fp32_master_weights_as_printed(half_adamw, tmp):
    d = ampdoctor.diagnose(half_adamw[0])[0]
    code = _code(d.recommendation, r"^model\.float\(\)", r"^optimizer = ", r"^scaler = ")
    assert code.count("\n") == 2
    fixed, losses = run(
        tmp, "bert-half-fixed", "bert", half=True, precision="fp16", scaler=False, steps=6, setup=_apply(code)
    )
    assert all(math.isfinite(x) for x in losses)
    assert serious(fixed) == []


def test_half_weights_fix_eps_as_printed(half_adamw, tmp):
    d = ampdoctor.diagnose(half_adamw[0])[0]
    code = _code(d.recommendation, r"^for group in optimizer")
    assert 'group["eps"] = 0.0001' in code
    fixed, losses = run(
        tmp, "bert-half-eps", "bert", half=True, precision="fp32", scaler=False, steps=6, setup=_apply(code)
    )
    assert all(math.isfinite(x) for x in losses)
    assert "weights-nonfinite" not in {x.rule for x in ampdoctor.diagnose(fixed)}


# -- 4. T5: the producer of near-limit values, not the Dropout that tipped them over -------------------------------
WO = "decoder.block.1.layer.2.DenseReluDense.wo"
DROPOUT = "decoder.block.1.layer.2.dropout"


def _t5_near_limit():
    """A T5 whose last decoder feed-forward `wo` outputs peak at ~40000-60000 (FP16 max 65504, never reached by wo
    itself): the following Dropout's 1/(1-p) = 1.43 rescale (p=0.3) takes the largest batches over the limit."""
    m = R.t5(dropout_rate=0.3)
    peaks = []
    wo = m.get_submodule(WO)
    h = wo.register_forward_hook(lambda mod, i, o: peaks.append(float(o.abs().max())))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        for _ in range(5):
            m(**R.batch("t5", g))
    h.remove()
    with torch.no_grad():
        wo.weight.mul_(40000.0 / float(np.median(peaks)))
    return m


def test_forward_overflow_names_the_producer(tmp):
    path, _ = run(tmp, "t5-wo", "t5", model=_t5_near_limit(), steps=12)
    found = ampdoctor.diagnose(path)
    d = {x.rule: x for x in found}["forward-overflow"]
    assert d.layers[0] == WO and d.evidence["tipped_over_by"] == [DROPOUT]
    tr = ampdoctor.load(path)
    col = list(tr.sites("act")["path"]).index(WO)
    peaks = tr.records("peak", "act")[:, col]
    top = float(np.nanmax(np.where(np.isfinite(peaks), peaks, np.nan)))
    assert d.evidence["max_finite_output"] == top and top > formats.FP16.max / 2
    assert d.evidence["headroom_factor"] == pytest.approx(formats.FP16.max / top)
    assert f"{formats.FP16.max / top:.3g}x" in d.summary
    # no other finding blames the Dropout first
    assert all(x.layers[:1] != [DROPOUT] for x in found)
    assert "only re-initialising the weights" in d.recommendation
    _scales_agree(path, found)
    line = _code(d.recommendation, r"^handle = ampdoctor\.keep_fp32\(")
    assert line == f'handle = ampdoctor.keep_fp32(model, "{WO}")  # these modules compute in FP32 inside autocast'
    fixed, losses = run(tmp, "t5-wo-fixed", "t5", model=_t5_near_limit(), steps=12, setup=_apply(line))
    assert all(math.isfinite(x) for x in losses)
    # what is left is the model fault the finding named: wo's weights, far off their fan-in scale
    assert [x.rule for x in serious(fixed)] == ["grad-range-anomaly"]
    assert serious(fixed)[0].layers[0] == WO
