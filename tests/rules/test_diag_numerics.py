"""Numerics the rules and the replay must share (issue 10): one definition of the largest unscaled gradient, the
replay's ties, a layer whose FP16 gradient is flushed entirely (told from a dead ReLU by evidence), and rule
dependencies through the engine. Real CPU training runs."""

import importlib

import fault_runs as F
import numpy as np
import pytest
import torch

import ampdoctor

replay = importlib.import_module("ampdoctor.lossscale")


# -- one definition of "the largest unscaled gradient" -------------------------------------------------------------
def big_inputs(n):
    """Inputs 30x larger than usual: the first layer's weight gradient (x^T @ grad_out) is far larger than any
    output gradient, so only a definition that includes parameter gradients sees what overflowed."""
    for x, y in F.regression(n):
        yield x * 30.0, y


def test_init_scale_rule_and_replay_share_the_largest_gradient(tmp_path):
    path = str(tmp_path / "big.db")
    F.fit(F.mlp(), big_inputs(30), 30, path, init_scale=2.0**24, lr=1e-3)
    d = {x.rule: x for x in ampdoctor.diagnose(path)}["init-scale-too-high"]
    tr = ampdoctor.load(path)
    st = tr.steps()
    peaks = replay.gradient_peaks(tr)
    clean = ~st["skipped"].to_numpy() & ~peaks.nonfinite
    scale = st["loss_scale"].to_numpy()[:, None]
    out_only = float(np.nanmax((tr.records("peak", "grad_out") / scale)[clean]))
    both = float(np.nanmax(peaks.fp16_equivalent[clean]))
    assert both > 4 * out_only  # the parameter gradients are what overflows here
    assert d.evidence["max_unscaled_grad"] == pytest.approx(both)
    suggested = d.evidence["suggested_init_scale"]
    assert suggested == replay.suggest(path).settings["init_scale"]
    # never a scale at which the run itself overflowed
    assert suggested < st.loc[st["skipped"], "loss_scale"].min()
    fixed = str(tmp_path / "fixed.db")
    F.fit(F.mlp(), big_inputs(30), 30, fixed, init_scale=suggested, lr=1e-3)
    assert not ampdoctor.load(fixed).steps()["skipped"].any()


def test_suggest_ties_keep_the_runs_own_factors(tmp_path):
    # a start at 2^30 skips its first steps; every (growth, backoff) pair that starts low enough loses the same
    path = str(tmp_path / "init.db")
    F.fit(F.mlp(), F.regression(30), 30, path, init_scale=2.0**30)
    s = replay.suggest(path, search_factors=True)
    assert s.improves and s.replay.n_skipped == 0
    assert (s.settings["growth_factor"], s.settings["backoff_factor"]) == (2.0, 0.5)


# -- a layer whose FP16 gradient is flushed to zero entirely ----------------------------------------------------------
@pytest.mark.parametrize("scaler", [True, False])
def test_gradient_flushed_entirely_is_critical(scaler, trace_path):
    # loss weight 1e-14: even at 2^16 every FP16 gradient lies below 2^-24 and is flushed to zero
    F.fit(F.mlp(width=32), F.regression(12), 12, trace_path, scaler=scaler, loss_weight=1e-14)
    tr = ampdoctor.load(trace_path)
    zeros, n = tr.records("zeros", "grad_out"), tr.records("numel", "grad_out")
    half = (tr.sites("grad_out")["dtype"] == "float16").to_numpy()
    fs = tr.full_steps()
    assert (zeros[np.ix_(fs, half)] == n[np.ix_(fs, half)]).all()  # all flushed: nothing left subnormal
    d = {x.rule: x for x in ampdoctor.diagnose(trace_path)}["grad-underflow"]
    assert d.severity == "critical"
    assert d.evidence["vanished"] and not d.evidence["dead_not_underflow"]
    assert "flushed to zero entirely" in d.summary


def dead_relu_mlp():
    """The second hidden layer's bias at -100: its ReLU outputs only zeros, so the layer before it gets an all-zero
    gradient at any scale (a dead ReLU, not underflow)."""
    m = F.mlp(width=32)
    with torch.no_grad():
        m[2].bias.fill_(-100.0)
    return m


@pytest.mark.parametrize("scaler", [True, False])
def test_dead_relu_is_not_underflow(scaler, trace_path):
    F.fit(dead_relu_mlp(), F.regression(12), 12, trace_path, scaler=scaler)
    found = ampdoctor.diagnose(trace_path)
    for d in found:
        if d.rule == "grad-underflow":
            assert "2" not in d.evidence["vanished"] and d.severity != "critical"
            assert any(x.startswith("2 ") for x in d.evidence["dead_not_underflow"])
    assert all(d.severity != "critical" for d in found), [(d.rule, d.summary) for d in found]


