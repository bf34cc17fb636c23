"""The anomaly replay: a one-off fault on a step that observed no site is replayed, observed in full down to the
operation, and nothing in training changes."""

import math

import pytest
import torch
from anomaly_models import OUTLIER_STEP, classifier, train

import ampdoctor


def _events(path, kind):
    return ampdoctor.load(path).events(kind)


def test_a_one_off_forward_overflow_on_a_sentinel_step_is_replayed_down_to_the_operation(trace_path):
    """One outlier batch (16x) makes exp overflow inside ExpHead's own forward; the scaler skips the step. The step is
    replayed exactly (the scaler skipped it: the weights are the step's own) and the trace says what, where, how."""
    train(classifier(), 50, outlier={OUTLIER_STEP: 16.0}, trace=trace_path, live=False)
    tr = ampdoctor.load(trace_path)
    row = tr.steps().set_index("step").loc[OUTLIER_STEP]
    assert row["skipped"] and row["nonfinite"] and row["reason"] == "replay" and row["level"] == 2
    replay = _events(trace_path, "replay").set_index("step").loc[OUTLIER_STEP, "data"]
    assert replay["exact"] and replay["reproduced"] and replay["backward"] and not replay["outputs_finite"]
    assert not replay["loss_made_it"]  # the model's own forward made the NaN, not the loss
    op = _events(trace_path, "operation").set_index("step").loc[OUTLIER_STEP]
    assert op["data"]["op"] == "aten::exp" and op["data"]["module"] == "2" and op["path"] == "2"
    assert "e = torch.exp(z)" in op["data"]["line"] and op["data"]["phase"] == "fwd"
    assert op["data"]["inputs"][0]["absmax"] > 11.09  # exp's argument beyond FP16's reach (log 65504)
    assert math.isfinite(op["data"]["inputs"][0]["absmax"])
    # the batch: 6x the usual peak, fingerprinted
    batch = replay["batch"]
    assert batch["outlier"] and 8 < batch["factor"] < 30 and batch["inputs"][0]["shape"] == [32, 16]
    assert len(batch["inputs"][0]["sha1"]) == 16
    # the precision changes tried on the failing step: keeping ExpHead in FP32 removes the NaN, BF16 too
    checks = {c["fix"]: c for c in replay["checks"]}
    assert checks["keep_fp32"]["modules"] == ["2"] and checks["keep_fp32"]["finite"]
    assert checks["bf16"]["finite"]
    # the writer located the step's first non-finite output like any observed step's
    nf = _events(trace_path, "nonfinite").set_index("step")
    assert nf.loc[OUTLIER_STEP, "path"] == "2" and nf.loc[OUTLIER_STEP, "phase"] == "fwd"
    assert not len(_events(trace_path, "nonfinite_unknown"))
    # the replay's full observation of every site is the step's record: the head's output holds NaN (inf / inf)
    acts = list(tr.sites("act")["path"])
    nan = tr.records("nan", kind="act")
    assert nan[OUTLIER_STEP, acts.index("2")] > 0 and nan[OUTLIER_STEP, acts.index("0")] == 0
    assert OUTLIER_STEP in set(tr.full_steps())


