"""A long run (20,000 steps, default tiers, generated in the documented format): every view stays under its point
budget, keeps every spike and skipped step, reads only the range it shows, and the step summary survives a restart
through the cache on disk."""

import base64
import importlib.util
import json
import os
import re
import time

import numpy as np
import pytest
from ampdoctor.dashboards import cache, figures, matrix, report, series
from ampdoctor.dashboards.app import create_app
from ampdoctor.dashboards.pages import layer, layers, overview, whatif

import ampdoctor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N_STEPS, N_SITES = 20_000, 60


def _tracegen():
    spec = importlib.util.spec_from_file_location("dash_tracegen", os.path.join(ROOT, "benchmarks", "dash_tracegen.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("long") / "long.db"
    _tracegen().generate(str(path), N_STEPS, N_SITES)
    return path


def _points(fig) -> int:
    return max(
        (len(t.x) for t in fig.data if t.x is not None and t.type != "heatmap" and not (t.meta or {}).get("band")),
        default=0,
    )


def test_every_view_of_a_long_run_stays_under_the_point_budget(long_run, tmp_path, monkeypatch):
    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path))
    ctx = create_app(str(long_run.parent), diagnose_in="thread").ampdoctor
    search = "?run=long.db&site=1"
    version = {"run": "long.db", "n": N_STEPS}
    figs = list(overview.charts(ctx, version, None, 0.6, [], None, search)[:4])
    _, _, stat_fig, _ = layer.update(ctx, version, search, "absmax_log2", None)
    figs += [stat_fig, whatif.update(ctx, "1024", "100", "2", "0.5", version, search)[0]]
    for fig in figs:
        assert 0 < _points(fig) <= series.MAX_POINTS < N_STEPS, fig.layout.title.text
    for stat in matrix.STATS:
        heat, *_ = layers.update(ctx, "grad_out", stat, "worst", "", 0, "linear", [], 1, version, None, search)
        z = np.asarray(heat.data[0].z)
        assert z.size <= figures.MAX_CELLS and len(heat.data[0].x) <= 600


def test_downsampled_loss_keeps_the_spike_and_every_skipped_step(long_run):
    tr = ampdoctor.load(long_run)
    st = tr.steps()
    sm = series.StepSummary()
    assert sm.update(tr) == N_STEPS
    s = series.read(tr, summary=sm)
    assert not s.exact and len(s.x) <= series.MAX_POINTS // 2
    loss = st["loss"].to_numpy(float)
    _, y = s.envelope("loss")
    assert np.nanmax(y) == np.nanmax(loss)  # the spike, to the bit
    assert np.nanmin(y) == np.nanmin(loss)
    skipped = set(st["step"][st["skipped"]].tolist())
    covered = {k for a, b in s.skipped for k in range(a, b + 1)}
    assert skipped <= covered and s.n_skipped == len(skipped)
    bad = set(st["step"][st["nonfinite"]].tolist())
    assert bad and bad <= {k for a, b in s.nonfinite for k in range(a, b + 1)}
    # zoomed in on the non-finite burst: every step, exactly
    a, b = min(bad) - 5, max(bad) + 5
    z = series.read(tr, a, b, summary=sm)
    assert z.exact and z.x.tolist() == list(range(a, b + 1))
    assert [k for lo, hi in z.nonfinite for k in range(lo, hi + 1)] == sorted(bad)


def test_step_summary_is_kept_on_disk_and_checked_against_the_trace(long_run, tmp_path, monkeypatch):
    """A long run's summary is built in the background (the charts show a preview meanwhile), saved, and read back
    by the next server; a summary that does not describe the file is not used."""
    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("ampdoctor.dashboards.context.SYNC_SUMMARY_STEPS", 1000)
    ctx = create_app(str(long_run.parent), diagnose_in="thread").ampdoctor
    s = ctx.steps("long.db")
    assert s.preview  # at once: a preview, not an empty page
    deadline = time.time() + 60
    while time.time() < deadline and ctx.steps("long.db").preview:
        time.sleep(0.2)
    full = ctx.steps("long.db")
    assert not full.preview and not full.exact
    assert len(cache.prefix_files("steps-", "npz")) == 1
    again = create_app(str(long_run.parent), diagnose_in="thread").ampdoctor
    t0 = time.perf_counter()
    s2 = again.steps("long.db")
    assert not s2.preview and time.perf_counter() - t0 < 5  # read back, not rebuilt
    np.testing.assert_array_equal(s2.hi["loss"], full.hi["loss"])
    tr = ampdoctor.load(long_run)
    arrays = cache.load_arrays(cache.prefix_files("steps-", "npz")[0])
    arrays["key"] = arrays["key"] + 1  # a summary of another file's content
    assert series.StepSummary.from_arrays(arrays, tr) is None


