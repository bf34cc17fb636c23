"""The dashboard in a real (headless) Chromium, one browser for the module and apps on real threaded servers:
linked zoom that survives live updates, a URL that restores a view, 1,000 layers searchable and readable, the
What-if steppers, no cloud upload and no console error on any page, data downloads, live runs."""

import importlib.util
import os
import re
import threading
import time
from urllib.parse import parse_qs, urlparse

import numpy as np
import pytest
import runs
from ampdoctor.dashboards import ids, plotlyjs
from ampdoctor.dashboards.app import PAGES, create_app

pytestmark = pytest.mark.browser
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEP_CHARTS = (ids.LOSS_GRAPH, ids.SCALE_GRAPH, ids.NORM_GRAPH, ids.TIME_GRAPH)


@pytest.fixture(scope="module")
def site(traces, browser):
    """The test traces served once for the module."""
    return browser.serve(create_app(str(traces), poll_ms=1000))


def _query(browser) -> dict:
    return {k: v[0] for k, v in parse_qs(urlparse(browser.driver.current_url).query).items()}


def _range(browser, graph):
    fig = browser.figure(graph)
    return [round(v, 1) for v in fig["layout"]["xaxis"]["range"]] if fig else None


def _zoom(browser, graph, a, b):
    """Zoom a chart as a user's box zoom does (plotly emits the relayout event the page listens to)."""
    browser.driver.execute_script(
        "var gd = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');"
        "Plotly.relayout(gd, {'xaxis.range[0]': arguments[1], 'xaxis.range[1]': arguments[2]});",
        graph,
        a,
        b,
    )


def test_linked_zoom_survives_live_updates_and_goes_into_the_url(browser, tmp_path):
    """Zoom one chart of a run being written: every step chart follows, the range stays as new steps arrive
    (TensorBoard keeps it; the old dashboard reset [10, 40] to [0, 224] within 2.5 s), the URL carries it."""
    url = browser.serve(create_app(str(tmp_path), poll_ms=500))

    done = threading.Event()

    class Enough(Exception):
        pass

    def slow_batches():  # as slow as a real run until the test has seen what it needs; then the run stops
        for batch in runs.batches(400):
            if done.is_set():
                raise Enough
            time.sleep(0.05)
            yield batch

    def live_run():
        try:
            runs.train(runs.mlp(), steps=400, precision="fp16", trace=str(tmp_path / "live.db"), data=slow_batches())
        except Enough:
            pass

    t = threading.Thread(target=live_run, daemon=True)
    t.start()
    try:
        browser.open(f"{url}/")
        steps = browser.wait(
            lambda: int(browser.text(f"#{ids.STEP_COUNT}").split()[0]) >= 22 and browser.text(f"#{ids.STEP_COUNT}"),
            timeout=60,
            what="22 steps",
        )
        browser.wait(lambda: browser.figure(ids.LOSS_GRAPH), what="the loss chart")
        browser.driver.execute_script("window.__marker = 'not reloaded'")
        _zoom(browser, ids.LOSS_GRAPH, 5, 20)
        for g in STEP_CHARTS:
            browser.wait(lambda g=g: _range(browser, g) == [4.5, 20.5], what=f"{g} zoomed")
        assert browser.wait(lambda: _query(browser).get("x0") == "5" and _query(browser))["x1"] == "20"
        n0 = int(steps.split()[0])
        browser.wait(
            lambda: int(browser.text(f"#{ids.STEP_COUNT}").split()[0]) >= n0 + 5, timeout=60, what="5 more steps"
        )
        n1 = int(browser.text(f"#{ids.STEP_COUNT}").split()[0])
        browser.wait(  # and one more poll with new steps after that: the zoom is checked after live updates
            lambda: int(browser.text(f"#{ids.STEP_COUNT}").split()[0]) > n1, timeout=60, what="one more update"
        )
        assert [_range(browser, g) for g in STEP_CHARTS] == [[4.5, 20.5]] * 4
        assert browser.driver.execute_script("return window.__marker") == "not reloaded"
        # the whole run again: every chart, and the URL
        browser.css(f"#{ids.RESET_ZOOM}")[0].click()
        browser.wait(lambda: _range(browser, ids.SCALE_GRAPH)[1] > 21, what="zoom reset")
        assert "x0" not in browser.wait(lambda: "x0" not in _query(browser) and _query(browser))
    finally:
        done.set()
        t.join(60)
    assert browser.errors() == []


