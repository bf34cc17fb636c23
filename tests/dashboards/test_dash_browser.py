"""The dashboard in a real (headless) Chromium: findings, layer detail, what-if, live updates, no console errors."""

import base64
import threading
import time

import numpy as np
import pytest
import runs
from ampdoctor.dashboards import diagnosis, ids
from ampdoctor.dashboards.app import create_app
from selenium.webdriver.common.action_chains import ActionChains

pytestmark = pytest.mark.browser


def _array(v):
    """A figure array as the browser holds it: a list, or plotly's typed-array encoding {dtype, bdata}."""
    if isinstance(v, dict):
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
    return np.asarray(v)


def _no_console_errors(dash_duo):
    errors = [e for e in dash_duo.get_logs() or [] if e.get("level") == "SEVERE"]
    assert errors == [], errors


def test_overview_findings_layer_detail_and_whatif(dash_duo, traces):
    app = create_app(str(traces), poll_ms=1000)
    dash_duo.start_server(app)
    dash_duo.wait_for_page(f"{dash_duo.server_url}/?run=fp16_under.db", timeout=20)
    dash_duo.wait_for_element(".finding", timeout=20)
    cards = dash_duo.find_elements(".finding")
    text = " ".join(c.text for c in cards)
    first = diagnosis.findings(app.ampdoctor.trace("fp16_under.db"))[0]
    assert first.rule in text and first.title in text
    assert first.layers and first.layers[0] in dash_duo.find_elements(".finding .culprit")[0].text
    dash_duo.wait_for_text_to_equal(f"#{ids.STEP_COUNT}", "30 steps", timeout=10)
    _no_console_errors(dash_duo)

    # layers: the list is sorted worst first; clicking a layer opens its detail
    dash_duo.find_element("#nav-layers").click()
    dash_duo.wait_for_element(".layer-link", timeout=20)
    link = dash_duo.find_elements(".layer-link")[0]
    name = link.text
    link.click()
    dash_duo.wait_for_element("#layer-name", timeout=20)
    assert dash_duo.find_element("#layer-name").text.startswith(name + " · grad_out")
    dash_duo.wait_for_element(f"#{ids.LAYER_HIST} .main-svg", timeout=20)
    _no_console_errors(dash_duo)

    # ... and so does a click on the heat map's top row (the worst layer). Plotly turns a click into clickData
    # only after a hover, so the mouse moves there, rests, moves a pixel, then clicks.
    dash_duo.find_element("#nav-layers").click()
    dash_duo.wait_for_element(f"#{ids.LAYERS_HEATMAP} .hm", timeout=20)  # the heat map is drawn
    time.sleep(1.5)  # and the first poll has redrawn it
    drag = dash_duo.find_element(f"#{ids.LAYERS_HEATMAP} .nsewdrag")
    rows = len(dash_duo.find_elements(".layer-link"))
    top = -drag.size["height"] // 2 + drag.size["height"] // (2 * rows)  # centre of the top row
    ActionChains(dash_duo.driver).move_to_element(drag).perform()
    time.sleep(0.4)
    ActionChains(dash_duo.driver).move_by_offset(2, top).perform()
    time.sleep(0.4)
    ActionChains(dash_duo.driver).click().perform()
    dash_duo.wait_for_element("#layer-name", timeout=20)
    assert dash_duo.find_element("#layer-name").text.startswith(name + " · grad_out")
    assert "/layer?" in dash_duo.driver.current_url

    # the run picker switches runs
    dash_duo.select_dcc_dropdown(f"#{ids.RUN_PICKER}", value="bf16")
    dash_duo.wait_for_contains_text("#summary-table", "bf16.db", timeout=20)
    assert dash_duo.driver.current_url.endswith("/?run=bf16.db")  # a layer of another run makes no sense
    _no_console_errors(dash_duo)

    # what-if: a lower init scale removes the overflow skips of the start
    dash_duo.wait_for_page(f"{dash_duo.server_url}/whatif?run=fp16_bad.db", timeout=20)
    dash_duo.wait_for_contains_text(f"#{ids.WHATIF_SUMMARY}", "simulated:", timeout=20)
    before = dash_duo.find_element(f"#{ids.WHATIF_SUMMARY}").text
    box = dash_duo.find_element(f"#{ids.WHATIF_INIT}")
    box.clear()
    box.send_keys("1024\n")
    dash_duo.wait_for_contains_text(f"#{ids.WHATIF_SUMMARY}", "init 1024", timeout=20)
    after = dash_duo.find_element(f"#{ids.WHATIF_SUMMARY}").text
    assert before != after and after.startswith("simulated: 0 skipped")
    sim = dash_duo.driver.execute_script(
        f"return document.querySelector('#{ids.WHATIF_GRAPH} .js-plotly-plot').data"
        ".filter(t => t.name === 'simulated scale')[0].y"
    )
    assert _array(sim)[0] == 10  # log2(1024)
    _no_console_errors(dash_duo)


def test_traversal_attempt_shows_unknown_run(dash_duo, traces):
    dash_duo.start_server(create_app(str(traces / "ddp"), poll_ms=1000))
    dash_duo.wait_for_page(f"{dash_duo.server_url}/?run=../fp16_bad.db", timeout=20)
    dash_duo.wait_for_element("#unknown-run", timeout=20)
    assert "fp16_bad" not in dash_duo.find_element(f"#{ids.PAGE}").text
    _no_console_errors(dash_duo)


def test_live_run_new_steps_appear_without_reload(dash_duo, tmp_path):
    """Open the dashboard on an empty directory, then train: the run appears and its steps grow, no reload."""
    dash_duo.start_server(create_app(str(tmp_path), poll_ms=1000))
    dash_duo.wait_for_page(f"{dash_duo.server_url}/", timeout=20)
    dash_duo.wait_for_contains_text(f"#{ids.PAGE}", "No traces yet", timeout=20)
    dash_duo.driver.execute_script("window.__marker = 'not reloaded'")

    def slow_batches():
        for batch in runs.batches(60):
            time.sleep(0.15)
            yield batch

    t = threading.Thread(
        target=runs.train,
        args=(runs.mlp(),),
        daemon=True,
        kwargs=dict(steps=60, precision="bf16", trace=str(tmp_path / "live.db"), data=slow_batches()),
    )
    t.start()
    dash_duo.wait_for_contains_text(f"#{ids.STEP_COUNT}", "steps", timeout=30)
    first = int(dash_duo.find_element(f"#{ids.STEP_COUNT}").text.split()[0])
    deadline = time.time() + 15
    now = first
    while time.time() < deadline and now <= first:
        time.sleep(0.5)
        now = int(dash_duo.find_element(f"#{ids.STEP_COUNT}").text.split()[0])
    assert now > first
    assert dash_duo.driver.execute_script("return window.__marker") == "not reloaded"
    t.join(60)
    assert not t.is_alive()
    dash_duo.wait_for_text_to_equal(f"#{ids.STEP_COUNT}", "60 steps", timeout=10)
    _no_console_errors(dash_duo)