def test_a_long_heat_map_is_read_in_chunks_with_a_preview_first(long_run, monkeypatch):
    tr = ampdoctor.load(long_run)
    monkeypatch.setattr(matrix, "_CHUNK_ROWS", 500)  # many small reads: the same matrix
    chunked = matrix.layer_matrix(tr, "act", "fp16_under")
    monkeypatch.setattr(matrix, "SQL_ROWS", 0)  # reduced in SQLite, bin by bin: the same matrix
    in_sql = matrix.layer_matrix(tr, "act", "fp16_under")
    monkeypatch.undo()
    whole = matrix.layer_matrix(tr, "act", "fp16_under")
    np.testing.assert_array_equal(chunked.values, whole.values)
    np.testing.assert_array_equal(in_sql.values, whole.values)
    np.testing.assert_array_equal(in_sql.nonfinite, whole.nonfinite)
    preview = matrix.layer_matrix(tr, "act", "fp16_under", preview=True)
    assert preview.preview and preview.values.shape[1] <= matrix.PREVIEW_COLS < whole.recorded


def test_the_layers_page_waits_only_for_a_heat_map_it_can_get(long_run, monkeypatch, tmp_path):
    """A heat map too long to read in a request is read in the background; the page waits for it only when the read
    can end within the wait (it has read long enough), else it shows the preview at once: a read of many seconds
    is not waited for first."""
    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(matrix, "EXACT_ROWS", 0)  # every heat map in the background
    ctx = create_app(str(long_run), diagnose_in="thread").ampdoctor
    waits = []
    background = ctx.background

    def recorded(key, what, fn, wait=1.0):
        waits.append(wait)
        return background(key, what, fn, wait)

    monkeypatch.setattr(ctx, "background", recorded)
    search = "?run=long.db"

    def heat_map(stat):
        heat, _, count, *_ = layers.update(ctx, "act", stat, "worst", "", 0, "linear", [], 1, None, None, search)
        return heat, count

    monkeypatch.setattr(matrix, "READ_ROWS_PER_S", 1.0)  # a read that cannot end within the wait
    _, count = heat_map("fp16_under")
    assert waits == [0.0] and "preview" in count
    waits.clear()
    monkeypatch.setattr(matrix, "READ_ROWS_PER_S", 1e15)  # one that can: waited for, the whole shown
    monkeypatch.setattr(layers, "MATRIX_WAIT_S", 60.0)  # (however loaded the machine)
    _, count = heat_map("absmax_log2")
    assert waits == [0.0, 60.0] and "preview" not in count


def _report_figures(text: str) -> dict:
    """{figure id: plotly JSON} of a report's embedded figures."""
    found = re.findall(
        r'<script type="application/json" class="figure" data-target="([^"]+)-plot">(.*?)</script>', text
    )
    return {fid: json.loads(body.replace("<\\/", "</")) for fid, body in found}


def _array(v) -> np.ndarray:
    """A plotly JSON array: a list, or a typed array ({"dtype", "bdata"})."""
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
    return np.asarray([np.nan if a is None else a for a in v], dtype=float)


def test_report_of_a_long_run_is_small_and_keeps_every_spike(long_run):
    """The report of 20,000 steps at a budget of 400 points a line: every step chart within it, the loss spike and the
    lowest loss to the bit, every skipped step under a band, and the figures' JSON bounded by the budget (at 10^6
    steps and the default budget the whole file is ~3.6 MB: benchmarks/README.md)."""
    tr = ampdoctor.load(long_run)
    st = tr.steps()
    text = report.build_report(tr, max_points=400)
    figs = _report_figures(text)
    lines = {
        fid: [t for t in f["data"] if t.get("type") == "scatter" and not (t.get("meta") or {}).get("band")]
        for fid, f in figs.items()
        if fid in ("fig-loss", "fig-scale", "fig-norm", "fig-time")
    }
    assert len(lines) == 4
    for fid, traces in lines.items():
        assert traces, fid
        assert all(0 < len(_array(t["x"])) <= 400 for t in traces), fid
    raw = [_array(t["y"]) for t in lines["fig-loss"] if not (t.get("meta") or {}).get("smoothed")]
    loss = st["loss"].to_numpy(float)
    assert max(np.nanmax(y) for y in raw) == np.nanmax(loss)  # the spike at step N_STEPS // 3
    assert min(np.nanmin(y) for y in raw) == np.nanmin(loss)
    bands = [t for f in figs.values() for t in f["data"] if (t.get("meta") or {}).get("band")]
    skipped = st["step"][st["skipped"]].to_numpy()
    spans = [
        (a + 0.5, b - 0.5)
        for t in bands
        if "skipped" in t.get("name", "")
        for a, b in zip(_array(t["x"])[0::6], _array(t["x"])[2::6])
    ]
    assert all(any(a <= s <= b for a, b in spans) for s in skipped)
    payload = sum(len(json.dumps(f)) for f in figs.values())
    assert payload < 600_000, payload  # 400 points a line (every step drawn: 2.3 MB)
