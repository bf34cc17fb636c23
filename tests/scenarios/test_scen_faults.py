"""Fault-injection scenarios: a real CPU training run per fault; the rule fires, names the layer, nothing else does.

Each row: (scenario, the rule that must fire, the layer it must name first or None, rules that may also fire
because they describe the same fault from another side).
"""

import fault_runs as F
import pytest
import torch

import ampdoctor
from ampdoctor.rules import dynamics
from ampdoctor.rules.engine import Run


def init_scale_2_30(p):
    F.fit(F.mlp(), F.regression(40), 40, p, init_scale=2.0**30)


def attention_without_sqrt_d(p):
    F.fit(
        F.Transformer(scaled=False, emb_scale=100.0, prenorm=False),
        F.tokens(30),
        30,
        p,
        precision="fp16",
        loss_fn=F.ce,
        optimizer="adam",
        lr=1e-3,
    )


def nan_batches(p):
    def data():
        for i, (x, y) in enumerate(F.regression(40)):
            if i >= 5:
                x = x.clone()
                x[0, 0] = float("nan")  # a corrupt sample in every batch after the fifth
            yield x, y

    F.fit(F.mlp(), data(), 40, p)


def fp16_without_scaler_small_loss(p):
    F.fit(F.mlp(width=64), F.regression(40), 40, p, precision="fp16", scaler=False, loss_weight=1e-4)


def fp16_cnn_without_scaler(p):
    F.fit(F.CNN(), F.images(30), 30, p, precision="fp16", scaler=False, loss_fn=F.ce, loss_weight=1e-3)


def half_model_plain_sgd(p):
    F.fit(
        F.mlp(width=64).half(),
        F.regression(30, scale=10),
        30,
        p,
        precision="fp32",
        scaler=False,
        input_dtype=torch.float16,
        lr=0.001,
    )


def scaler_without_autocast(p):
    F.fit(F.mlp(width=64), F.regression(30), 30, p, precision="fp32", scaler=True)


def slow_dataset(p):
    F.fit(F.mlp(width=64), F.Slow(F.regression(20), 0.02), 20, p, precision="bf16")


def layer_initialised_too_large(p):
    m = F.mlp(width=64, depth=4)
    with torch.no_grad():
        m[4].weight.mul_(1e4)
    F.fit(m, F.regression(30), 30, p, precision="bf16", optimizer="adam", lr=1e-3)


def conv_initialised_too_large(p):
    m = F.CNN()
    with torch.no_grad():
        m.conv2.weight.mul_(3e3)
    F.fit(m, F.images(30), 30, p, precision="fp32", loss_fn=F.ce, optimizer="adam", lr=1e-3)


def loss_in_bf16(p):
    F.fit(
        F.mlp(width=64),
        F.regression(30),
        30,
        p,
        precision="bf16",
        loss_fn=lambda o, y: ((o - y.to(o.dtype)) ** 2).mean(),
    )


def loss_in_fp16(p):
    F.fit(
        F.mlp(width=64),
        F.regression(30),
        30,
        p,
        precision="fp16",
        loss_fn=lambda o, y: ((o - y.to(o.dtype)) ** 2).mean(),
    )


def batchnorm_in_bf16(p):
    m = F.CNN()
    m.bn1.to(torch.bfloat16)
    F.fit(m, F.images(30), 30, p, precision="bf16", loss_fn=F.ce, optimizer="adam", lr=1e-2)


SCENARIOS = [
    (init_scale_2_30, "init-scale-too-high", None, set()),
    (attention_without_sqrt_d, "forward-overflow", "blocks.0.attn", {"loss-scale-collapse"}),
    (attention_without_sqrt_d, "loss-scale-collapse", "blocks.0.attn", {"forward-overflow"}),
    (nan_batches, "loss-scale-collapse", None, set()),
    (fp16_without_scaler_small_loss, "grad-underflow", None, set()),
    (fp16_cnn_without_scaler, "grad-underflow", None, set()),
    (half_model_plain_sgd, "weight-update-lost", "0", {"grad-underflow"}),
    (scaler_without_autocast, "amp-inactive", None, set()),
    (slow_dataset, "input-pipeline-bound", None, set()),
    (layer_initialised_too_large, "grad-range-anomaly", "4", set()),
    (conv_initialised_too_large, "grad-range-anomaly", "conv2", {"fp16-readiness", "fp8-readiness"}),  # and FP16/FP8
    (loss_in_bf16, "precision-policy", None, set()),
    (loss_in_fp16, "precision-policy", None, set()),
    (batchnorm_in_bf16, "precision-policy", "bn1", {"weight-update-lost"}),  # its BF16 params lose updates too
]


