"""`ampdoctor report`: one self-contained HTML file that names the findings."""
import re

import pytest

import ampdoctor
from ampdoctor.cli import main
from ampdoctor.dashboards import data, report

from dash_fakes import FakeDiagnosis, fake_diagnose


def _external_refs(text: str) -> list[str]:
    """src=/href= attributes of the HTML (script bodies aside: plotly.js holds URL strings it never fetches) that
    would make the browser fetch something."""
    markup = re.sub(r"<script[^>]*>.*?</script>", "<script></script>", text, flags=re.S)
    return [m for m in re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", markup)
            if not m.startswith(("#", "data:", "javascript:"))]


def test_report_is_self_contained_and_names_the_findings(traces, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", str(traces / "fp16_under.db"), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert _external_refs(text) == []
    assert not re.search(r"<script[^>]+src=", text) and not re.search(r"<link[^>]+href=", text)
    assert "Plotly.newPlot" in text and len(text) > 1_000_000          # plotly.js embedded, ~4.5 MB
    found = data.findings(ampdoctor.load(traces / "fp16_under.db"))
    assert found
    for d in found:
        assert d.rule in text and d.title in text
    assert "<pre><code>scaler = torch.amp.GradScaler(" in text          # the fix, as code
    assert "Precision map" in text and "FP16 underflow share" in text


def test_report_with_reference_compares(traces, tmp_path):
    out = tmp_path / "cmp.html"
    assert main(["report", str(traces / "fp16_bad.db"), "-o", str(out), "--reference", str(traces / "bf16.db")]) == 0
    text = out.read_text()
    assert "Compared with the reference" in text and "Loss: run vs reference" in text


def test_finding_html_escapes_and_renders_code():
    d = FakeDiagnosis(title="<script>alert(1)</script>", evidence={"ratio": 0.123456, "steps": list(range(20))})
    html = report.finding_html(d)
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "0.1235" in html and "... (20 in all)" in html
    assert "<pre><code>scaler = torch.amp.GradScaler(&#x27;cuda&#x27;, init_scale=2.0**16)</code></pre>" in html


def test_report_renders_findings_from_any_rules(traces, monkeypatch):
    monkeypatch.setattr(data, "_diagnose", fake_diagnose)
    text = report.build_report(ampdoctor.load(traces / "bf16.db"))
    assert "scale.overflow_skips" in text and "info.example" in text
    assert text.index("scale.overflow_skips") < text.index("info.example")     # worst first


@pytest.mark.parametrize("argv, message", [
    (["report", "/no/such/trace.db"], "ampdoctor report: /no/such/trace.db: no such file"),
    (["report", "{traces}/fp16_bad.db", "-o", "/no/such/dir/r.html"], "ampdoctor report: /no/such/dir: no such "
                                                                        "directory for the output"),
])
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
