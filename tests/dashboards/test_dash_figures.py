"""Figure builders and the data behind them: arrays in, figures out, no browser."""

import re

import numpy as np
import plotly.graph_objects as go
import pytest
from ampdoctor.dashboards import catalog, data, diagnosis, evidence, figures, matrix, series

import ampdoctor
from ampdoctor import formats


def _bands(fig) -> dict:
    """{band name: [[first, last], ...]} of a step chart (the figure's data, as the browser receives it)."""
    return {t.meta["band"]: t.meta["spans"] for t in fig.data if isinstance(t.meta, dict) and "band" in t.meta}


def _series(fig, name) -> go.Scatter:
    return next(t for t in fig.data if isinstance(t.meta, dict) and t.meta.get("series") == name)


def _steps(loss, skipped=None, nonfinite=None, scale=None) -> series.StepSeries:
    """An exact StepSeries of synthetic figures (what series.read returns for a short range)."""
    n = len(loss)
    x = np.arange(n)
    loss = np.asarray(loss, dtype=float)
    skipped = np.zeros(n, bool) if skipped is None else np.asarray(skipped, bool)
    nonfinite = ~np.isfinite(loss) if nonfinite is None else np.asarray(nonfinite, bool)
    scale = np.full(n, 65536.0) if scale is None else np.asarray(scale, dtype=float)
    cols = {c: np.full(n, np.nan) for c in series.COLUMNS}
    cols.update(loss=np.where(np.isfinite(loss), loss, np.nan), loss_scale=scale, step_time=np.full(n, 0.1))
    cols["data_time"] = np.full(n, 0.02)
    s = series.StepSeries(0, n - 1, n, True, x, np.ones(n, int), cols, cols, cols)
    s.skipped, s.nonfinite = series.intervals(x, skipped), series.intervals(x, nonfinite)
    s.scale_zero = series.intervals(x, scale <= 0)
    s.n_skipped, s.n_nonfinite = int(skipped.sum()), int(nonfinite.sum())
    return s


# -- reduction ------------------------------------------------------------------------------------------------
def test_downsample_caps_points_and_keeps_spikes():
    x = np.arange(200_000)
    y = np.sin(x / 1000.0)
    y[123_457] = 50.0  # one spike
    y[7] = -50.0
    y[150_000:150_010] = np.nan
    dx, dy = series.downsample(x, y, 4000)
    assert len(dx) <= 4000 and np.all(np.diff(dx) > 0)
    assert 123_457 in dx and 7 in dx
    assert np.nanmax(dy) == 50.0 and np.nanmin(dy) == -50.0


@pytest.mark.parametrize("how, expect", [("max", [[3.0, 7.0], [np.nan, 5.0]]), ("sum", [[6.0, 22.0], [0.0, 9.0]])])
def test_bin_columns(how, expect):
    v = np.array([[0, 1, 2, 3, 4, 5, 6, 7], [np.nan] * 4 + [1, 2, 5, 1]], dtype=float)
    x, b = figures.bin_columns(v, np.arange(8) * 10, 2, how)
    assert x.tolist() == [0, 40]
    np.testing.assert_array_equal(b, np.array(expect))


def test_smoothing_is_tensorboards_debiased_ema():
    y = np.array([1.0, 2.0, np.nan, 4.0])
    out = series.smooth(y, 0.5)
    # TensorBoard's: last = 0.5*last + 0.5*v, shown as last / (1 - 0.5^k) after k points; a NaN is skipped
    np.testing.assert_allclose(out[[0, 1, 3]], [0.5 / 0.5, 1.25 / 0.75, 2.625 / 0.875])
    assert np.isnan(out[2])
    assert series.smooth(y, 0.0)[1] == 2.0  # no smoothing: the raw values


