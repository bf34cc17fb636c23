"""The medicine: apply the recommended fix exactly as printed, re-run, and the finding is gone (run healthy)."""

import math
import re

import fault_runs as F
import test_scen_faults as S
import torch

import ampdoctor


def _code_lines(text, pattern):
    return [ln for ln in text.splitlines() if re.search(pattern, ln)]


def _printed_scaler(rec):
    """The GradScaler line of a recommendation, executed: (init_scale, growth_interval)."""
    line = _code_lines(rec, r"^scaler = torch\.amp\.GradScaler\(")[0]
    ns = {"torch": torch}
    exec(line, ns)
    return ns["scaler"].get_scale(), ns["scaler"].get_growth_interval()


def test_init_scale_fix(trace_path, tmp_path):
    S.init_scale_2_30(trace_path)
    d = F.diagnose(trace_path)[0]["init-scale-too-high"]
    init, growth = _printed_scaler(d.recommendation)
    assert init == d.evidence["suggested_init_scale"] < 2**30
    fixed = str(tmp_path / "fixed.db")
    F.fit(F.mlp(), F.regression(40), 40, fixed, init_scale=init, growth_interval=growth)
    assert F.diagnose(fixed)[1] == []


def test_grad_underflow_fix(trace_path, tmp_path):
    S.fp16_without_scaler_small_loss(trace_path)
    d = F.diagnose(trace_path)[0]["grad-underflow"]
    init, growth = _printed_scaler(d.recommendation)
    assert "scaler.scale(loss).backward()" in d.recommendation
    fixed = str(tmp_path / "fixed.db")
    F.fit(
        F.mlp(width=64),
        F.regression(40),
        40,
        fixed,
        precision="fp16",
        scaler=True,
        init_scale=init,
        growth_interval=growth,
        loss_weight=1e-4,
    )
    # healthy: no warning; at most advice that the smallest elements stay subnormal (nothing flushed)
    found = F.diagnose(fixed)[1]
    assert F.serious(found) == [] and all(
        d.evidence["flushed_share_worst"] == 0.0 for d in found if d.rule == "grad-underflow"
    )


