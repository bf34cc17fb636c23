"""Figure builders and the data behind them: arrays in, figures out, no browser."""

import numpy as np
import plotly.graph_objects as go
import pytest
from ampdoctor.dashboards import catalog, data, diagnosis, figures

import ampdoctor
from ampdoctor import formats


def _n_points(fig) -> list[int]:
    return [len(t.x) if t.x is not None else 0 for t in fig.data]


# -- reduction ------------------------------------------------------------------------------------------------
def test_downsample_caps_points_and_keeps_spikes():
    x = np.arange(200_000)
    y = np.sin(x / 1000.0)
    y[123_457] = 50.0  # one spike
    y[7] = -50.0
    y[150_000:150_010] = np.nan
    dx, dy = figures.downsample(x, y, 4000)
    assert len(dx) <= 4000 and np.all(np.diff(dx) > 0)
    assert 123_457 in dx and 7 in dx
    assert np.nanmax(dy) == 50.0 and np.nanmin(dy) == -50.0


def test_downsample_leaves_short_series_alone():
    x, y = np.arange(10), np.arange(10.0)
    dx, dy = figures.downsample(x, y)
    assert dx.tolist() == x.tolist() and dy.tolist() == y.tolist()


@pytest.mark.parametrize("how, expect", [("max", [[3.0, 7.0], [np.nan, 5.0]]), ("sum", [[6.0, 22.0], [0.0, 9.0]])])
def test_bin_columns(how, expect):
    v = np.array([[0, 1, 2, 3, 4, 5, 6, 7], [np.nan] * 4 + [1, 2, 5, 1]], dtype=float)
    x, b = figures.bin_columns(v, np.arange(8) * 10, 2, how)
    assert x.tolist() == [0, 40]
    np.testing.assert_array_equal(b, np.array(expect))


def test_large_run_figures_stay_under_10k_points_per_line():
    n = 10_000
    steps = np.arange(n)
    loss = np.random.default_rng(0).random(n)
    skipped = np.zeros(n, bool)
    skipped[::2] = True  # 5000 skips: markers are thinned too
    scale = 2.0 ** np.clip(16 + np.cumsum(np.where(skipped, -1, 1)) % 8, 0, 24)
    figs = [
        figures.loss_figure(steps, loss, skipped, skipped),
        figures.loss_scale_figure(steps, scale, skipped),
        figures.step_time_figure(steps, loss, loss / 3),
        figures.whatif_figure(steps, scale, scale / 2, skipped, skipped),
        figures.compare_loss_figure([("a", steps, loss), ("b", steps, loss * 2)]),
        figures.layer_series_figure({"abs max": (steps, loss + 1), "rms": (steps, loss + 2)}),
    ]
    for fig in figs:
        assert max(_n_points(fig)) <= figures.MAX_POINTS, fig.layout.title.text


def test_layer_heatmap_of_500_sites_by_10000_steps_is_binned():
    rng = np.random.default_rng(1)
    vals = rng.random((500, 10_000))
    vals[17, 9_999] = 7.0  # the worst cell of site 17 is in the last step
    lm = data.LayerMatrix(
        "fp16_over",
        "grad_out",
        np.arange(10_000),
        np.arange(500),
        [f"l{i}" for i in range(500)],
        ["Linear"] * 500,
        vals,
    )
    assert lm.order("worst")[0] == 17
    fig = figures.layer_heatmap(lm, lm.order("worst"))
    hm = fig.data[0]
    z = np.asarray(hm.z, dtype=float)
    assert z.shape[0] == 500 and z.size <= figures.MAX_CELLS
    assert z[0].max() == 7.0  # binning keeps the worst value
    assert hm.y[0] == "l17" and fig.layout.yaxis.type == "category"  # a click on the top row names l17


# -- figures over a real trace ----------------------------------------------------------------------------------
def test_overview_figures_mark_skipped_steps(traces):
    tr = ampdoctor.load(traces / "fp16_bad.db")
    st = tr.steps()
    fig = figures.loss_figure(st["step"], st["loss"], st["skipped"], st["nonfinite"])
    names = [t.name for t in fig.data]
    n_skip = int(st["skipped"].sum())
    assert n_skip > 0 and f"skipped step ({n_skip})" in names
    fig = figures.loss_scale_figure(st["step"], st["loss_scale"], st["skipped"])
    line = fig.data[0]
    assert np.asarray(line.y)[0] == 24.0  # init scale 2^24, on the log2 axis
    assert "2^24" in fig.layout.yaxis.ticktext


def test_exponent_histogram_bands_and_scale_shift(traces):
    tr = ampdoctor.load(traces / "fp16_bad.db")
    site = int(tr.sites("grad_out")["id"].iloc[0])
    steps, counts = tr.hist(site)
    scales = tr.steps()["loss_scale"].to_numpy()[steps]
    fig = figures.exponent_hist_figure(steps, counts, scales, kind="grad_out")
    texts = [s.annotation.text if hasattr(s, "annotation") else None for s in fig.layout.shapes]
    notes = [a.text for a in fig.layout.annotations]
    assert {"FP16 normal", "FP16 subnormal", "FP16 max 65504"} <= set(notes), (texts, notes)
    y0, y1 = fig.layout.yaxis.range
    assert y0 <= formats.FP16.subnormal_exp and y1 >= formats.FP16.max_exp
    shift = next(t for t in fig.data if t.name == "underflow limit without the loss scale")
    assert np.asarray(shift.y)[0] == formats.FP16.subnormal_exp + np.log2(scales[0])


