"""The README's screenshot: the dashboard on the demo's faulty run (with the fixed run as reference), in Chromium.

Every run takes the screenshot and checks it shows the page; ``AMPDOCTOR_SCREENSHOT=docs/dashboard.png`` also
saves it there (the file the README shows), so that a test run does not rewrite a tracked file by itself.
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


def test_dashboard_screenshot_of_the_demo(dash_duo, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small gain nothing from threads; a loaded machine, ~10x
    try:
        r = _demo().cycle("init-scale", str(tmp_path / "runs" / "demo.db"), 100, show=False)
    finally:
        torch.set_num_threads(threads)
    app = create_app(r["faulty"], reference=r["fixed"], poll_ms=5000)
    dash_duo.start_server(app)
    dash_duo.driver.set_window_size(1400, 1700)
    dash_duo.wait_for_page(f"{dash_duo.server_url}/", timeout=20)
    dash_duo.wait_for_contains_text(f"#{ids.FINDINGS}", "init-scale-too-high", timeout=30)
    dash_duo.wait_for_element(f"#{ids.LOSS_GRAPH} .main-svg", timeout=30)
    dash_duo.wait_for_element(f"#{ids.SCALE_GRAPH} .main-svg", timeout=30)
    assert "GradScaler(" in dash_duo.find_element(f"#{ids.FINDINGS}").text  # the fix is on the page
    shot = str(tmp_path / "dashboard.png")
    assert dash_duo.driver.save_screenshot(shot)
    width, height = _png_size(shot)
    assert width >= 1200 and height >= 1200
    assert os.path.getsize(shot) > 50_000  # a blank or error page compresses to a few kB
    errors = [e for e in dash_duo.get_logs() or [] if e.get("level") == "SEVERE"]
    assert errors == [], errors
    target = os.environ.get("AMPDOCTOR_SCREENSHOT")
    if target:
        shutil.copy(shot, os.path.join(ROOT, target))
