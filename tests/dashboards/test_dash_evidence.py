"""Every rule's finding leads to its evidence: in Chromium, on a real training run that trips the rule, the
finding's first evidence link opens a view whose figure (read from the page's own plotly data, not its pixels)
shows what the finding says: the right kind of site, statistic, steps and rank, the finding outlined."""

from __future__ import annotations

import math
import os
import time
from urllib.parse import parse_qs, urlparse

import numpy as np
import pytest
import rule_runs
from ampdoctor.dashboards import evidence, ids, matrix
from ampdoctor.dashboards.app import create_app

import ampdoctor
from ampdoctor.rules import RULES

pytestmark = pytest.mark.browser


@pytest.fixture(scope="session")
def rule_sites(tmp_path_factory, browser):
    """rule -> its run (rule_runs.RUNS) served, trained on first use (each test pays for its own run; torchrun's
    FSDP runs start in the background once the first is served): one app for the runs without a reference, one per
    reference; the diagnosis started as soon as the run is served."""
    root = str(tmp_path_factory.mktemp("rules"))
    apps: dict = {}
    out: dict = {}

    def site(rule):
        if rule in out:
            return out[rule]
        directory, name, ref = rule_runs.build(root, only=[rule])[rule]
        key = ref or root
        if key not in apps:
            app = create_app(root if ref is None else directory, reference=ref)
            apps[key] = (app, browser.serve(app))
        app, url = apps[key]
        ctx = app.ampdoctor
        run = os.path.relpath(os.path.join(directory, name), ctx.root).replace(os.sep, "/")
        # every trace of the rule's run listed (the app rescans its root every second): a rank's trace seen after
        # the diagnosis began makes another run, whose findings would replace those a click had just followed
        built = {
            os.path.relpath(os.path.join(directory, f), ctx.root).replace(os.sep, "/")
            for f in os.listdir(directory)
            if f.endswith(".db")
        }
        deadline = time.monotonic() + 10
        while not built <= set(ctx.runs()) and time.monotonic() < deadline:
            time.sleep(0.1)
        ctx.diagnosis_state(run)  # starts it in the background
        ctx.release()
        out[rule] = (url, run, ctx, os.path.join(directory, name), ref)
        if len(out) == 1:  # after the first test's own run (the first page load is the slowest): torchrun's
            rule_runs.start_background(root)
        return out[rule]

    return site


def _finding(rule, path, ref):
    """The finding as the rules make it (what the page must show evidence of)."""
    if rule.startswith("fsdp-"):  # the run's ranks together, as the dashboard diagnoses a rank
        found = ampdoctor.diagnose(path.rsplit("-", 1)[0] + "-*.db", reference=ref)
    elif rule.startswith("rank-"):
        found = ampdoctor.diagnose(os.path.dirname(path), reference=ref)
    else:
        found = ampdoctor.diagnose(path, reference=ref)
    return next(d for d in found if d.rule == rule)


def _bands(fig, name):
    return [tuple(s) for t in fig["data"] if (t["meta"] or {}).get("band") == name for s in t["meta"]["spans"]]


def _covers(spans, steps) -> bool:
    return all(any(a <= s <= b for a, b in spans) for s in steps)


def _series(fig, name):
    t = next(t for t in fig["data"] if (t["meta"] or {}).get("series") == name)
    return np.asarray(t["x"], dtype=float), np.asarray(t["y"], dtype=float)


def _heat(fig):
    hm = next(t for t in fig["data"] if t["type"] == "heatmap" and not (t["meta"] or {}).get("nonfinite"))
    return list(hm["y"]), np.asarray(hm["z"], dtype=float)


