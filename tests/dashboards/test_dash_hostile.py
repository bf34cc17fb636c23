"""Names are user data: a layer named like an attack shows as text in the browser, the report and the terminal."""

import html
import time

import pytest
from ampdoctor.dashboards import ids
from ampdoctor.dashboards.app import create_app

from ampdoctor.cli import main


@pytest.mark.browser
def test_hostile_names_are_text_in_the_browser_and_bad_input_is_a_message(dash_duo, hostile, tracker):
    path, _name = hostile
    port, fetched = tracker
    dash_duo.start_server(create_app(str(path.parent), poll_ms=1000))
    base = dash_duo.server_url

    # the forward-overflow finding names the layer in its recommendation: as text, no image fetched
    dash_duo.wait_for_page(f"{base}/?run=hostile.db", timeout=20)
    dash_duo.wait_for_contains_text(".finding", "in FP32 inside autocast", timeout=20)
    time.sleep(0.5)
    assert fetched == []
    card = dash_duo.find_element(".finding").text
    assert f"Run ![t](http://localhost:{port}/md)<a href='http://localhost:{port}/a'>a</a><b>B</b>" in card
    assert dash_duo.find_elements(f"#{ids.PAGE} img") == [] and dash_duo.find_elements(".finding a[href^=http]") == []

    # the heat map's row labels: the name as written, not a link, not bold
    dash_duo.wait_for_page(f"{base}/layers?run=hostile.db&kind=act", timeout=20)
    dash_duo.wait_for_element(f"#{ids.LAYERS_HEATMAP} .ytick", timeout=20)
    labels = [e.get_attribute("textContent") for e in dash_duo.find_elements(f"#{ids.LAYERS_HEATMAP} .ytick")]
    assert any(f"<a href='http://localhost:{port}/a'>a</a><b>B</b>" in t for t in labels), labels
    assert dash_duo.find_elements(f"#{ids.LAYERS_HEATMAP} a") == []

    # What-if: a backoff factor GradScaler refuses is a message on the page
    dash_duo.wait_for_page(f"{base}/whatif?run=hostile.db", timeout=20)
    dash_duo.wait_for_contains_text(f"#{ids.WHATIF_SUMMARY}", "simulated:", timeout=20)
    box = dash_duo.find_element(f"#{ids.WHATIF_BACKOFF}")
    box.clear()
    box.send_keys("5\n")
    dash_duo.wait_for_contains_text("#whatif-error", "backoff factor should be a number between 0 and 1", timeout=20)

    # a site id that str.isdigit() accepts but int() does not
    dash_duo.wait_for_page(f"{base}/layer?run=hostile.db&site=%C2%B2", timeout=20)
    dash_duo.wait_for_element("#no-such-layer", timeout=20)
    assert dash_duo.find_element(f"#{ids.ERROR}").text == ""
    time.sleep(0.5)
    assert fetched == []
    assert [e for e in dash_duo.get_logs() or [] if e.get("level") == "SEVERE"] == []


def test_report_shows_hostile_names_as_text(hostile, tmp_path):
    path, name = hostile
    out = tmp_path / "hostile.html"
    assert main(["report", str(path), "-o", str(out)]) == 0
    body = out.read_text().split("</head>", 1)[1]  # plotly.js aside
    assert f"<h3>Forward overflow in {html.escape(name)}</h3>" in body
    # in the figures' JSON (where plotly writes "<" as \u003c) the name arrives as entities plotly shows as text
    assert "&lt;a href='http:\\u002f\\u002flocalhost" in body
    assert "\\u003ca href" not in body and "\\u003cb\\u003e" not in body


def test_report_against_a_reference_whose_layers_are_all_nan(hostile, traces, tmp_path):
    """Every gradient statistic of the overflowing run is NaN: as a reference its layers compare with nothing."""
    out = tmp_path / "cmp.html"
    assert main(["report", str(traces / "fp16_bad.db"), "-o", str(out), "--reference", str(hostile[0])]) == 0
    assert "Compared with the reference" in out.read_text()


@pytest.mark.parametrize("argv", [["info"], ["layers", "--kind", "act"], ["diagnose"]])
def test_cli_prints_control_characters_as_escapes(hostile, capsys, argv):
    path, _ = hostile
    main([argv[0], str(path), *argv[1:]])
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b]0;pwned\\x07" in out


@pytest.mark.browser
def test_every_page_renders_under_the_content_security_policy(dash_duo, traces):
    """Issue 21, item 11: the pages carry a CSP (this server's scripts, Dash's one inline script by its hash,
    no framing). Chromium enforces it: every page still draws its figures and tables, and the console has no
    error (a blocked script or style would be one)."""
    import urllib.request

    # a long poll: the test does not wait for new steps (and no poll races the first render)
    dash_duo.start_server(create_app(str(traces), poll_ms=600_000, reference=str(traces / "bf16.db")))
    base = dash_duo.server_url
    with urllib.request.urlopen(f"{base}/?run=fp16_bad.db", timeout=30) as r:  # what the browser is served
        assert "frame-ancestors 'none'" in r.headers["Content-Security-Policy"]
        assert r.headers["X-Frame-Options"] == "DENY"
    for path, ready in (
        ("/", f"#{ids.LOSS_GRAPH} .main-svg"),
        ("/", ".finding"),
        ("/layers", f"#{ids.LAYERS_HEATMAP} .hm"),
        ("/layer", f"#{ids.LAYER_HIST} .main-svg"),
        ("/precision", f"#{ids.PRECISION_TABLE} td"),
        ("/whatif", f"#{ids.WHATIF_GRAPH} .main-svg"),
        ("/formats", f"#{ids.FORMATS_SHARES} .main-svg"),
        ("/compare", f"#{ids.COMPARE_LOSS} .main-svg"),
    ):
        query = "?run=fp16_bad.db" + ("&site=8" if path == "/layer" else "")
        dash_duo.wait_for_page(f"{base}{path}{query}", timeout=20)
        dash_duo.wait_for_element(ready, timeout=30)
        assert dash_duo.find_element(f"#{ids.ERROR}").text == "", path
    errors = [e for e in dash_duo.get_logs() or [] if e.get("level") == "SEVERE"]
    assert errors == [], errors