# -- the step charts --------------------------------------------------------------------------------------------
def test_loss_chart_draws_non_finite_steps_as_bands_not_at_invented_values():
    loss = np.linspace(2, 1, 50)
    loss[20:23] = np.nan
    skipped = np.zeros(50, bool)
    skipped[[5, 6, 30]] = True
    fig = figures.loss_figure(_steps(loss, skipped), smoothing=0.6)
    raw, smooth = _series(fig, "loss"), next(t for t in fig.data if (t.meta or {}).get("smoothed"))
    assert raw.opacity < 0.5 and smooth.line.width > raw.line.width  # the raw line faint under the smoothed one
    y = np.asarray(raw.y, dtype=float)
    assert np.isnan(y[20:23]).all()  # no value drawn for the non-finite steps
    assert _bands(fig) == {"skipped steps": [[5, 6], [30, 30]], "non-finite steps": [[20, 22]]}
    assert fig.layout.yaxis2.visible is False and fig.layout.yaxis2.fixedrange  # bands span the height, no zoom


def test_log_y_and_an_all_nan_loss():
    fig = figures.loss_figure(_steps(np.full(10, np.nan)), log_y=True)
    assert fig.layout.yaxis.type == "log"
    assert _bands(fig) == {"non-finite steps": [[0, 9]]}  # not a blank chart without a word
    assert any("no finite loss" in a.text for a in fig.layout.annotations)


def test_loss_scale_reaching_zero_is_a_band():
    scale = np.array([8.0, 4.0, 2.0, 1.0, 0.0, 0.0])
    fig = figures.loss_scale_figure(_steps(np.ones(6), scale=scale))
    assert _bands(fig)["loss scale 0"] == [[4, 5]]
    assert np.asarray(_series(fig, "loss scale").y, dtype=float)[0] == 3.0  # log2 axis
    assert "2^3" in fig.layout.yaxis.ticktext


def test_highlight_zoom_and_uirevision():
    fig = figures.loss_figure(_steps(np.ones(100)), highlight=(10, 20), x_range=(5, 40), uirevision="run|/")
    assert _bands(fig)["finding"] == [[10, 20]]
    assert list(fig.layout.xaxis.range) == [4.5, 40.5] and fig.layout.uirevision == "run|/"


def test_every_chart_of_a_long_run_stays_under_the_point_budget():
    n = 10_000
    steps = np.arange(n)
    loss = np.random.default_rng(0).random(n)
    figs = [
        figures.whatif_figure(
            {
                "steps": steps,
                "recorded": 2.0 ** (16 - steps % 8),
                "simulated": np.full(n, 1024.0),
                "recorded_skipped": steps % 2 == 0,
                "simulated_skipped": np.zeros(n, bool),
            }
        ),
        figures.metric_figure("val", *series.downsample(steps, loss)),
        figures.site_stat_figure("abs max", *series.downsample(steps, loss + 1), log2=True),
    ]
    for fig in figs:
        for t in fig.data:
            if not (isinstance(t.meta, dict) and "band" in t.meta):
                assert len(t.x) <= series.MAX_POINTS, fig.layout.title.text


def test_graph_config_has_no_cloud_upload():
    cfg = figures.GRAPH_CONFIG
    assert cfg["showSendToCloud"] is False and cfg["showEditInChartStudio"] is False
    assert {"sendChartToCloud", "sendDataToCloud", "editInChartStudio"} <= set(cfg["modeBarButtonsToRemove"])


def test_empty_inputs_give_a_figure_with_a_note():
    empty = _steps(np.array([]))
    empty.n = 0
    for fig in (
        figures.loss_figure(empty),
        figures.loss_scale_figure(_steps(np.ones(3), scale=np.full(3, np.nan))),
        figures.exponent_hist_figure([], np.zeros((0, 255))),
        figures.site_stat_figure("abs max", [], []),
        figures.formats_figure(["a (activations)"], {"FP16": [0.0], "E4M3": [0.0]}, "FP16"),
    ):
        assert isinstance(fig, go.Figure) and fig.layout.annotations