def test_a_value_made_inside_a_module_is_blamed_on_that_module_not_the_child_that_tipped_it(trace_path):
    """Gated's own product runs near 65504; its Dropout's 1/(1-p) tips it over. The operation found is Dropout's
    multiplication, the values were made by Gated's own mul: the producer."""

    def near_limit(model):
        with torch.no_grad():  # up(x) * gate(x) up to ~61000 on the outlier batch (46x), ~30 on the others
            model[2].up.weight.mul_(9.0)
            model[2].gate.weight.mul_(9.0)

    # lr 0: the weights at the outlier step are the initial ones, not 37 steps of FP16 training that round
    # differently on different CPUs' kernels (they moved this product by ~12%, and Dropout tips only [52403, 65504])
    outlier = {OUTLIER_STEP: 46.0}
    train(classifier(head="gated"), 45, outlier=outlier, trace=trace_path, before=near_limit, lr=0.0, live=False)
    op = _events(trace_path, "operation").set_index("step").loc[OUTLIER_STEP, "data"]
    assert op["module"] == "2.drop"  # where the Inf appeared
    producer = op["producers"][0]
    assert producer["op"] == "aten::mul" and producer["module"] == "2"
    assert "self.up(x) * self.gate(x)" in producer["line"]
    checks = {c["fix"]: c for c in _events(trace_path, "replay").set_index("step").loc[OUTLIER_STEP, "data"]["checks"]}
    # keeping Gated in FP32 alone does not help (the next Linear casts its FP32 output straight back to FP16): the
    # island grew by that Linear, where the forward overflowed next
    assert checks["keep_fp32"]["modules"] == ["2", "3"] and checks["keep_fp32"]["forward_finite"]
    assert checks["bf16"]["finite"]


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_training_with_replays_is_bit_identical(tmp_path, precision):
    """A model with BatchNorm and Dropout; an outlier batch at a sentinel step (FP16: a NaN, the scaler skips it;
    BF16/FP32: a loss and gradient-norm spike, replayed before the optimizer applies it). Parameters, losses and
    the loss scale end exactly as without ampdoctor, and the replays did run."""
    kw = {"outlier": {OUTLIER_STEP: 16.0 if precision == "fp16" else 30.0}, "precision": precision}
    ref, ref_losses, ref_scaler = train(classifier(norm=True), 45, **kw)
    got, losses, scaler = train(classifier(norm=True), 45, trace=str(tmp_path / "t.db"), live=False, **kw)
    assert [repr(v) for v in losses] == [repr(v) for v in ref_losses]  # (NaN at the outlier step too)
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), got.state_dict().values()))
    assert scaler.get_scale() == ref_scaler.get_scale()
    replays = _events(str(tmp_path / "t.db"), "replay")
    assert OUTLIER_STEP in set(replays["step"])
    data = replays.set_index("step").loc[OUTLIER_STEP, "data"]
    assert data["exact"], data["not_exact"]  # FP16: skipped; BF16/FP32: replayed before the update


def test_heal_keeps_a_run_with_a_recurring_overflow_going(trace_path):
    """An outlier every 7 steps overflows ExpHead's exp in FP16 (an FP32 exp does not). With heal=True, once two
    replays confirmed that keeping ExpHead in FP32 removes the NaN, it is kept in FP32: the later outliers pass."""
    outliers = {s: 28.0 for s in range(15, 80, 7)}
    _, losses, _ = train(classifier(), 80, outlier=outliers, trace=trace_path, heal=True, live=False)
    heal = _events(trace_path, "heal")
    assert list(heal["data"].map(lambda d: d["module"])) == ["2"]
    healed_at = int(heal["step"].iloc[0])
    st = ampdoctor.load(trace_path).steps().set_index("step")
    later = [s for s in outliers if s > healed_at]
    assert later and not st.loc[later, "nonfinite"].any() and not st.loc[later, "skipped"].any()
    assert all(math.isfinite(v) for v in losses[healed_at + 1 :])
    d = {x.rule: x for x in ampdoctor.diagnose(trace_path)}["healed"]
    assert d.layers == ["2"] and d.evidence["from_step"] == healed_at + 1 and len(d.evidence["confirmed_on"]) >= 2
    assert d.fix[0].text.startswith('handle = ampdoctor.keep_fp32(model, "2")')
    # without heal, the same run keeps skipping those steps
    _, _, _ = train(classifier(), 80, outlier=outliers, trace=trace_path + "2", live=False)
    st2 = ampdoctor.load(trace_path + "2").steps().set_index("step")
    assert st2.loc[later, "skipped"].all()