def _table(browser, table_id):
    rows = browser.driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0] + ' tr')).map(function (tr) {"
        "  return {cls: tr.className, cells: Array.from(tr.children).map(function (c) { return c.textContent; })};"
        "});",
        f"#{table_id}",
    )
    head = rows[0]["cells"]
    return [dict(zip(head, r["cells"]), _highlight=r["cls"] == "highlight") for r in rows[1:]]


# what each rule's first evidence link must show: (browser, the finding) -> None, asserting on the page's figures
def _overview_finding(b, d, graph):
    fig = b.wait(lambda: b.figure(graph), what=graph)
    assert _bands(fig, "finding") == [tuple(d.steps)]
    lo, hi = fig["layout"]["xaxis"]["range"]
    assert lo <= d.steps[0] and hi >= d.steps[1]  # zoomed to the finding's steps (padded)
    return fig


def check_divergence(b, d):
    fig = _overview_finding(b, d, ids.LOSS_GRAPH)
    assert fig["layout"]["yaxis"]["type"] == "log"
    if d.evidence.get("first_nonfinite_step") is not None:
        assert _covers(_bands(fig, "non-finite steps"), [d.evidence["first_nonfinite_step"]])
    else:
        _, y = _series(fig, "loss")
        assert np.nanmax(y) >= 10 * np.nanmin(y)


def check_init_scale_too_high(b, d):
    fig = _overview_finding(b, d, ids.SCALE_GRAPH)
    assert _covers(_bands(fig, "skipped steps"), d.evidence["skipped_steps"])
    _, y = _series(fig, "loss scale")
    assert y[0] == math.log2(d.evidence["init_scale"])


def check_forward_overflow(b, d):
    fig = b.wait(lambda: b.figure(ids.LAYER_SERIES), what="layer series")
    assert b.text("#layer-name") == f"{d.layers[0]} · activations"
    assert "overflow" in fig["layout"]["title"]
    x, y = _series(fig, "FP16 overflow count (incl. Inf)")
    first = d.evidence["first_step"]
    assert _covers(_bands(fig, "NaN/Inf recorded"), [first]) and y[list(x).index(first)] > 0


def check_loss_scale_collapse(b, d):
    fig = _overview_finding(b, d, ids.SCALE_GRAPH)
    _, y = _series(fig, "loss scale")
    assert np.nanmin(y) == pytest.approx(math.log2(d.evidence["lowest_scale"]))
    assert _bands(fig, "skipped steps")


def check_grad_underflow(b, d):
    fig = b.wait(lambda: b.figure(ids.LAYERS_HEATMAP), what="heat map")
    labels, z = _heat(fig)
    named = d.layers[0]
    assert labels[0] == named and "FP16 underflow" in fig["layout"]["title"]
    assert np.nanmax(z[0]) >= d.evidence["min_share"]
    assert fig["layout"]["shapes"]  # the named layers outlined


def check_weights_nonfinite(b, d):
    fig = _overview_finding(b, d, ids.LOSS_GRAPH)
    assert _covers(_bands(fig, "non-finite steps"), [d.evidence["first_step"] + 1])


def check_weight_update_lost(b, d):
    fig = b.wait(lambda: b.figure(ids.LAYERS_HEATMAP), what="heat map")
    labels, z = _heat(fig)
    param, share = max(d.evidence["per_parameter"].items(), key=lambda kv: kv[1])
    assert "zero share" in fig["layout"]["title"] and "weight updates" in fig["layout"]["title"]
    assert np.nanmax(z[labels.index(param)]) >= 0.5 * share


def check_grad_range_anomaly(b, d):
    fig = b.wait(lambda: b.figure(ids.LAYERS_HEATMAP), what="heat map")
    labels, z = _heat(fig)
    assert "log2 RMS" in fig["layout"]["title"] and "parameter gradients" in fig["layout"]["title"]
    path, decades = next(iter(d.evidence["outliers"].items()))
    rows = [i for i, lab in enumerate(labels) if path in (lab, lab.rpartition(".")[0])]
    others = [i for i in range(len(labels)) if i not in rows]
    gap = abs(np.nanmedian(z[rows]) - np.nanmedian(z[others]))
    assert gap >= 0.5 * abs(decades) * math.log2(10)  # the outlier, decades away, on the log2 scale


def check_precision_policy(b, d):
    rows = b.wait(lambda: _table(b, ids.PRECISION_TABLE), what="precision table")
    shown = {r["module"]: r for r in rows}
    for p in d.layers:
        assert "precision-policy" in shown[p]["verdict"] and shown[p]["_highlight"]
    assert all(r["verdict"] != "ok" for r in rows)  # only the modules a finding names


def check_amp_inactive(b, d):
    rows = b.wait(lambda: _table(b, ids.PRECISION_TABLE), what="precision table")
    modules = [r for r in rows if not r["module"].startswith("(")]
    assert modules and all(r["forward"] == "float32" for r in modules)


def check_input_pipeline_bound(b, d):
    fig = b.wait(lambda: b.figure(ids.TIME_GRAPH), what="time chart")
    _, wait = _series(fig, "data wait")
    _, compute = _series(fig, "compute")
    share = np.nanmedian(wait / (wait + compute))
    assert share >= 0.5 * d.evidence["data_share_median"]


def check_late_degradation(b, d):
    fig = _overview_finding(b, d, ids.LOSS_GRAPH)
    assert fig["layout"]["yaxis"]["type"] == "log"


def check_val_oscillation(b, d):
    fig = b.wait(lambda: b.figure(ids.METRIC_GRAPH), what="metric chart")
    assert d.evidence["metric"] in fig["layout"]["title"] and _bands(fig, "finding") == [tuple(d.steps)]
    x, y = _series(fig, d.evidence["metric"])
    late = (x >= d.steps[0]) & (x <= d.steps[1])
    assert late.sum() >= 10 and np.nanmax(y[late]) > 1.5 * np.nanmin(y[late])  # the swings


def check_slow_convergence(b, d):
    fig = b.wait(lambda: b.figure(ids.COMPARE_LOSS), what="compare chart")
    names = {(t["meta"] or {}).get("series") for t in fig["data"]}
    assert len({n for n in names if n}) == 2  # this run and the reference
    ref = next(n for n in names if n and "reference" in n)
    x, y = _series(fig, ref)
    assert np.nanmin(y[x <= d.evidence["reference_steps"]]) <= d.evidence["level"] * 1.0001


def check_precision_loss(b, d):
    fig = b.wait(lambda: b.figure(ids.FORMATS_PROBE), what="probe chart")
    t = next(t for t in fig["data"] if (t["meta"] or {}).get("series") == d.layers[0])
    assert t["meta"]["highlight"]
    bound = d.evidence["layers"][d.layers[0]]["bound"]
    assert np.nanmedian(np.asarray(t["y"], dtype=float)) > math.log10(bound)


def _format_bar(b, fmt_name, layer):
    fig = b.wait(lambda: b.figure(ids.FORMATS_SHARES), what="formats chart", timeout=40)
    t = next(t for t in fig["data"] if t["name"] == fmt_name)
    labels = list(t["y"])
    i = next(i for i, lab in enumerate(labels) if lab.startswith(layer + " ("))
    return fig, float(np.asarray(t["x"], dtype=float)[i])


def check_fp16_readiness(b, d):
    fig, lost = _format_bar(b, "FP16", d.layers[0])
    assert "worst in FP16 first" in fig["layout"]["title"] and lost > 0


def check_fp8_readiness(b, d):
    path = next(iter(d.evidence["layers"])).rsplit(" (", 1)[0]
    fig, lost = _format_bar(b, "E4M3", path)
    assert "worst in E4M3 first" in fig["layout"]["title"] and lost > 0


def check_rank_nonfinite(b, d):
    assert parse_qs(urlparse(b.driver.current_url).query)["run"][0].endswith(f"r-{d.ranks[0]}.db")  # its rank
    fig = _overview_finding(b, d, ids.LOSS_GRAPH)
    assert _covers(_bands(fig, "non-finite steps"), d.evidence["one_rank_steps"])


def check_rank_scale_divergence(b, d):
    fig = b.wait(lambda: b.figure(ids.RANKS_GRAPH), what="ranks chart")
    lines = {(t["meta"] or {}).get("rank"): t for t in fig["data"] if (t["meta"] or {}).get("rank") is not None}
    odd = d.ranks[0]
    before = d.evidence["loss_scale_before"]
    for r, t in lines.items():
        assert np.asarray(t["y"], dtype=float)[0] == math.log2(before[f"rank {r}"])
    assert lines[odd]["line"]["width"] > lines[next(r for r in lines if r != odd)]["line"]["width"]


def check_rank_straggler(b, d):
    fig = b.wait(lambda: b.figure(ids.RANKS_GRAPH), what="ranks chart")
    lines = {(t["meta"] or {}).get("rank"): t for t in fig["data"] if (t["meta"] or {}).get("rank") is not None}
    slow = d.evidence["rank"]
    med = {r: np.nanmedian(np.asarray(t["y"], dtype=float)) for r, t in lines.items()}
    assert max(med, key=med.get) == slow


def _layer_series(b, d, module):
    """The layer page of ``module``'s activations the finding's first link opened: (figure, x, y of its statistic)."""
    link = evidence.links(d)[0]
    stat = dict(link.params)["stat"]
    fig = b.wait(lambda: b.figure(ids.LAYER_SERIES), what="layer series")
    assert b.text("#layer-name") == f"{module} · activations"
    x, y = _series(fig, matrix.STATS[stat].label)
    return fig, x, y


def check_outlier_batch(b, d):
    step = d.steps[0]
    fig, x, y = _layer_series(b, d, d.evidence["operation"]["module"])
    assert "NaN/Inf" in fig["layout"]["title"]  # the operation made a NaN/Inf on that batch
    at = y[list(x).index(step)]
    assert at > 0 and at == np.nanmax(y)  # on that step, and on no other the chart shows more
    assert _covers(_bands(fig, "NaN/Inf recorded"), [step])
    assert _bands(fig, "finding") == [tuple(d.steps)]


def check_loss_spike(b, d):
    fig = _overview_finding(b, d, ids.LOSS_GRAPH)
    assert fig["layout"]["yaxis"]["type"] == "log"
    x, y = _series(fig, "loss")
    step = d.steps[0]
    assert y[list(x).index(step)] >= 10 * np.nanmedian(y[x < step])  # the spike, against the steps before it


def check_healed(b, d):
    fig, _, _ = _layer_series(b, d, d.evidence["module"])
    bands = _bands(fig, "NaN/Inf recorded")
    assert _covers(bands, d.evidence["confirmed_on"])  # the overflows whose replays confirmed the fix
    assert all(last < d.evidence["from_step"] for _, last in bands)  # none once it was kept in FP32


def check_division_by_zero(b, d):
    first = d.evidence["first_step"]
    fig, x, y = _layer_series(b, d, d.evidence["module"])
    assert "NaN/Inf" in fig["layout"]["title"] and y[list(x).index(first)] > 0
    assert _covers(_bands(fig, "NaN/Inf recorded"), [first])


def check_loss_nonfinite(b, d):
    fig = _overview_finding(b, d, ids.LOSS_GRAPH)
    assert _covers(_bands(fig, "non-finite steps"), d.evidence["loss_value_steps"])


def check_clip_before_unscale(b, d):
    fig = b.wait(lambda: b.figure(ids.NORM_GRAPH), what="gradient norm chart")
    _, y = _series(fig, "gradient norm")
    assert np.nanmedian(y) == pytest.approx(d.evidence["applied_norm_median"], rel=1e-3)  # max_norm / scale
    assert _bands(fig, "finding") == [tuple(d.steps)]


def _fsdp_units(b, d, rule):
    rows = b.wait(lambda: _table(b, ids.PRECISION_TABLE), what="precision table")
    shown = {r["module"]: r for r in rows}
    for unit in d.layers:
        assert rule in shown[unit]["verdict"] and shown[unit]["_highlight"]
    return shown


def check_fsdp_reduce_dtype(b, d):
    shown = _fsdp_units(b, d, "fsdp-reduce-dtype")
    for unit, u in d.evidence["units"].items():
        assert f"reduce {u['reduce']}" in shown[unit]["FSDP policy"]


def check_fsdp_fp16_scaler(b, d):
    shown = _fsdp_units(b, d, "fsdp-fp16-scaler")
    for unit in d.evidence["units"]:
        assert "param float16" in shown[unit]["FSDP policy"]


CHECKS = {
    name[len("check_") :].replace("_", "-"): fn for name, fn in dict(globals()).items() if name.startswith("check_")
}


def test_every_rule_has_a_check():
    assert set(CHECKS) == set(RULES)


@pytest.mark.parametrize("rule", list(RULES))
def test_a_findings_evidence_link_opens_the_view_that_proves_it(rule, rule_sites, browser):
    url, run, _, path, ref = rule_sites(rule)
    d = _finding(rule, path, ref)
    browser.open(f"{url}/?run={run}")

    def click():  # the card's first evidence link, clicked as a user does (a dcc.Link: no page reload)
        return browser.driver.execute_script(
            "var rule = arguments[0];"
            "var c = Array.from(document.querySelectorAll('.finding')).find(function (c) {"
            "  return c.querySelector('.rule-id').textContent === rule; });"
            "var a = c && c.querySelector('.evidence-link'); if (!a) return null; a.click(); return a.href;",
            rule,
        )

    href = browser.wait(click, timeout=60, what=f"the {rule} finding")
    target = urlparse(href)
    want = parse_qs(target.query)

    def arrived():  # the link's page with all of its parameters (the page may add its own settings)
        now = urlparse(browser.driver.current_url)
        have = parse_qs(now.query)
        return now.path == target.path and all(have.get(k) == v for k, v in want.items())

    # a click that lands while the cards are drawn again (a poll, on a loaded machine) is lost, as it would be for a
    # user, who clicks again
    for attempt in range(3):
        try:
            browser.wait(arrived, timeout=15, what="the evidence page")
            break
        except AssertionError:
            if attempt == 2:
                raise
            click()
    deadline = time.monotonic() + 30  # the page draws, then its figures arrive: check until they show it
    while True:
        try:
            CHECKS[rule](browser, d)
            break
        except (AssertionError, StopIteration, KeyError, IndexError, ValueError, TypeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert browser.errors() == []