# -- heat maps --------------------------------------------------------------------------------------------------
def _lm(vals, stat="fp16_over", bad=None, labels=None):
    n_rows, n_cols = vals.shape
    labels = labels or [f"l{i}" for i in range(n_rows)]
    return matrix.LayerMatrix(
        stat,
        "grad_out",
        np.arange(n_cols),
        np.arange(n_rows),
        labels,
        ["Linear"] * n_rows,
        vals,
        np.zeros(vals.shape, bool) if bad is None else bad,
    )


def test_heatmap_of_500_sites_by_10000_steps_is_binned_and_labels_every_row():
    rng = np.random.default_rng(1)
    vals = rng.random((500, 10_000))
    vals[17, 9_999] = 7.0  # the worst cell of site 17 is in the last step
    m = _lm(vals)
    assert m.order("worst")[0] == 17
    rows = m.order("worst")[:50]
    fig = figures.layer_heatmap(m, rows)
    hm = fig.data[0]
    z = np.asarray(hm.z, dtype=float)
    assert z.shape[0] == 50 and z.size <= figures.MAX_CELLS
    assert z[0].max() == 7.0  # binning keeps the worst value
    assert hm.y[0] == "l17" and fig.layout.yaxis.type == "category"  # a click on the top row names l17
    assert list(fig.layout.yaxis.tickvals) == list(hm.y)  # every row labelled, none skipped


@pytest.mark.parametrize("scale", ["log", "clip"])
def test_heatmap_colour_scales_keep_an_outlier_from_paling_the_rest(scale):
    vals = np.full((3, 10), 1.0)
    vals[0, 0] = 1e6
    vals[1] = 10.0
    fig = figures.layer_heatmap(_lm(vals), scale=scale)
    hm = fig.data[0]
    z = np.asarray(hm.z, dtype=float)
    lo, hi = (hm.zmin, hm.zmax) if scale == "clip" else (np.nanmin(z), np.nanmax(z))
    # rows 1 (10.0) and 2 (1.0) land at clearly different colours: more than 10% of the range apart
    assert (np.median(z[1]) - np.median(z[2])) / (hi - lo) > 0.1


def test_heatmap_shows_a_layer_that_held_nan_inf_instead_of_a_blank_row():
    vals = np.full((2, 5), 3.0)
    vals[1] = np.nan  # its abs max was Inf: no finite value at all
    bad = np.zeros((2, 5), bool)
    bad[1] = True
    fig = figures.layer_heatmap(_lm(vals, "absmax_log2", bad))
    overlay = next(t for t in fig.data if (t.meta or {}).get("nonfinite"))
    z = np.asarray(overlay.z, dtype=float)
    assert np.isnan(z[0]).all() and (z[1] == 1).all()


def test_matrix_worst_puts_a_nan_inf_layer_first_for_abs_max():
    vals = np.array([[1.0, 2.0], [np.nan, np.nan], [5.0, 1.0]])
    bad = np.array([[False, False], [True, True], [False, False]])
    m = _lm(vals, "absmax_log2", bad)
    assert m.order("worst").tolist() == [1, 2, 0]
    assert matrix.fmt(m.worst[1]) == "NaN/Inf" and matrix.fmt(0.25, share=True) == "25%"


# -- over real traces ---------------------------------------------------------------------------------------------
def test_step_series_exact_summary_and_preview_agree(traces):
    tr = ampdoctor.load(traces / "fp16_bad.db")
    st = tr.steps()
    s = series.read(tr)
    assert s.exact and s.x.tolist() == st["step"].tolist()
    np.testing.assert_array_equal(s.lo["loss_scale"], st["loss_scale"].to_numpy())
    assert s.n_skipped == int(st["skipped"].sum()) > 0
    flat = [x for a, b in s.skipped for x in range(a, b + 1)]
    assert flat == st["step"][st["skipped"]].tolist()
    sm = series.StepSummary()
    sm.update(tr)
    coarse = series.read(tr, max_points=8, summary=sm)  # 30 steps in buckets of 16: 2 buckets
    assert not coarse.exact and coarse.hi["loss_scale"].max() == st["loss_scale"].max()
    assert coarse.lo["loss_scale"].min() == st["loss_scale"].min()
    assert coarse.n_skipped == s.n_skipped
    preview = series.read(tr, max_points=8)
    assert preview.preview and len(preview.x) <= 8


