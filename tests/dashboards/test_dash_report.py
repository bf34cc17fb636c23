"""`ampdoctor report`: one self-contained, small HTML file with a table of contents, the findings linked to the
figures that prove them, drawn in Chromium from the file alone."""

import base64
import gzip
import html
import re

import pytest
from ampdoctor.dashboards import diagnosis, plotlyjs, report

import ampdoctor
from ampdoctor.cli import main
from ampdoctor.severity import WORST_FIRST


def _external_refs(text: str) -> list[str]:
    """src=/href= attributes of the HTML (script bodies aside) that would make the browser fetch something."""
    markup = re.sub(r"<script[^>]*>.*?</script>", "<script></script>", text, flags=re.S)
    return [
        m
        for m in re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", markup)
        if not m.startswith(("#", "data:", "javascript:"))
    ]


def test_report_is_self_contained_small_and_names_the_findings(traces, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", str(traces / "fp16_under.db"), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert _external_refs(text) == []
    assert not re.search(r"<script[^>]+src=", text) and not re.search(r"<link[^>]+href=", text)
    assert 'id="plotly-gz"' in text and "DecompressionStream" in text  # plotly.js inside, packed
    packed = re.search(r'<script type="application/octet-stream" id="plotly-gz">([^<]*)</script>', text).group(1)
    with open(plotlyjs.BUNDLE, "rb") as f:  # the partial bundle (the figures' trace types), not plotly.py's full one
        assert gzip.decompress(base64.b64decode(packed)) == f.read()
    assert len(text.encode()) < 1_000_000  # 0.76 MB; ~5 MB with plotly.js as text, ~2 MB with its full bundle packed
    found = diagnosis.findings(ampdoctor.load(traces / "fp16_under.db"))
    assert found
    for d in found:
        assert d.rule in text and d.title in text
    assert "<pre><code>scaler = torch.amp.GradScaler(" in text  # the fix, as code
    assert "Precision map" in text and "FP16 underflow share" in text


def test_table_of_contents_and_links_from_findings_to_figures(hostile):
    tr = ampdoctor.load(hostile[0])
    body = report.build_report(tr).split("</head>", 1)[1]
    anchors = set(re.findall(r'id="([^"]+)"', body))
    toc = re.search(r'<nav class="toc">(.*?)</nav>', body, flags=re.S).group(1)
    targets = re.findall(r'href="#([^"]+)"', toc)
    assert {"run", "findings", "figures", "precision", "formats"} <= set(targets)
    assert set(targets) <= anchors  # every entry lands somewhere
    found = diagnosis.findings(tr)
    for i, d in enumerate(found):
        card = re.search(rf'<div class="finding \w+" id="finding-{i}">(.*?)<h4>', body, flags=re.S).group(1)
        links = re.findall(r'class="evidence-link" href="#([^"]+)"', card)
        assert links and set(links) <= anchors, (d.rule, links)
    overflow = next(i for i, d in enumerate(found) if d.rule == "forward-overflow")
    card = re.search(rf'id="finding-{overflow}">(.*?)<h4>', body, flags=re.S).group(1)
    assert any(fid.startswith("fig-layer-") for fid in re.findall(r'href="#(fig-[^"]+)"', card))


def test_report_shows_real_findings_worst_first_with_evidence_and_fix(hostile):
    """A real run with faults of several severities: every finding with its rule, title, labelled evidence rows
    and fix as code, the worst first."""
    tr = ampdoctor.load(hostile[0])
    found = diagnosis.findings(tr)
    assert {"critical", "warning"} <= {d.severity for d in found}
    body = report.build_report(tr).split("</head>", 1)[1]
    shown = re.findall(
        r'<div class="finding (\w+)" id="finding-\d+"><div><span class="sev">\w+</span>'
        r'<span class="rule">([^<]+)<',
        body,
    )
    # the rules package's one order, as `ampdoctor diagnose` prints it: severity, then the registry's rule order
    assert [rule for _, rule in shown] == [d.rule for d in ampdoctor.diagnose(tr)]
    ranks = [WORST_FIRST[sev] for sev, _ in shown]
    assert ranks == sorted(ranks)  # worst first
    for d in found:
        assert f"<h3>{html.escape(d.title)}</h3>" in body
        for k, v in diagnosis.evidence_items(d):
            assert f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" in body
        code = [p.text for p in d.fix if p.kind == "code"]  # a fix the rule gives in words only has none
        assert all(f"<pre><code>{html.escape(c)}</code></pre>" in body for c in code)
    assert any(p.kind == "code" for d in found for p in d.fix)  # (and the run's faults do print code)
    assert "<td>None</td>" not in body


@pytest.mark.browser
def test_report_draws_every_figure_from_the_file_alone(hostile, tmp_path, browser):
    """Opened from disk in Chromium: plotly.js unpacks, every figure draws; the heat maps show their layers in one
    order, and the overflowing layer's row is not blank."""
    out = tmp_path / "r.html"
    report.write_report(ampdoctor.load(hostile[0]), str(out))
    browser.open(out.as_uri())
    browser.wait(
        lambda: browser.driver.execute_script("return document.body.getAttribute('data-drawn')"),
        timeout=30,
        what="the figures drawn",
    )
    n_figs = len(browser.css(".fig"))
    assert n_figs >= 5 and len(browser.css(".fig .main-svg")) >= n_figs
    assert browser.undrawn() == []  # every trace drawn as the type it asks for (plotly.js is a partial bundle)
    heat = browser.driver.execute_script(
        "return Array.from(document.querySelectorAll('.fig .js-plotly-plot')).filter(function (gd) {"
        "  return gd.data.length && gd.data[0].type === 'heatmap' && gd.data[0].meta && gd.data[0].meta.stat;"
        "}).map(function (gd) {"
        "  var f = gd._fullData;"  # (plotly's decoded arrays)
        "  return {rows: Array.from(f[0].y), kind: f[0].meta.kind, stat: f[0].meta.stat,"
        "          top: Array.from(f[0].z, function (r) { return Math.max.apply(null, Array.from(r)"
        "                 .map(function (v) { return v === null || isNaN(v) ? -Infinity : v; })); }),"
        "          black: f.length > 1 && f[1].type === 'heatmap' ? Array.from(f[1].z, function (r) {"
        "             return Array.from(r).some(function (v) { return v === 1; }); }) : []}; });"
    )
    orders = {tuple(h["rows"]) for h in heat}
    assert len(heat) >= 2 and len(orders) == 1  # the same layers, the same order, in every heat map
    rows = heat[0]["rows"]
    culprit = next(d for d in diagnosis.findings(ampdoctor.load(hostile[0])) if d.rule == "forward-overflow").layers[0]
    i = rows.index(html.escape(culprit, quote=False))
    for h in heat:
        if h["kind"] == "act":  # its Infs counted, or its NaN/Inf drawn black: never a blank row
            assert (h["black"] and h["black"][i]) or h["top"][i] > 0, h["stat"]
    assert browser.errors() == []


@pytest.mark.browser
def test_report_with_a_reference_draws_every_figure(traces, tmp_path, browser):
    """A run against its reference (the comparison's loss and layer bars too): every trace drawn as the type it asks
    for by the partial plotly.js the report embeds, each type the figures use among them, no console error."""
    out = tmp_path / "cmp.html"
    assert main(["report", str(traces / "fp16_bad.db"), "-o", str(out), "--reference", str(traces / "bf16.db")]) == 0
    browser.open(out.as_uri())
    browser.wait(
        lambda: browser.driver.execute_script("return document.body.getAttribute('data-drawn')"),
        timeout=30,
        what="the figures drawn",
    )
    assert browser.undrawn() == []
    assert browser.errors() == []
    drawn = browser.driver.execute_script(
        "return Array.from(document.querySelectorAll('.js-plotly-plot')).map(function (gd) {"
        "  return gd._fullData.map(function (t) { return t.type; }); })"
    )
    assert len(drawn) >= 6 and browser.css("#fig-compare-layers .main-svg")
    assert {t for fig in drawn for t in fig} == set(plotlyjs.TRACE_TYPES)  # each type the figures use
    # (the figures' template keeps plotly_white's settings of these types and of cartesian axes only: no other kind)
    kinds = browser.driver.execute_script(
        "return Array.from(document.querySelectorAll('.js-plotly-plot')).map(function (gd) {"
        "  var s = gd._fullLayout._subplots; return Object.keys(s).filter(function (k) { return s[k].length; }); })"
    )
    assert {k for fig in kinds for k in fig} <= {"cartesian", "xaxis", "yaxis"}, kinds


def test_report_with_reference_compares(traces, tmp_path):
    out = tmp_path / "cmp.html"
    assert main(["report", str(traces / "fp16_bad.db"), "-o", str(out), "--reference", str(traces / "bf16.db")]) == 0
    text = out.read_text()
    assert "Compared with the reference" in text and 'id="fig-compare-loss"' in text


@pytest.mark.parametrize(
    "name, reference", [("fp16_under.db", None), ("fp16_bad.db", None), ("bf16.db", None), ("fp16_bad.db", "bf16.db")]
)
def test_the_report_diagnoses_as_ampdoctor_diagnose(traces, name, reference):
    """The report keeps the rules' Run it diagnosed with (its reads serve the figures): the findings are exactly
    ``ampdoctor.diagnose``'s, in its order, evidence and fixes included."""
    tr = ampdoctor.load(traces / name)
    ref = ampdoctor.load(traces / reference) if reference else None
    found, run = diagnosis.diagnose_run(tr, ref)
    expected = ampdoctor.diagnose(tr, reference=ref) if ref is not None else ampdoctor.diagnose(tr)
    assert [d.to_dict() for d in found] == [d.to_dict() for d in expected]
    assert found or name == "bf16.db"  # (a healthy BF16 run has nothing to find)
    assert run.trace is tr and run.view.steps is run.view.steps  # one read, kept


@pytest.mark.parametrize(
    "argv, message",
    [
        (["report", "/no/such/trace.db"], "ampdoctor report: /no/such/trace.db: no such file"),
        (
            ["report", "{traces}/fp16_bad.db", "-o", "/no/such/dir/r.html"],
            "ampdoctor report: /no/such/dir: no such directory for the output",
        ),
    ],
)
def test_report_bad_usage_is_one_line_exit_2(traces, capsys, argv, message):
    argv = [a.format(traces=traces) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == message + "\n"


def test_report_on_a_corrupt_file_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"SQLite format 3\x00" + b"\x00" * 50)
    assert main(["report", str(bad), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ampdoctor: ") and "Traceback" not in err