def test_weight_update_lost_fix(trace_path, tmp_path):
    S.half_model_plain_sgd(trace_path)
    d = F.diagnose(trace_path)[0]["weight-update-lost"]
    assert 'torch.autocast(device_type="cpu", dtype=torch.float16)' in d.recommendation
    # the printed set-up, executed as printed: FP32 parameters, the run's own optimizer over them, the scaler
    setup = _code_lines(d.recommendation, r"^(model\.float\(\)|optimizer = torch\.optim\.|scaler = torch\.amp\.)")
    assert [ln.split(" ")[0] for ln in setup] == ["model.float()", "optimizer", "scaler"]
    ns = {"torch": torch, "model": F.mlp(width=64).half()}
    exec("\n".join(setup), ns)
    model, opt = ns["model"], ns["optimizer"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["lr"] == 0.001  # what the run used
    fixed = str(tmp_path / "fixed.db")
    F.fit(model, F.regression(30, scale=10), 30, fixed, precision="fp16", scaler=ns["scaler"], optimizer=opt)
    assert F.diagnose(fixed)[1] == []


def test_amp_inactive_fix(trace_path, tmp_path):
    S.scaler_without_autocast(trace_path)
    d = F.diagnose(trace_path)[0]["amp-inactive"]
    assert 'with torch.autocast(device_type="cpu", dtype=torch.float16):' in d.recommendation
    fixed = str(tmp_path / "fixed.db")
    F.fit(F.mlp(width=64), F.regression(30), 30, fixed, precision="fp16", scaler=True)
    assert F.diagnose(fixed)[1] == []


def test_grad_range_anomaly_fix(trace_path, tmp_path):
    S.layer_initialised_too_large(trace_path)
    d = F.diagnose(trace_path)[0]["grad-range-anomaly"]
    line = _code_lines(d.recommendation, r"^torch\.nn\.init\.")[0]
    model = F.mlp(width=64, depth=4)
    with torch.no_grad():
        model[4].weight.mul_(1e4)
        exec(line, {"torch": torch, "math": math, "model": model})
    fixed = str(tmp_path / "fixed.db")
    F.fit(model, F.regression(30), 30, fixed, precision="bf16", optimizer="adam", lr=1e-3)
    assert F.diagnose(fixed)[1] == []


def test_precision_policy_fixes(trace_path, tmp_path):
    S.loss_in_bf16(trace_path)
    d = F.diagnose(trace_path)[0]["precision-policy"]
    assert "loss = loss_fn(out.float(), y)" in d.recommendation
    fixed = str(tmp_path / "fixed.db")
    F.fit(
        F.mlp(width=64),
        F.regression(30),
        30,
        fixed,
        precision="bf16",
        loss_fn=lambda out, y: ((out.float() - y) ** 2).mean(),
    )
    assert F.diagnose(fixed)[1] == []

    bn = str(tmp_path / "bn.db")
    S.batchnorm_in_bf16(bn)
    d = F.diagnose(bn)[0]["precision-policy"]
    line = _code_lines(d.recommendation, r"^model\.bn1\.float\(\)$")[0]
    model = F.CNN()
    model.bn1.to(torch.bfloat16)
    exec(line, {"model": model})
    fixed = str(tmp_path / "bn-fixed.db")
    F.fit(model, F.images(30), 30, fixed, precision="bf16", loss_fn=F.ce, optimizer="adam", lr=1e-2)
    assert F.diagnose(fixed)[1] == []


def test_late_degradation_fix(trace_path, tmp_path):
    ref = str(tmp_path / "ref.db")
    S.late_run(ref, "fp32")
    S.late_run(trace_path, init_scale=1.0)
    d = F.diagnose(trace_path, reference=ref)[0]["late-degradation"]
    init, growth = _printed_scaler(d.recommendation)
    assert growth == d.evidence["suggested_growth_interval"] < 2000
    fixed = str(tmp_path / "fixed.db")
    S.late_run(fixed, init_scale=init, growth_interval=growth)
    assert F.diagnose(fixed, reference=ref)[1] == []


def test_late_skip_cycles_fix(trace_path, tmp_path):
    S.late_skip_cycles(trace_path)
    why = S.dynamics.explain(S.Run(S.ampdoctor.load(trace_path)), cut_step=150)
    fixed = str(tmp_path / "fixed.db")
    S.late_skip_cycles(fixed, init_scale=why["suggested_init_scale"], growth_interval=why["suggested_growth_interval"])
    assert S.dynamics.explain(S.Run(S.ampdoctor.load(fixed)), cut_step=150) is None
    assert F.diagnose(fixed)[1] == []


def _qk_too_large():
    """Attention without 1/sqrt(d) whose query and key weights start 100x too large: q @ k^T overflows FP16."""
    model = F.Transformer(scaled=False, prenorm=True)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q.weight.mul_(100.0)
            block.attn.k.weight.mul_(100.0)
    return model


def _fit_tokens(model, path):
    return F.fit(model, F.tokens(30), 30, path, precision="fp16", loss_fn=F.ce, optimizer="adam", lr=1e-3)


def test_forward_overflow_fix(trace_path, tmp_path):
    """The printed keep_fp32 line, executed on a fresh copy of the model, removes the overflow; what remains is the
    fault's cause, named by its own rule (the q/k weights off their fan-in scale), and its printed fix, applied
    too, leaves a run with no finding at all."""
    _fit_tokens(_qk_too_large(), trace_path)
    d = F.diagnose(trace_path)[0]["forward-overflow"]
    keep = _code_lines(d.recommendation, r"^handle = ampdoctor\.keep_fp32\(model, ")
    assert all(f'"{layer}"' in keep[0] for layer in d.layers)
    ns = {"ampdoctor": ampdoctor, "torch": torch, "math": math, "model": _qk_too_large()}
    exec(keep[0], ns)
    _, losses = _fit_tokens(ns["model"], str(tmp_path / "kept.db"))
    by_rule, found = F.diagnose(str(tmp_path / "kept.db"))
    assert all(math.isfinite(v) for v in losses)
    assert [f.rule for f in F.serious(found)] == ["grad-range-anomaly"]
    scaled = {f"blocks.{i}.attn.{n}" for i in range(2) for n in "qk"}
    assert set(by_rule["grad-range-anomaly"].layers) == scaled
    ns["handle"].remove()

    init = _code_lines(by_rule["grad-range-anomaly"].recommendation, r"^torch\.nn\.init\.")
    ns = {"ampdoctor": ampdoctor, "torch": torch, "math": math, "model": _qk_too_large()}
    with torch.no_grad():
        exec("\n".join(keep + init), ns)
    fixed = str(tmp_path / "fixed.db")
    _fit_tokens(ns["model"], fixed)
    assert F.diagnose(fixed)[1] == []
    ns["handle"].remove()


def test_slow_convergence_fix(trace_path, tmp_path):
    """FP16 run at a tenth of the FP32 reference's learning rate: the printed lr line, applied, closes the gap."""
    ref = str(tmp_path / "ref.db")
    F.fit(F.mlp(width=64), F.regression(80), 80, ref, precision="fp32", optimizer="adam", lr=1e-2)
    F.fit(F.mlp(width=64), F.regression(80), 80, trace_path, precision="fp16", optimizer="adam", lr=1e-3)
    d = F.diagnose(trace_path, reference=ref)[0]["slow-convergence"]
    line = _code_lines(d.recommendation, r'^\s+group\["lr"\] = ')[0]
    group = {"lr": 1e-3}
    exec(line.strip(), {"group": group})
    assert group["lr"] == 0.01
    fixed = str(tmp_path / "fixed.db")
    F.fit(F.mlp(width=64), F.regression(80), 80, fixed, precision="fp16", optimizer="adam", lr=group["lr"])
    assert F.diagnose(fixed, reference=ref)[1] == []


def test_nan_batches_filter_as_printed(trace_path, tmp_path):
    """The corrupt-batch filter of loss-scale-collapse, pasted whole (its text names `loader` as the user's data
    loader), skips the NaN batches: the run trains without a skipped step after calibration."""
    S.nan_batches(trace_path)
    d = F.diagnose(trace_path)[0]["loss-scale-collapse"]
    (block,) = [p.text for p in d.fix if p.kind == "code"]
    assert "`loader` stands for your data loader" in d.recommendation

    def data():
        for i, (x, y) in enumerate(F.regression(60)):
            if i >= 5:
                x = x.clone()
                x[0, 0] = float("nan")
            yield x, y

    ns = {"torch": torch, "loader": data()}
    exec(block, ns)
    batches = list(ns["loader"])
    assert len(batches) == 5 and all(torch.isfinite(x).all() for x, _ in batches)
    fixed = str(tmp_path / "fixed.db")
    F.fit(F.mlp(), iter(batches * 4), 20, fixed)
    assert F.diagnose(fixed)[1] == []
