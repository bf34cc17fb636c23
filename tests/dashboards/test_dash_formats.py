"""The Formats page, its figures and the report's Formats section on a real probed run with a fragile layer."""

import numpy as np
import pandas as pd
import probe_models as M
import pytest
from ampdoctor.dashboards import data, figures, ids
from ampdoctor.dashboards.app import create_app, render
from ampdoctor.dashboards.pages import formats
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
    table = data.format_table(tr)
    labels, lost = data.formats_shares(table, "e4m3")
    fig = figures.formats_figure(labels, lost, "E4M3")
    if not any(np.nan_to_num(np.asarray(v, dtype=float)).any() for v in lost.values()):
        assert "no site would lose values" in fig.layout.annotations[0].text  # a sentence, not empty axes
    else:
        assert {t.name for t in fig.data} == {"FP16", "BF16", "E4M3", "E5M2"} and len(fig.data[0].y) == len(labels)
        e4m3 = np.nan_to_num(np.asarray(next(t for t in fig.data if t.name == "E4M3").x, dtype=float))
        assert list(e4m3) == sorted(e4m3, reverse=True)  # ranked by the format asked for
    rows = data.formats_rows(table, "fp16")
    assert rows and set(rows[0]) >= {"layer", "kind", "E4M3 lost", "E5M2 lost", "FP16 headroom (binades)"}
    assert len(rows) == len(table)  # every site (the page pages through them), none dropped


def test_formats_page_and_report_section(probed, tmp_path, monkeypatch):
    """The page's table comes with the diagnosis (the diagnosis process computes it from the rules' reads of the
    trace, and it is cached on disk with the findings): while the diagnosis runs the page says so, then it shows
    exactly what ampdoctor.whatif.formats_table computes from the file."""
    monkeypatch.setenv("AMPDOCTOR_CACHE_DIR", str(tmp_path))
    ctx = create_app(str(probed)).ampdoctor
    _, page = render(ctx, "/formats", "?run=frag.db")
    assert ids.FORMATS_PROBE in str(page) and ids.FORMATS_SHARES in str(page)
    _, shares, listing, _ = formats.update(ctx, "fp16", "", 1, None, "?run=frag.db")[1:]
    if listing is None:  # the diagnosis is still running: the chart says so, it is not blank
        assert "diagnosing" in shares.layout.annotations[0].text
    assert ctx.findings_and_error("frag.db")[1] is None  # (waits for the diagnosis)
    table, state, error = ctx.formats_table("frag.db")
    assert error is None and state.current
    pd.testing.assert_frame_equal(table, data.format_table(ampdoctor.load(str(probed / "frag.db"))))
    again = create_app(str(probed)).ampdoctor  # a restart: from the cache on disk, with the findings
    assert again.findings_and_error("frag.db")[1] is None
    pd.testing.assert_frame_equal(again.formats_table("frag.db")[0], table)
    verdict, _, _, table, _ = formats.update(ctx, "fp16", "", 1, None, "?run=frag.db")
    assert verdict == "Measured precision loss: 0" and ids.FORMATS_TABLE in str(table)
    html = build_report(ctx.trace("frag.db"))
    assert '<h2 id="formats">Formats</h2>' in html and "Measured precision loss (against FP32): 0" in html


@pytest.mark.browser
def test_formats_page_in_the_browser(browser, probed):
    url = browser.serve(create_app(str(probed), poll_ms=1000))
    browser.open(f"{url}/formats?run=frag.db")
    browser.wait(lambda: browser.text(f"#{ids.FORMATS_VERDICT}") == "Measured precision loss: 0", what="verdict")
    browser.wait(lambda: browser.figure(ids.FORMATS_PROBE), what="probe chart")

    def ranked():  # (a placeholder chart stands while the diagnosis computes the formats table)
        fig = browser.figure(ids.FORMATS_SHARES)
        return fig if fig and "worst in" in (fig["layout"]["title"] or "") else None

    fig = browser.wait(ranked, timeout=60, what="shares chart")
    assert "worst in FP16 first" in fig["layout"]["title"]  # an FP16 run: ranked by what FP16 loses
    assert "E4M3 lost" in browser.wait(lambda: browser.text(f"#{ids.FORMATS_TABLE}"), what="table")
    assert browser.errors() == []
