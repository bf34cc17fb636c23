"""The documentation's screenshots: every page of the dashboard on the demo's faulty run (the fixed run as the
reference), in Chromium.

Every run takes the screenshots and checks each shows its page; ``AMPDOCTOR_SCREENSHOTS=docs`` also saves them
there (docs/dashboard.png is the overview, docs/dashboard-<page>.png the others), so that a test run does not
rewrite tracked files by itself.
"""

import importlib.util
import os
import shutil
import struct
import sys

import pytest
import torch
from ampdoctor.dashboards import ids
from ampdoctor.dashboards.app import create_app

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.browser


def _demo():
    spec = importlib.util.spec_from_file_location("ampdoctor_demo", os.path.join(ROOT, "examples", "demo.py"))
    mod = sys.modules["ampdoctor_demo"] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(mod)
    return mod


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def demo_site(browser, tmp_path_factory):
    """The demo's faulty run (init scale too high) and its fixed rerun as the reference, served."""
    tmp = tmp_path_factory.mktemp("demo")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small gain nothing from threads; a loaded machine, ~10x
    try:
        r = _demo().cycle("init-scale", str(tmp / "runs" / "demo.db"), 100, show=False)
    finally:
        torch.set_num_threads(threads)
    url = browser.serve(create_app(r["faulty"], reference=r["fixed"], poll_ms=5000))
    return url, os.path.basename(r["faulty"])


PAGES = {  # name -> (path, what shows the page is drawn, its chart, window height)
    "dashboard": ("/?run={run}", f"#{ids.FINDINGS} .finding", ids.SCALE_GRAPH, 1700),
    "dashboard-layers": ("/layers?run={run}", f"#{ids.LAYERS_LIST} li", ids.LAYERS_HEATMAP, 1000),
    "dashboard-layer": ("/layer?run={run}&path=0&kind=grad_out&stat=fp16_under", "#layer-name", ids.LAYER_HIST, 1200),
    "dashboard-precision": ("/precision?run={run}", f"#{ids.PRECISION_TABLE}", None, 1000),
    "dashboard-whatif": ("/whatif?run={run}&init=1024", f"#{ids.WHATIF_SUMMARY}", ids.WHATIF_GRAPH, 1000),
    "dashboard-formats": ("/formats?run={run}", f"#{ids.FORMATS_TABLE}", ids.FORMATS_SHARES, 1300),
    "dashboard-compare": ("/compare?run={run}", f"#{ids.COMPARE_LOSS}", ids.COMPARE_LOSS, 1300),
}


@pytest.mark.parametrize("name", list(PAGES))
def test_screenshot_of_each_page(name, demo_site, browser, tmp_path):
    url, run = demo_site
    path, ready, graph, height = PAGES[name]
    target = os.environ.get("AMPDOCTOR_SCREENSHOTS")
    browser.driver.set_window_size(1400, height)
    try:
        browser.open(url + path.format(run=run))
        browser.wait(lambda: browser.css(ready), timeout=60, what=name)
        if graph:
            browser.wait(lambda: (browser.figure(graph) or {}).get("data"), timeout=60, what=f"{name} figure")
        if name == "dashboard":
            assert "GradScaler(" in browser.text(f"#{ids.FINDINGS}")  # the fix is on the page
        # two animation frames: what was drawn is on the screen
        browser.driver.execute_async_script(
            "var done = arguments[0]; requestAnimationFrame(function () { requestAnimationFrame(done); });"
        )
        shot = str(tmp_path / f"{name}.png")
        assert browser.driver.save_screenshot(shot)
        width, h = _png_size(shot)
        assert width >= 1200 and h >= 700
        assert os.path.getsize(shot) > 30_000, name  # a blank or error page compresses to a few kB
        assert browser.errors() == [], name
        if target:
            shutil.copy(shot, os.path.join(ROOT, target, f"{name}.png"))
    finally:
        browser.driver.set_window_size(1400, 1000)
