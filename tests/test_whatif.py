"""The format what-if against real torch casts: exact round-to-nearest boundaries value by value, and the shares
derived from a real run's histograms (delayed scaling, loss scale) against casting the tensors that run produced."""

import os
import sys

import numpy as np
import probe_models as M
import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor import whatif as W
from ampdoctor.rules import fp8 as R

sys.path.append(os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
# (the casts, values, model and comparison benchmarks/device_check.py's section 6 checks on a GPU)
from device_fp8 import DTYPES, boundary_values, compare, real_loss, wide_model


@pytest.mark.parametrize("name", list(DTYPES))
def test_value_boundaries_match_real_casts(name):
    y = boundary_values(name)
    over, flushed = real_loss(y, name)
    w_over, w_flush = W.lost(y.numpy(), W.FORMATS[name])
    assert np.array_equal(w_over, over.numpy()) and np.array_equal(w_flush, flushed.numpy())
    assert over.any() and flushed.any() and (~over & ~flushed).any()


# steps of the wide run: the FP8 verdicts judge steps whose delayed scale rests on whatif.MIN_HELD amax values
STEPS = W.MIN_HELD + 8


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory):
    """FP16 autocast + GradScaler growing its scale every 2 steps (lr 0: the tensors keep their distribution);
    every step's histogram, and the tensors themselves captured by our own hooks."""
    model, acts, grads, data = wide_model(STEPS)
    path = str(tmp_path_factory.mktemp("whatif") / "wide.db")
    M.train(
        model,
        iter(data),
        STEPS,
        path,
        lr=0.0,
        attach_options={"every": 1, "hist_every": 1, "live": False},
        scaler_options={"init_scale": 1024.0, "growth_interval": 2},
    )  # a scale that changes
    return path, acts, grads


def _check(df, tensors, stored_scale, name):
    """Every histogram step's real cast loses a count within ampdoctor's [lo, hi]; the number of exact intervals."""
    _, exact, _, misses = compare(df, tensors, stored_scale, name)
    assert not misses, (name, misses[:5])
    return exact


def test_fp8_shares_from_histograms_match_real_casts(wide_run):
    path, acts, grads = wide_run
    tr = ampdoctor.load(path)
    steps = tr.steps()
    ones = np.ones(len(steps))
    df = W.site_whatif(tr, "0", "act")
    assert len(df) == STEPS and (df["history"].iloc[1:] > 0).all()
    # the delayed-scaling recipe, from the captured tensors: 448 / max(amax of earlier steps), 1.0 at first
    amax = [float(a.abs().max()) for a in acts]
    assert df["e4m3_scale"].tolist() == pytest.approx([1.0] + [448 / max(amax[:t]) for t in range(1, STEPS)])
    # the span in binades, from the tensors: floor(log2 |x|) by frexp (exact), largest minus smallest, plus one
    for row in df.itertuples():
        a = acts[row.step].abs()
        e = np.frexp(a[a > 0].numpy())[1] - 1
        assert row.span == e.max() - e.min() + 1
    exact = sum(_check(df, acts, ones, n) for n in ("e4m3", "e5m2", "fp16", "bf16"))
    assert exact >= 60  # most intervals are single numbers (empty boundary binade or abs max)
    assert df["e4m3_flush_lo"].iloc[1:].median() > R.MIN_LOST  # E4M3 is too short for these activations
    # output gradients: stored scaled by the loss scale, cast unscaled times the recipe's scale
    gdf = W.site_whatif(tr, "1", "grad_out")
    ls = steps["loss_scale"].to_numpy(float)
    assert {1024.0, 2048.0} <= set(ls)  # it grows every 2 steps, and backs off when a weight gradient overflows
    _check(gdf, grads, ls, "e5m2")
    _check(gdf, grads, ones, "fp16")


