"""`ampdoctor report`: one self-contained HTML file that names the findings."""

import html
import re

import pytest
from ampdoctor.dashboards import diagnosis, report

import ampdoctor
from ampdoctor.cli import main


def _external_refs(text: str) -> list[str]:
    """src=/href= attributes of the HTML (script bodies aside: plotly.js holds URL strings it never fetches) that
    would make the browser fetch something."""
    markup = re.sub(r"<script[^>]*>.*?</script>", "<script></script>", text, flags=re.S)
    return [
        m
        for m in re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", markup)
        if not m.startswith(("#", "data:", "javascript:"))
    ]


def test_report_is_self_contained_and_names_the_findings(traces, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", str(traces / "fp16_under.db"), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert _external_refs(text) == []
    assert not re.search(r"<script[^>]+src=", text) and not re.search(r"<link[^>]+href=", text)
    assert "Plotly.newPlot" in text and len(text) > 1_000_000  # plotly.js embedded, ~4.5 MB
    found = diagnosis.findings(ampdoctor.load(traces / "fp16_under.db"))
    assert found
    for d in found:
        assert d.rule in text and d.title in text
    assert "<pre><code>scaler = torch.amp.GradScaler(" in text  # the fix, as code
    assert "Precision map" in text and "FP16 underflow share" in text


def test_report_with_reference_compares(traces, tmp_path):
    out = tmp_path / "cmp.html"
    assert main(["report", str(traces / "fp16_bad.db"), "-o", str(out), "--reference", str(traces / "bf16.db")]) == 0
    text = out.read_text()
    assert "Compared with the reference" in text and "Loss: run vs reference" in text


def test_report_shows_real_findings_worst_first_with_evidence_and_fix(hostile):
    """A real run with two faults (a critical and a warning finding): every finding with its rule, title,
    evidence rows and fix as code, the worst first."""
    tr = ampdoctor.load(hostile[0])
    found = diagnosis.findings(tr)
    assert {"critical", "warning"} <= {d.severity for d in found}
    body = report.build_report(tr).split("</head>", 1)[1]
    shown = re.findall(r'<div class="finding (\w+)"><div><span class="sev">\w+</span><span class="rule">([^<]+)<', body)
    assert sorted(rule for _, rule in shown) == sorted(d.rule for d in found)
    ranks = [diagnosis.SEVERITY_ORDER[sev] for sev, _ in shown]
    assert ranks == sorted(ranks)  # worst first
    for d in found:
        assert f"<h3>{html.escape(d.title)}</h3>" in body
        for k, v in diagnosis.evidence_items(d):
            assert f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" in body
        code = [p.text for p in d.fix if p.kind == "code"]
        assert code and all(f"<pre><code>{html.escape(c)}</code></pre>" in body for c in code)


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
