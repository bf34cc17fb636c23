"""How ampdoctor's objects show in a notebook: IPython's own display formatter finds their HTML; a finding shows
what the report's card shows; diagnose() returns a list that stays a list; names from the trace are escaped."""

import html
import re

import pytest
from ampdoctor.dashboards.report import finding_html
from IPython.core.formatters import DisplayFormatter
from runs import mlp, train

import ampdoctor
from ampdoctor.notebook import Findings


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    trace = str(tmp_path_factory.mktemp("nb") / "nb.db")
    train(mlp(width=32), steps=20, init_scale=2.0**30, trace=trace, attach_options={"live": False})
    return trace


def shown(obj) -> str:
    """What Jupyter shows for ``obj``: its text/html as IPython's formatter computes it."""
    data, _ = DisplayFormatter().format(obj)
    return data["text/html"]


def text(markup: str) -> str:
    return " ".join(
        html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<style>.*?</style>", "", markup, flags=re.S))).split()
    )


def test_findings_show_as_the_reports_cards_and_stay_a_list(run):
    found = ampdoctor.diagnose(run)
    assert isinstance(found, Findings) and isinstance(found, list)
    from ampdoctor.rules import diagnose as rules_diagnose

    plain = rules_diagnose(run)
    assert found == plain and plain == found and type(plain) is list  # equal to the plain list, element by element
    assert "init-scale-too-high" in [d.rule for d in found]
    for d in found:
        assert text(finding_html(d)) in text(shown(d))  # the report's card, word for word
    page = shown(found)
    assert page.count('class="finding ') == len(found) and f"{len(found)} finding(s)" in page
    assert "torch.amp.GradScaler(" in page


def test_trace_shows_its_summary_with_the_facts_of_ampdoctor_info(run, capsys):
    from ampdoctor.cli import main

    main(["info", run])
    info = {ln[:10].strip(): ln[10:].strip() for ln in capsys.readouterr().out.splitlines()}
    page = text(shown(ampdoctor.load(run)))
    for label in ("precision", "skipped", "non-finite"):
        assert f"{label} {info[label].split(':')[0]}" in page, label
    assert info["overhead"].split(" (")[0] in page  # "ampdoctor cost X% of this run"
    assert "20 recorded" in page


def test_rankrun_and_replay_show_as_tables(run, tmp_path):
    rr = ampdoctor.load_run([run])
    page = text(shown(rr))
    assert "1 rank(s) of world size 1" in page and "nb.db" in page
    rp = ampdoctor.replay(run)
    page = text(shown(rp))
    assert f"skipped {rp.n_skipped} (" in page and "gradient information lost" in page


def test_names_from_the_trace_are_escaped():
    d = ampdoctor.Diagnosis(
        rule="x", severity="warning", title="<script>alert(1)</script>", summary="a & b", layers=["<img src=x>"]
    )
    page = shown(d)
    assert "<script>" not in page and "<img" not in page and "&lt;script&gt;" in page