def _drawn(browser, graph_id):
    """The figure of ``graph_id`` once it has data (a page draws an empty one while its data is on the way)."""
    fig = browser.figure(graph_id)
    return fig if fig and fig["data"] else None


def test_a_url_restores_a_view(site, browser):
    """Kind, statistic, search, colour scale, zoom, smoothing and log-y come back from the address alone."""
    browser.open(f"{site}/layers?run=fp16_under.db&kind=act&stat=zeros&q=2&scale=log")
    fig = browser.wait(lambda: _drawn(browser, ids.LAYERS_HEATMAP), what="heat map")
    assert fig["layout"]["title"] == "zero share: activations"
    assert "log10" in browser.driver.execute_script(
        "return document.querySelector('#layers-heatmap .js-plotly-plot').data[0].colorbar.title.text"
    )
    labels = list(fig["data"][0]["y"])
    assert labels and all("2" in lab for lab in labels)
    assert browser.css(f"#{ids.LAYERS_SEARCH}")[0].get_attribute("value") == "2"
    # a change goes into the address bar; that address opens the same view
    box = browser.css(f"#{ids.LAYERS_SEARCH}")[0]
    box.clear()
    box.send_keys("1\n")
    browser.wait(lambda: _query(browser).get("q") == "1", what="q=1 in the URL")
    assert _query(browser)["stat"] == "zeros" and _query(browser)["kind"] == "act"
    again = browser.driver.current_url
    browser.open(again)
    fig = browser.wait(lambda: _drawn(browser, ids.LAYERS_HEATMAP), what="heat map")
    assert all("1" in lab for lab in fig["data"][0]["y"]) and fig["layout"]["title"] == "zero share: activations"
    # the overview: zoom, smoothing, log-y
    browser.open(f"{site}/?run=fp16_bad.db&x0=3&x1=12&smooth=0.9&logy=1")
    browser.wait(lambda: _range(browser, ids.LOSS_GRAPH) == [2.5, 12.5], what="zoom from the URL")
    fig = browser.figure(ids.LOSS_GRAPH)
    assert fig["layout"]["yaxis"]["type"] == "log"
    assert {t["meta"].get("smoothed") for t in fig["data"] if t["meta"]} >= {0.9}
    assert _range(browser, ids.SCALE_GRAPH) == [2.5, 12.5]
    assert browser.errors() == []


def test_a_view_left_before_its_settings_reach_the_address_bar_does_not_overwrite_the_next(site, browser):
    """Zoom the overview and follow a link at once, on a server slow to answer the zoom's address-bar write: the
    answer arrives on the next page and must leave its address alone (it put the overview's zoom on the layers
    page, and dropped the link's own parameters, on a loaded machine)."""
    browser.open(f"{site}/?run=fp16_bad.db")
    browser.wait(lambda: _drawn(browser, ids.LOSS_GRAPH), what="loss chart")
    # the network, slowed for the overview's address-bar writes only (all else answers as usual)
    browser.driver.execute_script(
        "var plain = window.fetch;"
        "window.fetch = function (url, opts) {"
        "  var body = (opts && typeof opts.body === 'string') ? opts.body : '';"
        "  var slow = body.indexOf('" + ids.URL_STATE + ".search') >= 0 && body.indexOf('" + ids.ZOOMS["/"] + "') >= 0;"
        "  var call = function () { return plain(url, opts); };"
        "  return slow ? new Promise(function (ok) { setTimeout(ok, 2500); }).then(call) : call(); };"
    )
    _zoom(browser, ids.LOSS_GRAPH, 3, 12)
    link = browser.wait(lambda: browser.css("a[href^='/layers?']"), what="a link to the layers page")[0]
    target = urlparse(link.get_attribute("href"))
    link.click()
    browser.wait(lambda: urlparse(browser.driver.current_url).path == "/layers", what="the layers page")
    time.sleep(4)  # the slowed write has landed by now
    now = urlparse(browser.driver.current_url)
    assert now.path == "/layers"
    have, want = parse_qs(now.query), parse_qs(target.query)
    assert all(have.get(k) == v for k, v in want.items())  # the link's parameters (the page may add its own)
    assert "x0" not in have and "x1" not in have  # and none of the overview's
    assert browser.errors() == []