def test_empty_inputs_give_a_figure_with_a_note():
    for fig in (
        figures.loss_figure([], [], [], []),
        figures.loss_scale_figure([1, 2], [np.nan, np.nan], [0, 0]),
        figures.exponent_hist_figure([], np.zeros((0, 255))),
        figures.layer_series_figure({}),
    ):
        assert isinstance(fig, go.Figure) and fig.layout.annotations


# -- data ---------------------------------------------------------------------------------------------------------
def test_layer_matrix_matches_records(traces):
    tr = ampdoctor.load(traces / "fp16_under.db")
    lm = data.layer_matrix(tr, "fp16_under", "grad_out")
    full = tr.full_steps()
    numel = tr.records("numel", "grad_out")[full]
    under = tr.records("fp16_sub", "grad_out")[full] + tr.records("fp16_flush", "grad_out")[full]
    np.testing.assert_allclose(lm.values, (under / numel).T)
    assert lm.steps.tolist() == full.tolist()
    assert lm.worst.max() > 0.5  # a loss x 1e-5 without a scaler: most gradients underflow
    peak = data.layer_matrix(tr, "absmax_log2", "act")
    assert peak.values.shape == (len(tr.sites("act")), tr.n_steps)


def test_unscaled_abs_max_removes_the_loss_scale(traces):
    tr = ampdoctor.load(traces / "fp16_bad.db")
    scaled = data.layer_matrix(tr, "absmax_log2", "grad_out")
    unscaled = data.layer_matrix(tr, "absmax_log2", "grad_out", unscale=True)
    scale = tr.steps()["loss_scale"].to_numpy()
    diff = scaled.values - unscaled.values
    want = np.broadcast_to(np.log2(scale), diff.shape)
    ok = np.isfinite(diff)  # overflowed (inf) steps have no abs max to shift
    assert ok.any() and np.array_equal(np.isfinite(unscaled.values), ok)
    np.testing.assert_allclose(diff[ok], want[ok])


def test_whatif_reproduces_recorded_scale_and_responds_to_settings(traces):
    tr = ampdoctor.load(traces / "fp16_bad.db")
    own = data.whatif(tr)
    np.testing.assert_array_equal(own["simulated"], own["recorded"])
    low = data.whatif(tr, init_scale=1024.0)
    assert low["simulated"][0] == 1024.0 and not low["simulated_skipped"].any()


def test_precision_rows_flag_half_precision_norms():
    class T:
        config = {
            "autocast": {"enabled": True, "dtype": "float16"},
            "loss_dtype": "float16",
            "module_param_dtypes": {"lin": "float32", "ln": "float16"},
            "param_dtypes": {"float32": 10},
            "optimizer": {"class": "Adam"},
        }

        def sites(self):
            import pandas as pd

            return pd.DataFrame(
                {
                    "id": [0, 1, 2],
                    "path": ["lin", "ln", "lin"],
                    "module": ["lin", "ln", "lin"],
                    "kind": ["act", "act", "grad_out"],
                    "module_type": ["Linear", "LayerNorm", "Linear"],
                    "dtype": ["float16", "float16", "float16"],
                    "shape": ["", "", ""],
                    "first_step": [0, 0, 0],
                }
            )

    rows = {r["module"]: r for r in data.precision_rows(T())}
    assert rows["lin"]["recommended"] == "float16" and rows["lin"]["verdict"] == "ok"
    assert rows["ln"]["verdict"] == "should run in FP32; weights in half precision"
    assert rows["loss"]["verdict"] == "should be FP32"
    assert rows["weight update"]["verdict"] == "ok"


def test_fix_parts_are_the_rules_own_text_and_code(traces):
    """A fix is shown as the rule wrote it: text and code parts in order, joined they are the recommendation, and
    every code part compiles as printed (the fix tests run them); a plain-text recommendation is one text part."""
    found = [d for name in ("fp16_bad.db", "fp16_under.db", "bf16.db") for d in ampdoctor.diagnose(str(traces / name))]
    parts = [diagnosis.fix_parts(d) for d in found]
    assert found and all(p for p in parts) and any(k == "code" for p in parts for k, _ in p)
    for d, p in zip(found, parts):
        assert {k for k, _ in p} <= {"text", "code"}
        assert "\n".join(t for _, t in p) == d.recommendation
        for kind, text in p:
            if kind == "code":
                compile(text, d.rule, "exec")
    assert diagnosis.fix_parts(type("D", (), {"recommendation": "Lower the rate.\nx = 1"})()) == [
        ("text", "Lower the rate.\nx = 1")
    ]


def test_discover_runs_groups_ranks_and_stays_under_the_root(traces, tmp_path):
    runs = catalog.discover_runs(str(traces))
    assert {"fp16_bad.db", "fp16_under.db", "bf16.db", "ddp/run.rank0.db", "ddp/run.rank1.db"} <= set(runs)
    assert runs["ddp/run.rank1.db"].group == "ddp/run" and runs["ddp/run.rank1.db"].rank == 1
    # a link out of the root and a non-trace file are not offered
    (tmp_path / "inside").mkdir()
    (tmp_path / "inside" / "notes.db").write_text("not a trace")
    (tmp_path / "inside" / "escape.db").symlink_to(traces / "bf16.db")
    assert catalog.discover_runs(str(tmp_path / "inside")) == {}


def test_layers_of_the_offline_side_import_neither_dash_nor_torch():
    """figures/report never import dash (the report needs only plotly); nothing here imports torch."""
    import subprocess
    import sys

    code = (
        "import sys; import ampdoctor.dashboards.figures, ampdoctor.dashboards.report; "
        "assert 'dash' not in sys.modules, 'dash'; import ampdoctor.dashboards.app, ampdoctor.commands.serve; "
        "assert 'torch' not in sys.modules, 'torch'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
