"""Names are user data: a layer named like an attack shows as text in the browser, the report and the terminal."""

import html
import time

import pytest
from ampdoctor.dashboards import ids
from ampdoctor.dashboards.app import create_app

from ampdoctor.cli import main


@pytest.mark.browser
def test_hostile_names_are_text_in_the_browser_and_bad_input_is_a_message(browser, hostile, tracker):
    path, _name = hostile
    port, fetched = tracker
    base = browser.serve(create_app(str(path.parent), poll_ms=1000))

    # the forward-overflow finding names the layer in its title, summary and fix: as text, no image fetched
    browser.open(f"{base}/?run=hostile.db")
    shown = f"![t](http://localhost:{port}/md)<a href='http://localhost:{port}/a'>a</a><b>B</b>"
    card = browser.wait(
        lambda: next((c.text for c in browser.css(".finding") if "Forward overflow in" in c.text), None),
        timeout=60,
        what="the forward-overflow finding",
    )
    assert f"Forward overflow in {shown}" in card and f"finite with {shown}" in card  # (the fix checked)
    assert fetched == []
    assert browser.css(f"#{ids.PAGE} img") == [] and browser.css(".finding a[href^=http]") == []

    # the heat map's row labels: the name as written, not a link, not bold
    browser.open(f"{base}/layers?run=hostile.db&kind=act")
    browser.wait(lambda: browser.css(f"#{ids.LAYERS_HEATMAP} .ytick"), what="row labels")
    labels = [e.get_attribute("textContent") for e in browser.css(f"#{ids.LAYERS_HEATMAP} .ytick")]
    assert any(f"<a href='http://localhost:{port}/a'>a</a><b>B</b>" in t for t in labels), labels
    assert browser.css(f"#{ids.LAYERS_HEATMAP} a") == []

    # a table's cells (drawn in the browser from the rows' JSON): the name as written, no element made of it
    browser.open(f"{base}/formats?run=hostile.db&q=pwn")
    cells = browser.wait(
        lambda: [c for c in browser.css(f"#{ids.FORMATS_TABLE} td") if shown in c.get_attribute("textContent")],
        timeout=60,
        what="the layer's row in the formats table",
    )
    assert cells and browser.css(f"#{ids.FORMATS_TABLE} a, #{ids.FORMATS_TABLE} b, #{ids.FORMATS_TABLE} img") == []
    heads = [c.get_attribute("textContent") for c in browser.css(f"#{ids.FORMATS_TABLE} th")]
    assert heads[:2] == ["layer", "kind"] and "E4M3 lost" in heads

    # What-if: a backoff factor GradScaler refuses is a message on the page
    browser.open(f"{base}/whatif?run=hostile.db")
    browser.wait(lambda: "simulated:" in browser.text(f"#{ids.WHATIF_SUMMARY}"), what="the replay")
    box = browser.css(f"#{ids.WHATIF_BACKOFF}")[0]
    box.clear()
    box.send_keys("5\n")
    browser.wait(
        lambda: "backoff factor should be a number between 0 and 1" in browser.text("#whatif-error"), what="error"
    )

    # a site id that str.isdigit() accepts but int() does not
    browser.open(f"{base}/layer?run=hostile.db&site=%C2%B2")
    browser.wait(lambda: browser.css("#no-such-layer"), what="no such layer")
    assert browser.text(f"#{ids.ERROR}") == ""
    time.sleep(0.5)
    assert fetched == []
    assert browser.errors() == []


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
    app = create_app(str(traces), poll_ms=600_000, reference=str(traces / "bf16.db"))
    # diagnosed before the browser comes (the test is about the policy, not how long a loaded machine takes to
    # start the diagnosis's process): the overview's findings come from the cache
    assert app.ampdoctor.findings_and_error("fp16_bad.db", wait=120)[0]
    dash_duo.start_server(app)
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