@pytest.mark.parametrize("make, rule, layer, related", SCENARIOS, ids=[f"{r}-{m.__name__}" for m, r, _, _ in SCENARIOS])
def test_rule_fires_on_its_fault(make, rule, layer, related, trace_path):
    make(trace_path)
    by_rule, found = F.diagnose(trace_path)
    assert rule in by_rule, [d.rule for d in found]
    d = by_rule[rule]
    assert d.severity in ("warning", "critical")
    assert d.evidence and d.recommendation and d.summary
    if layer is not None:
        assert d.layers[0] == layer, d.layers
    unrelated = {x.rule for x in found} - {rule} - related
    assert not unrelated, [(x.rule, x.summary) for x in found if x.rule in unrelated]


def unnormalised_inputs_fp32(p):
    F.fit(
        F.mlp(width=64), ((x * 3e5, y) for x, y in F.regression(30)), 30, p, precision="fp32", optimizer="adam", lr=1e-3
    )


def test_fp16_readiness_names_the_layer_that_would_overflow(trace_path):
    unnormalised_inputs_fp32(trace_path)
    by_rule, found = F.diagnose(trace_path)
    assert [d.rule for d in found] == ["fp16-readiness"]
    d = by_rule["fp16-readiness"]
    assert d.severity == "info" and d.layers[0] == "0"
    assert d.evidence["overflow_modules"]["0"]["max"] > 65504
    assert 'ampdoctor.keep_fp32(model, "0"' in d.recommendation


def test_fp16_readiness_reports_underflow_at_the_scale_it_suggests(trace_path):
    # one conv 3000x too large: its gradients cap the usable scale, so others would underflow in FP16
    conv_initialised_too_large(trace_path)
    d = F.diagnose(trace_path)[0]["fp16-readiness"]
    assert d.evidence["suggested_scale"] < 2**16
    assert d.evidence["underflow_at_scale"] and max(d.evidence["underflow_at_scale"].values()) >= 0.01
    assert f"init_scale={d.evidence['suggested_scale']:.1f}" in d.recommendation


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ref") / "fp32.db")
    F.fit(F.mlp(width=64), F.regression(80), 80, path, precision="fp32", optimizer="adam", lr=1e-2)
    return path


def test_slow_convergence_against_a_reference(reference, trace_path):
    F.fit(F.mlp(width=64), F.regression(80), 80, trace_path, precision="fp16", optimizer="adam", lr=1e-3)
    found = F.diagnose(trace_path, reference=reference)[1]
    assert [d.rule for d in found] == ["slow-convergence"]
    d = found[0]
    assert d.evidence["ratio"] >= 1.5 and d.evidence["reference_lr"] == 0.01
    assert 'group["lr"] = 0.0012' in d.recommendation
    assert F.diagnose(trace_path)[1] == []  # without a reference there is no evidence: silent


def test_same_run_in_fp16_converges_like_the_reference(reference, trace_path):
    F.fit(F.mlp(width=64), F.regression(80), 80, trace_path, precision="fp16", optimizer="adam", lr=1e-2)
    assert F.diagnose(trace_path, reference=reference)[1] == []


# -- late-degradation ---------------------------------------------------------------------------------------------
# Adam on a noise-free regression whose loss weight (3e-6) puts the gradients where a large model's sit (~1e-7):
# a GradScaler left at init_scale=1.0 with the default growth_interval (2000, never reached in 300 steps) keeps them
# in FP16's subnormal range; as the fit improves they shrink and flush to zero, and the run stops improving while
# the FP32 reference goes on.
LATE = dict(optimizer="adam", lr=3e-3, loss_weight=3e-6)


def late_run(path, precision="fp16", **kw):
    F.fit(F.mlp(width=64), F.regression(300, noise=0.0), 300, path, precision=precision, **LATE, **kw)


@pytest.fixture(scope="module")
def late_reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("late") / "fp32.db")
    late_run(path, "fp32")
    return path