def test_site_series_and_histogram_match_the_reader(traces):
    tr = ampdoctor.load(traces / "fp16_under.db")
    site = int(tr.sites("grad_out")["id"].iloc[1])
    col = list(tr.sites("grad_out")["id"]).index(site)
    x, y, _ = matrix.site_series(tr, site, "absmax_log2")
    peak = tr.records("peak", "grad_out")[:, col]
    np.testing.assert_allclose(y, peak[x])
    x, y, _ = matrix.site_series(tr, site, "fp16_under")
    full = tr.full_steps()
    want = (tr.records("fp16_sub", "grad_out") + tr.records("fp16_flush", "grad_out")) / tr.records("numel", "grad_out")
    assert x.tolist() == full.tolist()
    np.testing.assert_allclose(y, want[full, col])
    hs, counts = matrix.site_hist(tr, site)
    rs, rc = tr.hist(site)
    assert hs.tolist() == rs.tolist() and np.array_equal(counts, rc)


def test_layer_matrix_matches_the_reader(traces):
    tr = ampdoctor.load(traces / "fp16_under.db")
    m = matrix.layer_matrix(tr, "grad_out", "fp16_under")
    full = tr.full_steps()
    numel = tr.records("numel", "grad_out")[full]
    under = tr.records("fp16_sub", "grad_out")[full] + tr.records("fp16_flush", "grad_out")[full]
    np.testing.assert_allclose(m.values, (under / numel).T)
    assert m.steps.tolist() == full.tolist()
    assert np.nanmax(m.worst) > 0.5  # a loss x 1e-5 without a scaler: most gradients underflow
    peak = matrix.layer_matrix(tr, "act", "absmax_log2")
    recorded = np.flatnonzero(np.isfinite(tr.records("peak", "act")).any(axis=1))
    assert peak.steps.tolist() == recorded.tolist()  # only the steps that recorded peaks: no empty columns
    np.testing.assert_allclose(peak.values, np.log2(tr.records("peak", "act")[recorded]).T)


def test_default_view_follows_the_runs_precision(traces):
    """A BF16 run never opens on an FP16 statistic; an FP16 run opens on the output gradients' underflow."""
    assert data.default_view(ampdoctor.load(traces / "bf16.db")) == ("grad_out", "absmax_log2")
    assert data.default_view(ampdoctor.load(traces / "fp16_bad.db")) == ("grad_out", "fp16_under")
    tr = ampdoctor.load(traces / "fp16_under.db")
    found = diagnosis.findings(tr)
    assert data.default_view(tr, found) == ("grad_out", "fp16_under") and found[0].rule == "grad-underflow"


def test_precision_map_verdicts_are_the_findings(hostile):
    """The map judges nothing itself: a module is flagged exactly when a finding names it, with that finding."""
    tr = ampdoctor.load(hostile[0])
    found = diagnosis.findings(tr)
    rows = {r["module"]: r for r in data.precision_rows(tr, found)}
    named = {str(p) for d in found for p in d.layers}
    for module, row in rows.items():
        if module.startswith("("):
            continue
        assert (row["verdict"] != "ok") == (module in named), (module, row["verdict"])
    culprit = next(d for d in found if d.rule == "forward-overflow").layers[0]
    assert "forward-overflow" in rows[culprit]["verdict"]  # the culprit is not "ok"
    assert "precision-policy" in rows["norm"]["verdict"]  # its FP16 LayerNorm, as the rule says
    assert rows["norm"]["allocation"] == "parameters and statistics in FP32"
    assert data.precision_rows(tr, None)[0]["verdict"] == "diagnosing…"