def test_fp8_readiness_names_the_wide_layer_and_the_settings_that_keep_it(wide_run):
    path, _, _ = wide_run
    found = {d.rule: d for d in ampdoctor.diagnose(path)}
    d = found["fp8-readiness"]
    assert d.severity == "info" and d.layers[0] == "0"
    ev = d.evidence["layers"]["0 (act)"]
    assert ev["format"] == "e4m3" and ev["flushed"] > R.MIN_LOST
    best = ev["best"]
    assert best["lost"] < R.MIN_LOST
    # the settings it prints, applied in the what-if, keep the layer
    df = W.site_whatif(ampdoctor.load(path), "0", "act", history=best["history"], margin=best["margin"])
    d2 = W.judged(df)
    assert np.median(d2[f"{best['format']}_sat_lo"] + d2[f"{best['format']}_flush_lo"]) < R.MIN_LOST
    assert "E5M2" in d.recommendation and "0 (act)" in d.recommendation


def test_healthy_run_is_fp8_ready(tmp_path):
    path = str(tmp_path / "h.db")
    M.train(M.cnn(), M.images(12), 12, path, loss_fn=M.ce, attach_options={"every": 2, "hist_every": 2})
    assert "fp8-readiness" not in {d.rule for d in ampdoctor.diagnose(path)}
    table = W.formats_table(ampdoctor.load(path))
    assert len(table) >= 8 and (table["e4m3_lost"].fillna(0) < R.MIN_LOST).all()
    assert (table[table["kind"] == "act"]["fp16_headroom"] > 5).all() and (table["bf16_headroom"] > 100).all()


class _Late(nn.Module):
    """A branch that only runs from step 2 on: its sites have no histogram at the default cadence."""

    def __init__(self):
        super().__init__()
        self.body, self.late, self.on = nn.Linear(16, 1), nn.Linear(16, 1), False

    def forward(self, x):
        return self.body(x) + (self.late(x) if self.on else 0)


def test_sites_without_histograms_are_left_out(tmp_path):
    torch.manual_seed(0)
    model = _Late()
    path = str(tmp_path / "late.db")
    M.train(
        model,
        M.tabular(4, offset=0.0),
        4,
        path,
        on_step=lambda step, m, doc: setattr(m, "on", step >= 1),
        attach_options={"every": 1, "hist_every": 1000, "calibration": 0, "live": False},
        scaler_options={"init_scale": 2.0**8},
    )  # no skipped step: no anomaly records histograms
    tr = ampdoctor.load(path)
    assert len(W.site_whatif(tr, "late", "act")) == 0 and W.judged(W.site_whatif(tr, "late", "act")).empty
    assert "late" not in set(W.formats_table(tr)["path"])
    assert "fp8-readiness" not in {d.rule for d in ampdoctor.diagnose(path)}


def test_the_fp16_and_bf16_columns_need_no_pass_over_the_peaks(tmp_path):
    """The dashboard shows the FP16 / BF16 columns before the pass over every step's peaks (the FP8 columns' amax
    history): their ``clean`` steps come from the peaks read at the histogram steps alone, which are the pass's own
    values (NaN where a tensor overflowed), and the table without FP8 has the whole table's numbers."""
    import pandas as pd

    from ampdoctor.trace.view import View

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    with torch.no_grad():
        model[0].weight.mul_(10)
    data = [(x * (1e4 if i % 3 == 1 else 1.0), y) for i, (x, y) in zip(range(9), M.tabular(9, offset=0.0))]
    path = str(tmp_path / "spiky.db")
    M.train(
        model,
        iter(data),
        9,
        path,
        attach_options={"every": 1, "hist_every": 1, "live": False},
        scaler_options={"init_scale": 2.0**8},
    )  # every third step's first layer overflows FP16 (Inf, then NaN after it)
    view = View.of(ampdoctor.load(path))
    for kind in ("act", "grad_out"):
        inp = W.Inputs(view, kind)
        w = view.scan.windows
        np.testing.assert_array_equal(inp.peak_at, w.at[:, inp._cols(w)])  # (NaN where NaN)
    at = W.Inputs(view, "act").peak_at
    assert np.isinf(at).any() and np.isnan(at).any() and np.isfinite(at).any()  # (overflowed histogram steps)
    half, whole = W.formats_table(view, fp8=False), W.formats_table(view)
    assert not any(c.startswith(("e4m3", "e5m2")) for c in half) and len(half) == len(whole) > 0
    pd.testing.assert_frame_equal(half, whole[half.columns])
