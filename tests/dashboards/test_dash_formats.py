"""The Formats page, its figures and the report's Formats section on a real probed run with a fragile layer."""

import probe_models as M
import pytest
from ampdoctor.dashboards import data, figures, ids
from ampdoctor.dashboards.app import create_app, render
from ampdoctor.dashboards.report import build_report

import ampdoctor


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    d = tmp_path_factory.mktemp("formats")
    M.train(
        M.standardize_model(),
        M.tabular(20),
        20,
        str(d / "frag.db"),
        attach_options={"probe_every": 5, "every": 5, "hist_every": 5, "live": False},
    )
    return d


def test_figures_show_the_probe_error_and_the_format_shares(probed):
    tr = ampdoctor.load(str(probed / "frag.db"))
    series, bounds, verdicts = data.probe_series(tr)
    assert next(iter(series)) == "0" and verdicts[0]["named"] and not any(v["named"] for v in verdicts[1:])
    fig = figures.probe_error_figure(series, bounds)
    names = [t.name for t in fig.data if t.showlegend is not False]
    assert names[0] == "0" and len(fig.data[0].x) == 4  # probed at steps 0, 5, 10, 15
    labels, lost = data.formats_shares(tr)
    fig = figures.formats_figure(labels, lost)
    assert {t.name for t in fig.data} == {"FP16", "BF16", "E4M3", "E5M2"} and len(fig.data[0].y) == len(labels)
    rows = data.formats_rows(tr)
    assert rows and set(rows[0]) >= {"layer", "kind", "E4M3 lost", "E5M2 lost", "FP16 headroom (binades)"}


def test_formats_page_and_report_section(probed):
    ctx = create_app(str(probed)).ampdoctor
    _, page = render(ctx, "/formats", "?run=frag.db")
    text = str(page)
    assert ids.FORMATS_PROBE in text and ids.FORMATS_TABLE in text and "Measured precision loss: 0" in text
    html = build_report(ctx.trace("frag.db"))
    assert "<h2>Formats</h2>" in html and "Measured precision loss (against FP32): 0" in html


@pytest.mark.browser
def test_formats_page_in_the_browser(dash_duo, probed):
    dash_duo.start_server(create_app(str(probed), poll_ms=1000))
    dash_duo.wait_for_page(f"{dash_duo.server_url}/formats?run=frag.db", timeout=20)
    dash_duo.wait_for_text_to_equal(f"#{ids.FORMATS_VERDICT}", "Measured precision loss: 0", timeout=20)
    dash_duo.wait_for_element(f"#{ids.FORMATS_PROBE} .main-svg", timeout=20)
    dash_duo.wait_for_element(f"#{ids.FORMATS_SHARES} .main-svg", timeout=20)
    assert "E4M3 lost" in dash_duo.find_element(f"#{ids.FORMATS_TABLE}").text
    errors = [e for e in dash_duo.get_logs() or [] if e.get("level") == "SEVERE"]
    assert errors == [], errors