def test_run_summary_counts_without_reading_the_steps_into_memory(traces):
    tr = ampdoctor.load(traces / "fp16_bad.db")
    rows = dict(data.run_summary(tr))
    st = tr.steps()
    assert rows["steps"] == "30" and rows["skipped steps"].startswith(f"{int(st['skipped'].sum())} (")
    assert rows["loss scale"].startswith(f"{st['loss_scale'].iloc[0]:g} at start")


def test_evidence_rows_have_human_labels_and_no_none(traces):
    tr = ampdoctor.load(traces / "fp16_bad.db")
    d = next(d for d in diagnosis.findings(tr) if d.rule == "init-scale-too-high")
    rows = dict(diagnosis.evidence_items(d))
    assert "largest unscaled gradient" in rows and "suggested init_scale" in rows
    assert not any(re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)+", k) for k in rows)  # no raw snake_case key
    assert "None" not in rows.values()
    d.evidence["nothing"] = None
    assert all(k != "Nothing" for k, _ in diagnosis.evidence_items(d))
    assert diagnosis.from_dict(d.to_dict()).fix == d.fix  # the cached form reads back


def test_evidence_links_name_the_view_that_proves_a_finding(traces):
    tr = ampdoctor.load(traces / "fp16_bad.db")
    d = next(d for d in diagnosis.findings(tr) if d.rule == "init-scale-too-high")
    links = evidence.links(d)
    assert links[0].page == "/" and dict(links[0].params)["hl"] == f"{d.steps[0]}-{d.steps[1]}"
    whatif = next(k for k in links if k.page == "/whatif")
    init = dict(whatif.params)["init"]
    assert float(init) == d.evidence["suggested_settings"]["init_scale"]


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


def test_exponent_histogram_bands_and_scale_shift(traces):
    tr = ampdoctor.load(traces / "fp16_bad.db")
    site = int(tr.sites("grad_out")["id"].iloc[0])
    steps, counts = tr.hist(site)
    scales = tr.steps()["loss_scale"].to_numpy()[steps]
    fig = figures.exponent_hist_figure(steps, counts, scales, kind="grad_out", x_range=(0, 29))
    notes = [a.text for a in fig.layout.annotations]
    assert {"FP16 normal", "FP16 subnormal", "FP16 max 65504"} <= set(notes), notes
    y0, y1 = fig.layout.yaxis.range
    assert y0 <= formats.FP16.subnormal_exp and y1 >= formats.FP16.max_exp
    shift = next(t for t in fig.data if t.name == "underflow limit without the loss scale")
    assert np.asarray(shift.y)[0] == formats.FP16.subnormal_exp + np.log2(scales[0])
    assert list(fig.layout.xaxis.range) == [-0.5, 29.5]  # the same step axis as the chart above it


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


def test_the_servers_warm_up_builds_the_overview_charts():
    """figures.warm() (a server's thread at start: plotly's first use paid before the first page asks) builds the
    overview's charts; the server swallows its failure, so a change to their arguments would only show here."""
    figures.warm()


def test_the_figures_template_is_plotly_white_for_what_they_draw():
    """Each figure carries its template: plotly_white's, less what only other subplot kinds and trace types read
    (the report's browser test checks that no figure has another kind); the same look, a third of the bytes."""
    import json

    import plotly.io as pio
    from ampdoctor.dashboards import plotlyjs

    white, ours = pio.templates["plotly_white"], pio.templates[figures.TEMPLATE]
    kept = {k: v for k, v in white.layout.to_plotly_json().items() if k not in {"polar", "ternary", "scene", "geo"}}
    assert ours.layout.to_plotly_json() == kept
    assert {k: getattr(ours.data, k) for k in plotlyjs.TRACE_TYPES} == {
        k: getattr(white.data, k) for k in plotlyjs.TRACE_TYPES
    }
    fig = figures.empty("t", "n").to_plotly_json()
    assert len(json.dumps(fig["layout"]["template"])) < len(json.dumps(white.to_plotly_json())) / 2