def _tracegen():
    spec = importlib.util.spec_from_file_location("dash_tracegen", os.path.join(ROOT, "benchmarks", "dash_tracegen.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_thousand_layers_stay_searchable_and_readable(browser, tmp_path):
    """1,000 activation sites: a page of 50 rows at a time, every row labelled and no label on another, the total
    said (nothing silently cut), numbers whole; search narrows, grouping by module prefix merges."""
    _tracegen().generate(str(tmp_path / "wide.db"), 30, 2500)  # 1,000 modules: 1,000 activation sites
    url = browser.serve(create_app(str(tmp_path), poll_ms=5000))
    browser.open(f"{url}/layers?run=wide.db&kind=act&stat=absmax_log2")
    browser.wait(lambda: "1,000 layers" in browser.text(f"#{ids.LAYERS_COUNT}"), what="the count")
    assert "1–50 of 1,000" in browser.text(f"#{ids.LAYERS_COUNT}")
    browser.wait(lambda: len(browser.css(f"#{ids.LAYERS_HEATMAP} .ytick")) == 50, what="50 row labels")
    boxes = browser.driver.execute_script(
        "return Array.from(document.querySelectorAll('#layers-heatmap .ytick text')).map(function (t) {"
        "  var r = t.getBoundingClientRect(); return [r.top, r.bottom, t.textContent]; });"
    )
    boxes.sort()
    assert all(a[1] <= b[0] + 0.5 for a, b in zip(boxes, boxes[1:])), "row labels overlap"
    assert all(b[2] for b in boxes)
    assert len(browser.css(f"#{ids.LAYERS_LIST} li")) == 50
    cut = browser.driver.execute_script(
        "return Array.from(document.querySelectorAll('#layers-list .num')).filter(function (e) {"
        "  return e.scrollWidth > e.clientWidth + 1; }).length"
    )
    assert cut == 0
    # search
    box = browser.css(f"#{ids.LAYERS_SEARCH}")[0]
    box.send_keys("layers.12.\n")
    browser.wait(lambda: "6 of 1,000 layers" in browser.text(f"#{ids.LAYERS_COUNT}"), what="search result")
    labels = browser.wait(
        lambda: (
            len(browser.figure(ids.LAYERS_HEATMAP)["data"][0]["y"]) == 6
            and browser.figure(ids.LAYERS_HEATMAP)["data"][0]["y"]
        ),
        what="6 rows",
    )
    assert all("layers.12." in lab for lab in labels)
    # grouping by module prefix (encoder.layers.N: 167 groups of 6 modules), no search
    browser.open(f"{url}/layers?run=wide.db&kind=act&stat=absmax_log2&group=3")
    browser.wait(lambda: "1–50 of 167" in browser.text(f"#{ids.LAYERS_COUNT}"), what="groups")
    labels = browser.figure(ids.LAYERS_HEATMAP)["data"][0]["y"]
    assert all(lab.endswith(" layers)") and ".* (" in lab for lab in labels[:-1])
    assert browser.errors() == []


def test_whatif_steppers_double_and_halve(site, browser):
    browser.open(f"{site}/whatif?run=fp16_bad.db")
    browser.wait(lambda: "simulated:" in browser.text(f"#{ids.WHATIF_SUMMARY}"), what="the replay")
    box = browser.css(f"#{ids.WHATIF_INIT}")[0]
    start = float(box.get_attribute("value"))
    assert start == 2.0**24 and box.size["width"] >= 100  # wide enough for the number
    browser.css(f"#{ids.WHATIF_INIT}-double")[0].click()
    browser.wait(lambda: float(box.get_attribute("value")) == 2 * start, what="doubled")
    for _ in range(3):
        browser.css(f"#{ids.WHATIF_INIT}-halve")[0].click()
        time.sleep(0.3)
    browser.wait(lambda: float(box.get_attribute("value")) == start / 4, what="halved three times")
    browser.wait(lambda: f"init {start / 4:g}" in browser.text(f"#{ids.WHATIF_SUMMARY}"), what="the replay again")
    assert _query(browser)["init"] == f"{int(start / 4)}"
    interval = browser.css(f"#{ids.WHATIF_INTERVAL}")[0]
    browser.css(f"#{ids.WHATIF_INTERVAL}-halve")[0].click()
    browser.wait(lambda: interval.get_attribute("value") == "1000", what="interval halved")
    box.clear()
    box.send_keys("2^10\n")
    browser.wait(lambda: "init 1024" in browser.text(f"#{ids.WHATIF_SUMMARY}"), what="2^10 understood")
    assert browser.text(f"#{ids.WHATIF_SUMMARY}").startswith("simulated: 0 skipped")
    fig = browser.figure(ids.WHATIF_GRAPH)
    sim = next(t for t in fig["data"] if (t["meta"] or {}).get("series") == "simulated scale")
    assert np.asarray(sim["y"], dtype=float)[0] == 10
    assert not any("NaN" in str(e) for e in browser.driver.get_log("browser"))


@pytest.mark.parametrize("run", ["fp16_bad.db", "bf16.db", "ddp/run.rank1.db"])
def test_every_page_without_console_errors_or_cloud_upload(site, browser, run):
    """Every page of an overflowing FP16 run, a BF16 run and a rank of a 2-rank run: every chart drawn with the
    trace types it asks for (the dashboard loads a partial plotly.js: a type missing from it would draw nothing),
    no console error, no modebar button that uploads a chart anywhere."""
    charts = 0
    for path in [*PAGES, "/layer"]:
        browser.open(f"{site}{path}?run={run}" + ("&path=0&kind=grad_out" if path == "/layer" else ""))
        browser.wait(lambda: browser.css(f"#{ids.PAGE} > div"), what=f"{path} of {run}")
        browser.wait(lambda: not browser.css("[data-dash-is-loading]"), what=f"{path} of {run} drawn")
        browser.wait(lambda: not [p for p in browser.undrawn() if p.endswith("not drawn")], what=f"{path} charts")
        assert browser.undrawn() == [], (path, run)
        charts += len(browser.css(".js-plotly-plot"))
        titles = browser.driver.execute_script(
            "return Array.from(document.querySelectorAll('.modebar-btn')).map(function (b) {"
            "  return b.getAttribute('data-title') || ''; })"
        )
        assert not [t for t in titles if any(w in t.lower() for w in ("cloud", "share", "studio"))], titles
        assert browser.errors() == [], (path, run)
        assert browser.text(f"#{ids.ERROR}") == "", (path, run)
    assert charts >= 8  # the overview's four, the layers' heat map, the layer's, the what-if and formats charts


def test_only_the_partial_plotly_bundle_is_fetched_and_a_missing_trace_type_is_caught(site, browser):
    """The page fetches plotly.js once, the vendored partial bundle (its trace types, not plotly.py's full one's), of
    the plotly.js version plotly.py writes its figures for; a trace type that bundle lacks (scatter3d) is what
    ``undrawn`` reports (the check every page passes above)."""
    browser.open(f"{site}/layers?run=fp16_bad.db")
    browser.wait(lambda: browser.figure(ids.LAYERS_HEATMAP), what="the heat map")
    fetched = browser.driver.execute_script(
        "return performance.getEntriesByType('resource').filter(function (e) { return /plotly/i.test(e.name); })"
        ".map(function (e) { return new URL(e.name).pathname; })"
    )
    assert fetched == ["/" + plotlyjs.DASH_PATH]  # (its bytes: test_dash_http; here maybe from the browser's cache)
    assert browser.driver.execute_script("return Plotly.version") == plotlyjs.plotly_version()
    traces = set(browser.driver.execute_script("return Object.keys(Plotly.PlotSchema.get().traces)"))
    assert set(plotlyjs.TRACE_TYPES) <= traces and not traces & {"scatter3d", "scattergl", "choropleth", "table"}
    assert browser.undrawn() == []
    browser.driver.execute_script(
        "var d = document.createElement('div'); d.id = 'probe-3d'; document.body.appendChild(d);"
        "Plotly.newPlot(d, [{type: 'scatter3d', x: [1], y: [2], z: [3]}, {type: 'heatmap', z: [[1, 2]]}]);"
    )
    assert browser.undrawn() == ["probe-3d: trace 0 scatter3d drawn as scatter"]
    assert browser.errors() == []


def test_data_downloads_are_made_in_the_page(site, browser):
    """The CSV of a chart (its lines and bands) and of a table, made from what the page shows."""
    browser.open(f"{site}/?run=fp16_bad.db")
    # the chart with its lines (an empty placeholder figure is drawn first, while the callback runs)
    browser.wait(lambda: (browser.figure(ids.SCALE_GRAPH) or {}).get("data"), what="loss scale chart")
    csv = browser.driver.execute_script(
        "return window.ampdoctorCsv.figure(document.querySelector('#overview-scale .js-plotly-plot'))"
    )
    lines = csv.strip().splitlines()
    assert lines[0] == "trace,x,y,z" and lines[1].startswith("loss scale,0,24,")
    assert any(
        ln.startswith('"skipped steps (first step, last step)",0,')
        or ln.startswith("skipped steps (first step, last step),0,")
        for ln in lines
    )
    browser.open(f"{site}/precision?run=fp16_bad.db")
    browser.wait(lambda: browser.css(f"#{ids.PRECISION_TABLE}"), what="precision table")
    csv = browser.driver.execute_script(
        "return window.ampdoctorCsv.table(document.getElementById(arguments[0]))", ids.PRECISION_TABLE
    )
    assert csv.splitlines()[0] == "module,type,allocation,forward,backward,parameters,verdict"


def test_findings_link_layers_of_their_own_rank(traces, browser):
    """A rank's finding opens that rank's trace, never rank 0's; the Ranks page is offered for a multi-rank run."""
    url = browser.serve(create_app(str(traces / "ddp"), poll_ms=1000))
    browser.open(f"{url}/ranks?run=run.rank1.db&stat=loss_scale")
    fig = browser.wait(lambda: browser.figure(ids.RANKS_GRAPH), what="ranks chart")
    assert {(t["meta"] or {}).get("rank") for t in fig["data"]} >= {0, 1}
    assert browser.css("#nav-ranks")
    # the ranks a finding's link names stay in the address as the view changes (a reload shows them again)
    browser.open(f"{url}/ranks?run=run.rank1.db&stat=loss_scale&rank=1")
    browser.wait(lambda: _drawn(browser, ids.RANKS_GRAPH), what="ranks chart")
    _zoom(browser, ids.RANKS_GRAPH, 2, 9)
    browser.wait(lambda: _query(browser).get("x0") == "2", what="the zoom in the URL")
    assert _query(browser)["rank"] == "1" and _query(browser)["stat"] == "loss_scale"
    assert browser.errors() == []


def test_the_layers_page_keeps_a_findings_steps_and_layers_in_the_address(site, browser):
    """A finding's link to the Layers page names its layers (sel) and outlines its steps (hl): both stay in the
    address as the view changes, so a reload, a bookmark or Back shows what the link showed (the page rewrote the
    address without hl, and the evidence test then never saw the link's page: its CI failure)."""
    browser.open(f"{site}/layers?run=fp16_under.db&kind=grad_out&stat=fp16_under&sel=0&x0=0&x1=9&hl=2-5")
    browser.wait(lambda: _drawn(browser, ids.LAYERS_HEATMAP), what="heat map")
    _zoom(browser, ids.LAYERS_HEATMAP, 1, 7)
    browser.wait(lambda: _query(browser).get("x1") == "7", what="the zoom in the URL")
    q = _query(browser)
    assert q["hl"] == "2-5" and q["sel"] == "0" and q["kind"] == "grad_out"
    assert browser.errors() == []


def test_traversal_attempt_shows_unknown_run(traces, browser):
    url = browser.serve(create_app(str(traces / "ddp"), poll_ms=1000))
    browser.open(f"{url}/?run=../fp16_bad.db")
    browser.wait(lambda: browser.css("#unknown-run"), what="unknown run")
    assert "fp16_bad" not in browser.text(f"#{ids.PAGE}")
    assert browser.errors() == []


def test_heatmap_click_opens_the_layer_and_the_run_picker_switches_runs(site, browser):
    """A click on the heat map's top row opens that layer with the statistic shown; the picker opens the same
    view of another run (a layer detail goes to its overview: site ids differ between runs)."""
    from selenium.webdriver.common.action_chains import ActionChains

    browser.open(f"{site}/layers?run=fp16_under.db&kind=grad_out&stat=fp16_under")
    fig = browser.wait(lambda: _drawn(browser, ids.LAYERS_HEATMAP), what="heat map")  # (not the empty one first)
    top = fig["data"][0]["y"][0]
    drag = browser.wait(lambda: browser.css(f"#{ids.LAYERS_HEATMAP} .nsewdrag")[0], what="plot area")
    rows = len(fig["data"][0]["y"])
    # Plotly turns a click into clickData after a hover: move there, rest, move a pixel, click
    ActionChains(browser.driver).move_to_element(drag).perform()
    time.sleep(0.3)
    ActionChains(browser.driver).move_by_offset(
        2, -drag.size["height"] // 2 + drag.size["height"] // (2 * rows)
    ).perform()
    time.sleep(0.3)
    ActionChains(browser.driver).click().perform()
    browser.wait(lambda: browser.text("#layer-name") == f"{top} · output gradients", what="the layer")
    assert _query(browser)["stat"] == "fp16_under"
    fig = browser.wait(lambda: browser.figure(ids.LAYER_SERIES), what="its chart")
    assert "FP16 underflow share" in fig["layout"]["title"]
    browser.driver.execute_script("window.__marker = 1")
    browser.open(f"{site}/?run=fp16_under.db")
    browser.wait(lambda: browser.css(f"#{ids.RUN_PICKER}"), what="picker")
    browser.css(f"#{ids.RUN_PICKER}")[0].click()
    option = browser.wait(
        lambda: next(o for o in browser.css("[role=option]") if o.text.strip() == "bf16"), what="the bf16 option"
    )
    option.click()
    browser.wait(lambda: "bf16.db" in browser.text("#summary-table"), what="the other run")
    assert urlparse(browser.driver.current_url).path == "/" and _query(browser)["run"] == "bf16.db"
    assert browser.errors() == []


def test_dark_mode_follows_the_system(site, browser):
    """With the system in dark mode the page and the charts' text turn light on dark; back in light mode, dark on
    light."""

    def emulate(value):
        browser.driver.execute_cdp_cmd(
            "Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": value}]}
        )

    def colours():
        return browser.driver.execute_script(
            "var b = getComputedStyle(document.body).backgroundColor;"
            "var t = document.querySelector('#overview-loss .main-svg .gtitle');"
            "return [b, t ? getComputedStyle(t).fill : null];"
        )

    def level(rgb):
        return sum(int(v) for v in re.findall(r"\d+", rgb)[:3]) / 3

    try:
        emulate("dark")
        browser.open(f"{site}/?run=fp16_bad.db")
        browser.wait(lambda: browser.figure(ids.LOSS_GRAPH), what="chart")
        bg, title = browser.wait(lambda: colours()[1] and colours(), what="colours")
        assert level(bg) < 60 and level(title) > 180
        emulate("light")
        bg, title = colours()
        assert level(bg) > 200 and level(title) < 120
    finally:
        emulate("")