def test_late_degradation_scale_stuck_while_gradients_shrink(late_reference, trace_path):
    late_run(trace_path, init_scale=1.0)
    by_rule, found = F.diagnose(trace_path, reference=late_reference)
    assert set(by_rule) == {"late-degradation", "grad-underflow"}, [(d.rule, d.summary) for d in found]
    d = by_rule["late-degradation"]
    assert d.severity == "warning" and d.evidence["dynamic"] == "scale stuck while gradients shrink"
    assert d.evidence["against"] == "reference" and d.evidence["worsening_factor"] >= 1.25
    assert d.evidence["late_ci"][0] > d.evidence["early_ci"][1]  # the late trend is worse
    assert d.evidence["scale_in_force"] == 1.0 and d.evidence["headroom_binades_above_fp16_normal"] < 0
    assert 50 <= d.evidence["suggested_growth_interval"] < 2000
    assert f"growth_interval={d.evidence['suggested_growth_interval']}" in d.recommendation
    # without the reference a plateau is not evidence of degradation: only grad-underflow remains
    assert [x.rule for x in F.diagnose(trace_path)[1]] == ["grad-underflow"]


def test_late_degradation_silent_when_training_is_slow_from_the_start(tmp_path, trace_path):
    # the same stuck scale on a CNN: it never learns (grad-underflow), but there is no *late* break to report
    ref = str(tmp_path / "ref.db")
    F.fit(F.CNN(), F.images(200), 200, ref, precision="fp32", loss_fn=F.ce, **LATE)
    F.fit(F.CNN(), F.images(200), 200, trace_path, init_scale=1.0, loss_fn=F.ce, **LATE)
    assert [d.rule for d in F.diagnose(trace_path, reference=ref)[1]] == ["grad-underflow"]


def late_skip_cycles(p, init_scale=16.0, growth_interval=10):
    # a growth_interval of 10 from a low start: the scale reaches the overflow limit only at step ~150 and from
    # there cycles (grow, overflow, skip, halve) for the rest of the run
    F.fit(
        F.mlp(width=64),
        F.regression(300),
        300,
        p,
        optimizer="adam",
        lr=1e-3,
        init_scale=init_scale,
        growth_interval=growth_interval,
    )


def test_late_skip_cycles_are_recognised_but_not_reported_without_degradation(trace_path):
    # The skip-cycle dynamic on a real run. On a CPU-sized run cycles cost one step in growth_interval + 1 (8% here)
    # and the loss does not degrade, so late-degradation stays silent: it reports a dynamic only as the cause of a
    # trend break it has established.
    late_skip_cycles(trace_path)
    why = dynamics.explain(Run(ampdoctor.load(trace_path)), cut_step=150)
    assert why["dynamic"] == "repeated overflow/skip cycles"
    assert why["early_skip_share"] == 0 and why["late_skip_share"] > 0.05 and why["late_growths"] >= 2
    assert why["suggested_growth_interval"] == 500 and why["suggested_init_scale"] >= 2**16
    assert F.diagnose(trace_path)[1] == []


def test_skip_cycles_all_along_are_neither_a_late_cause_nor_a_high_init_scale(trace_path):
    # growth_interval=2: the scale cycles from the first steps on (30% skipped), upwards from init_scale
    F.fit(F.mlp(width=64), F.regression(200), 200, trace_path, optimizer="adam", lr=1e-3, growth_interval=2)
    run = Run(ampdoctor.load(trace_path))
    assert run.steps["skipped"].mean() > 0.2
    assert dynamics.explain(run, cut_step=100) is None
    assert "init-scale-too-high" not in F.diagnose(trace_path)[0]


def test_loss_scale_collapse_silent_for_a_low_start_that_backs_off_later(tmp_path):
    """init_scale=1 grows (growth_interval 3) and then backs off from high scales: a healthy scaler, no collapse."""
    from runs import mlp, train

    import ampdoctor

    path = str(tmp_path / "low_start.db")
    train(mlp(width=64), 100, init_scale=1.0, growth_interval=3, trace=path)
    st = ampdoctor.load(path).steps()
    assert st["skipped"].any() and st["loss_scale"].iloc[0] == 1.0
    assert st.loc[st["skipped"], "loss_scale_next"].min() > 1.0
    assert "loss-scale-collapse" not in [f.rule for f in ampdoctor.diagnose(path)]


def test_calibrating_scaler_read_live_is_not_a_collapse(trace_path):
    """A trace read while a 2^30 init_scale is still backing off (every step so far skipped, as a live check or
    `serve` sees it in the first seconds) is not a loss-scale collapse."""
    F.fit(F.mlp(), F.regression(6), 6, trace_path, init_scale=2.0**30)
    st = ampdoctor.load(trace_path).steps()
    assert st["skipped"].all() and st["loss_scale_next"].min() > 1.0
    assert "loss-scale-collapse" not in F.diagnose(trace_path)[0]