# -- suppression is declared on the registry entry; disabling a rule hides its findings only --------------------------
def test_slow_convergence_sees_grad_underflow_as_the_user_configured_it(tmp_path):
    ref, path = str(tmp_path / "ref.db"), str(tmp_path / "run.db")
    F.fit(F.mlp(width=64), F.regression(80), 80, ref, precision="fp32", optimizer="adam", lr=1e-2)
    # FP16 without a scaler: underflow (a warning) and a slower fit than the reference (a tenth of its lr)
    F.fit(F.mlp(width=64), F.regression(80), 80, path, scaler=False, optimizer="adam", lr=1e-3)
    default = {d.rule: d for d in ampdoctor.diagnose(path, reference=ref)}
    assert default["grad-underflow"].severity == "warning" and "slow-convergence" not in default
    # disabled: not shown, still computed, so it still explains the slow convergence
    assert ampdoctor.diagnose(path, reference=ref, rules={"grad-underflow": None}) == []
    # re-thresholded until it finds nothing: nothing explains the gap any more
    found = {d.rule for d in ampdoctor.diagnose(path, reference=ref, rules={"grad-underflow": {"min_share": 0.5}})}
    assert "slow-convergence" in found and "grad-underflow" not in found


def test_disabling_divergence_hides_only_divergence(trace_path):
    """issue 19: an SGD run at lr=2.0 diagnoses [divergence]; with divergence disabled, the rules it suppresses
    (loss-scale-collapse, forward-overflow, ...) stay suppressed: the diagnosis is empty, not a wrong one."""
    F.fit(F.mlp(), F.regression(20), 20, trace_path, lr=2.0)
    assert [d.rule for d in ampdoctor.diagnose(trace_path)] == ["divergence"]
    assert ampdoctor.diagnose(trace_path, rules={"divergence": None}) == []
    # what divergence suppresses is there, computed: the declared suppression hides it
    from ampdoctor.rules.engine import Run

    run = Run(ampdoctor.load(trace_path), rules={"divergence": None})
    hidden = [r for r in ("loss-scale-collapse", "forward-overflow") if run.findings_of(r)]
    assert hidden, "the fault's other findings should exist, hidden by the suppression"


# -- evidence text that reads right ------------------------------------------------------------------------------------
def test_forward_overflow_text_when_the_module_never_had_a_finite_output(trace_path):
    m = F.mlp(width=32)
    with torch.no_grad():
        m[0].weight.mul_(1e6)  # its FP16 output is Inf on every step
    F.fit(m, F.regression(8), 8, trace_path)
    d = {x.rule: x for x in ampdoctor.diagnose(trace_path)}["forward-overflow"]
    assert d.layers[0] == "0" and d.evidence["max_finite_output"] is None
    assert " - " not in d.summary and "never produced a finite output" in d.summary


# -- divergence with an optimizer whose step follows the gradient's size -------------------------------------------
def test_sgd_divergence_fix_with_clipping_as_printed(trace_path, tmp_path):
    F.fit(F.mlp(), F.regression(20), 20, trace_path, lr=2.0)  # SGD, a learning rate far too high
    found = ampdoctor.diagnose(trace_path)
    assert [d.rule for d in found] == ["divergence"], [(d.rule, d.summary) for d in found]
    d = found[0]
    assert d.evidence["optimizer"] == "SGD" and not d.evidence["adaptive_optimizer"]
    lines = d.recommendation.splitlines()
    setup = "\n".join(
        ln
        for i, ln in enumerate(lines)
        if ln.startswith(("for group", "scheduler = "))
        or (ln.startswith("    ") and lines[i - 1].startswith("for group"))
    )
    clip = "\n".join(ln for ln in lines if ln.startswith(("scaler.unscale_(", "torch.nn.utils.clip_grad_norm_(")))
    assert "max_norm=1.0" in clip
    # the fix exactly as printed: the lines before the loop once, the clipping lines before every optimizer step
    model = F.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
    scaler = torch.amp.GradScaler("cpu")
    ns = {"torch": torch, "model": model, "optimizer": optimizer, "scaler": scaler}
    exec(setup, ns)
    fixed = str(tmp_path / "fixed.db")
    with ampdoctor.attach(model, optimizer=optimizer, scaler=scaler, trace=fixed, **F.FAST):
        for x, y in F.regression(20):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(F.mse(out, y)).backward()
            exec(clip, ns)
            scaler.step(optimizer)
            scaler.update()
            ns["scheduler"].step()
    assert [x for x in ampdoctor.diagnose(fixed) if x.severity != "info"] == []


# -- grad-underflow's severity follows the gradient norm actually lost -------------------------------------------
def test_healthy_classifier_logits_flushing_immaterially_is_not_a_warning(tmp_path):
    """A healthy FP16 classifier with plain cross-entropy: once it is confident, the logit gradients of the unlikely
    classes (p / batch ~ 1e-9) flush even at the scale in force. That removes ~1e-10 of the gradient's norm, less
    than FP16's rounding of the largest elements: advice, never a warning that fails a CI gate."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    path = str(tmp_path / "clf.db")
    g = torch.Generator().manual_seed(0)
    with ampdoctor.attach(
        model, optimizer=opt, scaler=scaler, trace=path, every=10, hist_every=50, calibration=0, live=False
    ):  # histograms of the confident model, not of its first steps
        for _ in range(300):
            i = torch.randint(0, len(x), (64,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x[i]).float(), y[i])
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    found = {d.rule: d for d in ampdoctor.diagnose(path)}
    d = found.get("grad-underflow")
    assert d is not None and d.evidence["flushed_share_worst"] >= 0.01  # the logits do flush: the case at hand
    assert d.severity == "info"
    assert d.evidence["lost_norm_bound_worst"] < 2.0**-11
    assert not [f for f in found.values() if f.severity != "info"]
